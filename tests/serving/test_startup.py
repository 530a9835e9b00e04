"""One start-up path (serving/startup.py `open_runtime`) for both model families, and one
spelling of the default table directory (`config.DEFAULT_TABLE_DIR`) in the package."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from engram_sglang.core.config import DEFAULT_TABLE_DIR
from engram_sglang.core.errors import EngramError
from engram_sglang.serving import startup
from engram_sglang.serving.settings import ServeSettings
from tests.support.tables import small_config

ROOT = Path(__file__).resolve().parents[2]
SERIAL = SimpleNamespace(tp_rank=0, tp_size=1, attn_dp_size=1, attn_cp_size=1)


@pytest.fixture
def calls(monkeypatch):
    """open_runtime replaced by a recorder: (args, kwargs) of every call; each returns a marker."""
    seen = []

    def record(*args, **kwargs):
        seen.append((args, kwargs))
        return "the runtime"

    monkeypatch.setattr(startup, "open_runtime", record)
    return seen


# ------------------------------------------------------------- both families call it
@pytest.mark.parametrize("tokenizer_path", [None, "/tok"])
def test_the_qwen3_family_starts_through_open_runtime(calls, monkeypatch, tokenizer_path):
    pytest.importorskip("sglang.srt.runtime_context", reason="needs the installed sglang")
    import sglang.srt.runtime_context as context

    from engram_sglang.models import qwen3_engram

    monkeypatch.setattr(context, "get_model", lambda: SimpleNamespace(model_path="/model"))
    monkeypatch.setattr(context, "get_serving", lambda: SimpleNamespace(tokenizer_path=tokenizer_path))
    monkeypatch.setattr(qwen3_engram, "get_parallel", lambda: SERIAL)
    cfg, settings = small_config(300), ServeSettings(placement="host")
    assert qwen3_engram._build_runtime(cfg, settings) == "the runtime"
    # One runtime per model (not per process), our hasher over the served tokenizer, plain TP ranks.
    assert calls == [((settings,), dict(parallel=SERIAL, model_path="/model", cfg=cfg,
                                        tokenizer_path=tokenizer_path or "/model"))]


def test_the_deepseek_hook_starts_through_open_runtime(calls, tmp_path):
    from engram_sglang.models.deepseek_v4_hook import process_runtime

    model = tmp_path / "model"
    model.mkdir()
    # No table directory configured and none in the model directory: upstream's own tables serve.
    assert process_runtime(settings=ServeSettings(), model_path=str(model), parallel=SERIAL) is None
    assert calls == []
    (model / DEFAULT_TABLE_DIR).mkdir()
    settings = ServeSettings(placement="host")
    assert process_runtime(settings=settings, model_path=str(model), device="cpu", parallel=SERIAL) == "the runtime"
    # One runtime per process, upstream's hasher (no tokenizer), attention DP/CP ranks read whole rows.
    assert calls == [((settings,), dict(parallel=SERIAL, table_dir=model / DEFAULT_TABLE_DIR, model_path=str(model),
                                        device="cpu", attention_parallel=True, per_process=True))]
    # Staged disk graphs serve DeepSeek too (tests/models/test_dsv4_staged_graphs.py) ...
    process_runtime(settings=ServeSettings(placement="disk", disk_graphs=True), model_path=str(model), parallel=SERIAL)
    assert len(calls) == 2
    # ... except what they do not cover, refused before anything opens.
    import engram_sglang.models.deepseek_v4_hook as hook

    real, hook.staged_graphs_refusal = hook.staged_graphs_refusal, lambda: "DSpark speculative decoding ..."
    try:
        with pytest.raises(EngramError, match="start without it"):
            process_runtime(settings=ServeSettings(placement="disk", disk_graphs=True), model_path=str(model),
                            parallel=SERIAL)
    finally:
        hook.staged_graphs_refusal = real
    assert len(calls) == 2


# ------------------------------------------------------------------ what it does
def test_a_table_dir_flag_naming_a_file_or_fifo_is_not_a_directory(tmp_path):
    import os
    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "p")
    for name in ("f", "p"):
        with pytest.raises(EngramError, match=f"--engram-table-dir {tmp_path / name} is not a directory"):
            startup.resolve_table_dir(ServeSettings(table_dir=str(tmp_path / name)), None)


def test_the_table_directory_is_the_flag_else_the_models_default(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    flag = ServeSettings(table_dir=str(tmp_path / "t"))
    for required in (True, False):
        assert startup.resolve_table_dir(flag, str(model), required=required) == tmp_path / "t"
    # Required: the default whether or not it exists (opening it names what is missing).
    assert startup.resolve_table_dir(ServeSettings(), str(model)) == model / DEFAULT_TABLE_DIR
    with pytest.raises(EngramError, match="no Engram table directory: set --engram-table-dir"):
        startup.resolve_table_dir(ServeSettings(), None)
    # Optional: None until the model directory has one.
    assert startup.resolve_table_dir(ServeSettings(), str(model), required=False) is None
    assert startup.resolve_table_dir(ServeSettings(), None, required=False) is None
    (model / DEFAULT_TABLE_DIR).mkdir()
    assert startup.resolve_table_dir(ServeSettings(), str(model), required=False) == model / DEFAULT_TABLE_DIR


@pytest.fixture(scope="module")
def tokenizer_and_tables(tmp_path_factory, bytelevel_tokenizer):
    """A tokenizer saved to a directory, and tables for a config of its compressed size."""
    from engram_sglang.core.hashing import compressed_token_map
    from engram_sglang.core.tablefile import write_tables
    from tests.support.tables import random_rows

    root = tmp_path_factory.mktemp("startup")
    bytelevel_tokenizer.save_pretrained(root / "tok")
    _, size = compressed_token_map(bytelevel_tokenizer)
    cfg = small_config(size, layer_ids=(1,), max_ngram_size=3, n_heads=2, vocab_size=3001)
    return root / "tok", cfg, write_tables(root / "tables", cfg, random_rows(cfg), progress=False)


def test_our_hasher_or_the_models_own_one_runtime_per_model_or_per_process(tokenizer_and_tables):
    from engram_sglang.serving.history import StepHasher
    from engram_sglang.serving.runtime import active_runtimes

    tok, cfg, tables = tokenizer_and_tables
    settings = ServeSettings(placement="host")
    opened = []
    try:
        # The Qwen3 family's: a StepHasher over the tokenizer, a new runtime per model, none marked.
        for _ in range(2):
            opened.append(startup.open_runtime(settings, parallel=SERIAL, table_dir=tables, cfg=cfg,
                                               tokenizer_path=str(tok), device="cpu"))
        a, b = opened
        assert a is not b and isinstance(a.step_hasher, StepHasher) and a.hasher is not None
        assert getattr(a, "hook_key", None) is None and a.context_parallel is False
        # DeepSeek-V4.1's: no hasher until the model's is attached, one runtime per process.
        opened.append(startup.open_runtime(settings, parallel=SERIAL, table_dir=tables, device="cpu",
                                           per_process=True))
        c = opened[-1]
        assert c.step_hasher is None and c.hasher is None
        assert c.cfg.source.endswith("manifest.json") and c.cfg.layer_ids == cfg.layer_ids  # the tables' own
        assert startup.open_runtime(settings, parallel=SERIAL, table_dir=tables, device="cpu", per_process=True) is c
        assert c.hook_key == (str(tables), "host", "cpu", 0, 1)
        assert {a, b, c} <= set(active_runtimes())
    finally:
        for runtime in opened:
            runtime.close()


def test_a_configuration_error_is_one_logged_line_and_opens_nothing(tokenizer_and_tables, tmp_path, caplog):
    from engram_sglang.core.errors import TokenizerMismatchError
    from engram_sglang.serving.runtime import active_runtimes

    tok, cfg, tables = tokenizer_and_tables
    before = set(active_runtimes())
    other = small_config(cfg.compressed_vocab_size + 1, layer_ids=(1,), max_ngram_size=3, n_heads=2, vocab_size=3001)
    with caplog.at_level(logging.ERROR, logger="engram_sglang"), pytest.raises(TokenizerMismatchError):
        startup.open_runtime(ServeSettings(placement="host"), parallel=SERIAL, table_dir=tables, cfg=other,
                             tokenizer_path=str(tok), device="cpu")
    # Modes on a context-parallel rank's slice: the runtime opened, then refused and closed.
    cp = SimpleNamespace(tp_rank=1, tp_size=2, attn_dp_size=1, attn_cp_size=2)
    settings = ServeSettings(placement="host", host_shared=True, shm_dir=str(tmp_path), mode="off")
    with caplog.at_level(logging.ERROR, logger="engram_sglang"), pytest.raises(EngramError, match="context-parallel"):
        startup.open_runtime(settings, parallel=cp, table_dir=tables, device="cpu", attention_parallel=True,
                             per_process=True)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 2 and all(m.startswith("engram-sglang: ") and "\n" not in m for m in lines), lines
    assert "distinct tokens" in lines[0] and "context-parallel" in lines[1]
    assert set(active_runtimes()) == before


# ------------------------------------------------- the checkpoint the tables came from
def _model_dir(path, cfg, tensors):
    """A model directory of `cfg` whose checkpoint is one shard of `tensors` (its header is what is hashed)."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.hash_fields()))
    save_file({k: torch.zeros(n) for k, n in tensors.items()}, path / "model.safetensors")
    return path


