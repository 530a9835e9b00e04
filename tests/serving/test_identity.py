"""What every TP rank must share (serving/identity.py): the tables' content and the settings
that change outputs, and the one line a mismatch gives. The collective itself runs across two
simulated nodes in tests/e2e/test_e2e_multinode.py."""

from __future__ import annotations

import shutil

import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.core.tablefile import layer_file_name
from engram_sglang.serving.identity import _as_int64, check_agreement, serving_identity
from engram_sglang.serving.settings import ServeSettings
from tests.support.tables import random_table_dir, small_config

CFG = small_config(300, layer_ids=(1, 3), n_heads=2)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("a"), CFG)[0], random_table_dir(tmp_path_factory.mktemp("b"), CFG)[0]


def test_the_same_tables_anywhere_are_one_identity_and_other_rows_another(tables, tmp_path):
    a, b = tables
    copy = shutil.copytree(a, tmp_path / "elsewhere")  # another node's copy of the same version
    s = ServeSettings()
    assert serving_identity(copy, s) == serving_identity(a, s)
    assert serving_identity(b, s)["tables"] != serving_identity(a, s)["tables"]  # other random rows
    # Placement, caches and I/O knobs do not change outputs: not part of it.
    assert serving_identity(a, ServeSettings(placement="disk", disk_threads=3)) == serving_identity(a, s)


@pytest.mark.parametrize("change", [{"mode": "off"}, {"mode": "prefill"}, {"ablation": True},
                                    {"debug": ("corrupt-history",)}])
def test_each_output_changing_setting_changes_it(tables, change):
    base, other = serving_identity(tables[0], ServeSettings()), serving_identity(tables[0], ServeSettings(**change))
    assert base["tables"] == other["tables"] and base["settings"] != other["settings"]
    assert _as_int64(base) != _as_int64(other) and 0 <= _as_int64(other) < 2**63


def test_agreement_passes_only_when_every_rank_has_rank_0s_value(tables):
    ident = serving_identity(tables[0], ServeSettings())
    check_agreement([(7, 0), (7, 0), (7, 1), (7, 1)], ident, 2)  # four ranks on two nodes agree
    with pytest.raises(EngramError) as e:
        check_agreement([(7, 0), (7, 0), (8, 1), (7, 1)], ident, 3)
    msg = str(e.value)
    assert "\n" not in msg and "rank 2 (node 1) differ from rank 0 (node 0); this rank 3 (node 1) has tables " in msg
    assert ident["tables"] in msg and "mode=on ablation=False debug=" in msg


def test_a_layer_file_changed_in_place_is_not_what_the_manifest_names(tables, tmp_path):
    """The identity is the manifest's checksums (cheap: no row is read at start-up); a layer file
    that no longer matches them is `tables verify`'s to find, and the disk tier's at run time."""
    d = shutil.copytree(tables[0], tmp_path / "t")
    before = serving_identity(d, ServeSettings())
    with open(d / layer_file_name(1), "r+b") as f:
        f.seek(5000)
        f.write(b"\xff")
    assert serving_identity(d, ServeSettings()) == before
