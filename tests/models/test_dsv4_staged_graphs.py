"""Issue 24, deliverable 1: DeepSeek-V4.1's decode graphs kept with the disk tier, through
upstream SGLang's own EngramHasher and our StoreEngramEmbedding (DeepSeek's attention has no
CPU path, so module level, as tests/models/test_model_dsv4_hook.py). Before each replay the
plugin peeks at the step's ids over the hasher's history (`SequenceHasher.peek_step`: decode
and target-verify windows, upstream's `hash_windows`) and stages their rows into fixed
buffers; the captured lookups read only those. Checked: the staged rows equal the eager
path's (upstream's forward, which then commits) bit for bit over changing batches, positions
at the sequence start and verify blocks; the captured part passes the capture fixture; a
corrupted peek fails the comparison; what is not covered is refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engram_sglang.core.errors import EngramError
from engram_sglang.core.rowformat import ROW_VALUES, bf16_bits
from engram_sglang.core.stores import maintenance
from tests.models.test_model_dsv4_hook import (  # noqa: F401  (fixtures)
    CFG,
    batch,
    embeddings,
    expected,
    open_runtime,
    parallel,
    table,
    upstream_hasher,
)

CAPACITY = 32  # tokens per staged buffer: the largest "captured graph"


@pytest.fixture
def served(parallel, table, rng):  # noqa: F811
    """A disk runtime with staged rows, upstream's hasher attached, and every slot's history
    set by an eager prefill through the runtime."""
    from engram_sglang.serving import staged_rows

    table_dir, packed, layout = table
    runtime = open_runtime(table_dir, "disk", disk_graphs=True)
    try:
        assert runtime.staged is not None and sorted(runtime.staged.layers) == sorted(CFG.layer_ids)
        embeds = embeddings(runtime, layout)
        hasher, _ = upstream_hasher(rng)
        slots = list(range(8))
        lens = [int(n) for n in torch.randint(1, 6, (8,), generator=rng)]
        prompt = torch.randint(0, CFG.vocab_size, (sum(lens),), generator=rng)
        positions = torch.cat([torch.arange(n) for n in lens])
        hasher(prompt, batch("extend", slots, lens, positions.tolist(), prompt))  # commits each slot's history
        maintenance.between_steps()
        staged_rows.reserve_for_capture(SimpleNamespace(engram_runtime=runtime), CAPACITY)
        yield SimpleNamespace(runtime=runtime, embeds=embeds, hasher=hasher, packed=packed,
                              next_pos={s: n for s, n in zip(slots, lens)}, model=SimpleNamespace(engram_runtime=runtime))
    finally:
        runtime.close()


def decode_batch(served, slots, rng, *, verify_block=0):
    n = verify_block or 1
    tokens = torch.randint(0, CFG.vocab_size, (len(slots) * n,), generator=rng)
    positions = [served.next_pos[s] + j for s in slots for j in range(n)]
    if verify_block:
        return batch("verify", slots, [n] * len(slots), positions, tokens)
    return batch("decode", slots, [1] * len(slots), positions, tokens)


def staged_matches_eager(served, fb) -> bool:
    """Stage `fb` as the plugin does before a replay, then run the eager step (upstream's
    forward, which commits decode history) and compare every layer's rows, bit for bit; rows
    past the step's tokens must be +0.0. Also checks the eager rows against the table."""
    from engram_sglang.serving import staged_rows

    staged = served.runtime.staged
    staged_rows.stage_before_replay(served.model, fb)
    got = {L: staged.buffers[L].clone() for L in staged.layers}
    ids = served.hasher(fb.input_ids, fb)
    tokens = ids.shape[0]
    same = True
    for i, L in enumerate(CFG.layer_ids):
        eager = served.embeds[L](ids[:, i], fb)
        assert torch.equal(bf16_bits(eager), expected(served.packed[L], ids[:, i]))
        same &= torch.equal(bf16_bits(got[L][:tokens]), bf16_bits(eager))
        assert not bf16_bits(got[L][tokens:]).any()
    maintenance.between_steps()
    if fb.forward_mode.is_decode():
        for s in fb.req_pool_indices.tolist():
            served.next_pos[s] += 1
    return same


def test_dsv4_staged_decode_rows_equal_the_eager_path_over_changing_batches(served, rng):
    # Batches that grow, shrink and skip slots; the first steps of short prompts look back past
    # the sequence start (blocked windows); each step's commit changes the next step's windows.
    for slots in ([0, 1, 2], [3, 4, 5, 6, 7, 0, 1], [2], [7, 5, 3, 1], list(range(8)), [6]):
        assert staged_matches_eager(served, decode_batch(served, slots, rng)), slots
    assert served.runtime.staged.staged_steps == 6