def test_tables_of_another_checkpoint_do_not_start_unless_told(tokenizer_and_tables, tmp_path, caplog):
    """Mismatch fails in one line naming both hashes and the override; the override and the
    matching checkpoint start; tables without provenance start with one warning, and once
    recorded (`tables verify --model --record`) start without it."""
    import shutil

    from engram_sglang.core.errors import EngramConfigError
    from engram_sglang.core.tablefile import checkpoint_hash, read_manifest
    from engram_sglang.serving.runtime import active_runtimes
    from engram_sglang.tools.cli import main

    tok, cfg, written = tokenizer_and_tables
    tables = tmp_path / "tables"
    shutil.copytree(written, tables)
    ours, theirs = _model_dir(tmp_path / "ours", cfg, {"a": 4}), _model_dir(tmp_path / "theirs", cfg, {"a": 5})
    start = dict(parallel=SERIAL, table_dir=tables, cfg=cfg, device="cpu")
    host = ServeSettings(placement="host")

    def opens(settings, model):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engram_sglang"):
            startup.open_runtime(settings, model_path=str(model), **start).close()
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    # No provenance (what older converts wrote): one warning saying how to record it.
    warned = opens(host, ours)
    assert len(warned) == 1 and "records no checkpoint" in warned[0], warned
    assert f"engram-sglang tables verify {tables} --model {ours} --record" in warned[0]
    assert main(["tables", "verify", str(tables), "--model", str(ours), "--record"]) == 0
    assert read_manifest(tables)[0]["provenance"]["checkpoint_sha256"] == checkpoint_hash(ours)[0]
    assert opens(host, ours) == []  # recorded: checked, and it matches
    before = set(active_runtimes())
    with caplog.at_level(logging.ERROR, logger="engram_sglang"), pytest.raises(EngramConfigError) as e:
        startup.open_runtime(host, model_path=str(theirs), **start)
    message = str(e.value)
    assert "\n" not in message and set(active_runtimes()) == before  # nothing opened
    for word in (checkpoint_hash(ours)[0], checkpoint_hash(theirs)[0], "--engram-skip-provenance",
                 "ENGRAM_SKIP_PROVENANCE"):
        assert word in message, message
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [f"engram-sglang: error: {message}"]
    # The override, as the flag's variable: starts without a word.
    skip = ServeSettings.from_env({"ENGRAM_PLACEMENT": "host", "ENGRAM_SKIP_PROVENANCE": "1"})
    assert skip.skip_provenance is True and opens(skip, theirs) == []
    # No model path, or no checkpoint files in it: nothing to compare, nothing said.
    (tmp_path / "bare").mkdir()
    assert opens(host, tmp_path / "bare") == []


