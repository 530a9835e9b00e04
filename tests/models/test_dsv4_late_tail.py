"""DeepSeek-V4.1's decoder SWA bounded replay hands the Engram layers from late_layer_start
on a subset of the step's ids (`tail.rows(hash_ids)`), which the runtime gathers as they come:
Engram modes would not apply there (a token with Engram off would read real rows), so the
start is refused in one line before the weights load. Without modes, or with every Engram
layer before the tail, it loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engram_sglang.core.errors import EngramError
from tests.models.test_model_dsv4_hook import CFG, embeddings, open_runtime, parallel, table  # noqa: F401

pytest.importorskip("sglang.srt.layers.engram", reason="needs the installed sglang")


def load(runtime, layout, late_layer_start):
    from engram_sglang import plugin

    loaded = []

    class Model(nn.Module):
        def load_weights(self, weights):
            loaded.extend(weights)

    plugin.patch(SimpleNamespace(DeepseekV4ForCausalLM=Model), "sglang.srt.models.deepseek_v4")
    model = Model()
    model.model = SimpleNamespace(engram_hasher=None, late_layer_start=late_layer_start)
    model.embeds = nn.ModuleList(embeddings(runtime, layout).values())
    model.load_weights([("model.layers.2.engram.wkv.weight", torch.zeros(1))])
    return loaded


@pytest.mark.parametrize("late_layer_start, refused", [(3, True), (5, True), (6, False), (None, False)])
def test_engram_modes_with_an_engram_layer_in_the_late_tail_are_refused(parallel, table, late_layer_start, refused,
                                                                         caplog):
    from engram_sglang.serving.launch import ERROR_MARK

    table_dir, _, layout = table
    assert CFG.layer_ids == (2, 5)
    runtime = open_runtime(table_dir, "host", mode="prefill")
    try:
        if refused:
            with pytest.raises(EngramError, match=r"late-layer tail.*from \d+ on.*\[5\].*"
                                                  r"--no-enable-decoder-swa-bounded-replay") as e:
                load(runtime, layout, late_layer_start)
            assert "\n" not in str(e.value)
            # The log line carries the error mark: the launcher's failure line (never a notice).
            assert [r.getMessage() for r in caplog.records if "late-layer tail" in r.getMessage()] == [
                ERROR_MARK + str(e.value)]
        else:
            assert len(load(runtime, layout, late_layer_start)) == 1
    finally:
        runtime.close()


def test_without_modes_the_late_tail_loads(parallel, table):
    table_dir, _, layout = table
    runtime = open_runtime(table_dir, "host")
    try:
        assert len(load(runtime, layout, 3)) == 1
    finally:
        runtime.close()