@pytest.mark.parametrize("block", [2, 3])
def test_dsv4_staged_target_verify_blocks_equal_the_eager_path(served, rng, block):
    """MTP/EAGLE target-verify: a block of draft tokens per request, windows reaching into the
    history and into the block's earlier drafts (upstream's verify does not commit)."""
    assert staged_matches_eager(served, decode_batch(served, [4, 0, 6], rng, verify_block=block))
    assert staged_matches_eager(served, decode_batch(served, [1], rng, verify_block=block))
    assert staged_matches_eager(served, decode_batch(served, [4, 0, 6], rng))  # a decode step after


def test_dsv4_staged_negative_control_a_corrupted_peek_fails(served, rng, monkeypatch):
    """The comparison can fail: a peek that reads a stale history (one slot's newest token off
    by one) stages other rows than the step's forward reads."""
    from engram_sglang.serving.history import SequenceHasher

    real = SequenceHasher.peek_step

    def corrupted(self, input_ids, forward_batch):
        history = self.module.history
        saved = history.clone()
        history[forward_batch.req_pool_indices[0], -1] += 1
        try:
            return real(self, input_ids, forward_batch)
        finally:
            history.copy_(saved)

    monkeypatch.setattr(SequenceHasher, "peek_step", corrupted)
    assert not staged_matches_eager(served, decode_batch(served, [2, 3], rng))


def test_dsv4_staged_captured_part_reads_only_the_fixed_buffers(served, rng):
    """Upstream's hasher and both lookups captured (the capture fixture: fakes, no host sync, no
    Python state changed): each lookup is a view of its staged buffer, never a disk read."""
    from tests.support.capture import capture

    runtime, hasher = served.runtime, served.hasher
    with capture(runtime, hasher, *runtime.stores.values()) as cap:
        fake = decode_batch(served, list(range(8)), rng)
        for name in ("req_pool_indices", "positions", "out_cache_loc", "input_ids"):
            setattr(fake, name, cap.fake(getattr(fake, name)))
        ids = hasher(fake.input_ids, fake)
        for i, L in enumerate(CFG.layer_ids):
            rows = served.embeds[L](ids[:, i], fake)
            assert rows.shape == (8, ids.shape[2], ROW_VALUES)
    # Outside the capture the buffers are the real ones again, untouched by it.
    assert all(not bf16_bits(b).any() for b in runtime.staged.buffers.values())


def test_dsv4_staged_peek_leaves_the_history_as_it_is(served, rng):
    from engram_sglang.serving.history import SequenceHasher

    fb = decode_batch(served, [0, 5], rng)
    before = served.hasher.history.clone()
    ids, token_req = served.runtime.peek_step(fb.input_ids, fb)
    assert torch.equal(served.hasher.history, before) and token_req.tolist() == [0, 5]
    assert isinstance(served.runtime.hasher, SequenceHasher)
    assert torch.equal(ids, served.hasher(fb.input_ids, fb))  # the forward's ids, which then commits
    assert not torch.equal(served.hasher.history, before)
    maintenance.between_steps()
    with pytest.raises(EngramError, match="staged Engram rows peek at decode and target-verify steps; got a EXTEND"):
        served.runtime.peek_step(fb.input_ids, batch("extend", [0], [2], [0, 1], fb.input_ids))


def test_dsv4_staged_refuses_what_it_does_not_cover_in_one_line(table, monkeypatch):  # noqa: F811
    from engram_sglang.models import deepseek_v4_hook as hook

    features = SimpleNamespace(enable_encoder_swa_bounded_replay=False)
    assert hook.staged_graphs_refusal(SimpleNamespace(speculative_algorithm="EAGLE"), features) is None
    assert hook.staged_graphs_refusal(SimpleNamespace(speculative_algorithm=None), features) is None
    assert "DSpark" in hook.staged_graphs_refusal(SimpleNamespace(speculative_algorithm="DSPARK"), features)
    replay = SimpleNamespace(enable_encoder_swa_bounded_replay=True)
    assert "encoder SWA bounded replay" in hook.staged_graphs_refusal(SimpleNamespace(speculative_algorithm=None), replay)
    table_dir, _, layout = table
    monkeypatch.setattr(hook, "staged_graphs_refusal", lambda: "DSpark speculative decoding commits ...")
    with pytest.raises(EngramError, match=r"^--engram-disk-graphs on: DSpark .*: start without it$"):
        open_runtime(table_dir, "disk", disk_graphs=True)
    monkeypatch.undo()
    # An Engram layer in decoder SWA bounded replay's late-layer tail gets a subset of the
    # step's ids, which staged buffers do not hold: refused at load, before the weights.
    runtime = open_runtime(table_dir, "disk", disk_graphs=True)
    try:
        embeds = list(embeddings(runtime, layout).values())
        with pytest.raises(EngramError, match="decoder SWA bounded replay runs Engram layer"):
            hook.check_late_layer_tail(SimpleNamespace(late_layer_start=CFG.layer_ids[-1]), embeds)
        hook.check_late_layer_tail(SimpleNamespace(late_layer_start=CFG.layer_ids[-1] + 1), embeds)
    finally:
        runtime.close()