# --------------------------------------------------------- one spelling of the default
def default_table_dir_spellings(package: Path) -> list[str]:
    """file:line of every string value in the package that spells the default table directory's
    name (f-string parts included; docstrings are prose and do not count)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and DEFAULT_TABLE_DIR in node.value):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_default_table_dir_is_the_one_spelling_in_the_package():
    assert DEFAULT_TABLE_DIR == "engram_tables"
    found = default_table_dir_spellings(ROOT / "engram_sglang")
    line = next(i for i, text in enumerate((ROOT / "engram_sglang" / "core" / "config.py").read_text().splitlines(), 1)
                if text.startswith("DEFAULT_TABLE_DIR = "))
    assert found == [f"engram_sglang/core/config.py:{line}"], found


def test_another_spelling_is_found(tmp_path):
    package = tmp_path / "engram_sglang"
    (package / "serving").mkdir(parents=True)
    (package / "core").mkdir()
    (package / "core" / "config.py").write_text('"""Tables live in MODEL/engram_tables."""\nDEFAULT_TABLE_DIR = "engram_tables"\n')
    assert default_table_dir_spellings(package) == ["engram_sglang/core/config.py:2"]  # the docstring does not count
    (package / "serving" / "x.py").write_text('def f(m):\n    """m/engram_tables"""\n    return f"{m}/engram_tables"\n')
    assert default_table_dir_spellings(package) == ["engram_sglang/core/config.py:2", "engram_sglang/serving/x.py:3"]
