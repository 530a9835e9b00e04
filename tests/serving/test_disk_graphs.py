"""Decode CUDA graphs kept with the disk tier (serving/staged_rows.py), proved on the CPU:

* the staged rows equal the eager path's bit for bit (random ids, several steps of changing
  batch sizes; rows past a step's tokens, a padded graph's rows, are +0.0), for the disk
  store alone, behind a DRAM row cache, behind a hot-row cache, and as one TP shard; and on
  the GPU code path (tests/support/fake_streams.py: ids from the device, ordered copies, no hazard);
* the captured part (EngramRuntime.begin + rows with staged buffers) passes the capture
  fixture (no host sync, no Python state advanced); a negative control that reads the store
  there raises;
* a "replay": the captured part traced once (make_fx, which holds the buffers by reference
  as a CUDA graph holds their addresses), then run after each step's staging: exact rows;
* the hasher's peek gives the ids its forward computes and commits nothing;
* the plugin's wraps of SGLang's decode graph runner reserve before capture and stage
  before each replay; a failed read fails only the step's requests; what they rely on in
  the installed SGLang is there;
* the graph policy: decode graphs kept for disk with --engram-disk-graphs on and the overlap
  scheduler off, refused (one line) otherwise.

What needs a GPU (a real capture and replay) is bench/decode_step.py's "disk staged graph"
variant, run by `make gpu-check`.
"""

from __future__ import annotations

import types
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.errors import EngramConfigError, EngramError
from engram_sglang.core.hashing import EngramLayout, NgramHasher
from engram_sglang.core.rowformat import ROW_VALUES, bf16_bits
from engram_sglang.core.stores import maintenance, open_store
from engram_sglang.core.stores.base import Prefetch, TableIOError, TableReadFault
from engram_sglang.serving import graphs
from engram_sglang.serving.settings import ServeSettings
from engram_sglang.serving.staged_rows import StagedRows
from tests.support.capture import HostSync, capture
from tests.support.tables import held_mask, random_table_dir, small_config

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)
C = CFG.hash_columns
CAP = 16  # tokens of the largest "captured" batch


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("tables"), CFG)


def reference(rows: np.ndarray, ids: torch.Tensor, ranges=None) -> torch.Tensor:
    """bf16 bits of the rows of ids; ids outside the shard's row `ranges` read +0.0."""
    flat = ids.reshape(-1).numpy()
    packed = rows[flat].copy()
    if ranges is not None:
        packed[~held_mask(flat, ranges)] = 0
    return bf16_bits(rowformat.dequantize(torch.from_numpy(packed)).view(*ids.shape, ROW_VALUES))


def random_ids(rng, tokens: int) -> torch.Tensor:
    """Hash ids [T, n_layers, C] inside each layer's table."""
    cols = [torch.randint(0, LAYOUT.rows(L), (tokens, 1, C), generator=rng) for L in CFG.layer_ids]
    return torch.cat(cols, 1)


def staged_for(stores) -> StagedRows:
    staged = StagedRows(stores, {L: i for i, L in enumerate(CFG.layer_ids)}, C, torch.device("cpu"))
    staged.reserve(CAP)
    return staged


def close(stores):
    for s in stores.values():
        s.close()


# ------------------------------------------------------------------ bits
@pytest.mark.parametrize("how", ["disk", "disk + DRAM cache", "disk + hot-row cache", "disk, TP shard 1 of 2"])
def test_staged_rows_equal_the_eager_path(tables, rng, how):
    table_dir, rows = tables
    kw = {"disk + DRAM cache": dict(dram_cache_bytes=64 << 10), "disk + hot-row cache": dict(cache_bytes=64 << 10),
          "disk, TP shard 1 of 2": dict(tp_rank=1, tp_size=2)}.get(how, {})
    stores = open_store(table_dir, "disk", cfg=CFG, **kw)
    try:
        staged = staged_for(stores)
        assert sorted(staged.layers) == sorted(CFG.layer_ids)
        for tokens in (CAP, 5, 11, 1, CAP, 3):  # shrinking and growing: stale rows must be cleared
            ids = random_ids(rng, tokens)
            assert staged.stage(ids) == tokens
            for i, L in enumerate(CFG.layer_ids):
                buf = bf16_bits(staged.buffers[L])
                eager = bf16_bits(stores[L].gather(ids[:, i]))
                assert torch.equal(buf[:tokens], eager), f"{how}: layer {L}, {tokens} tokens"
                assert torch.equal(eager, reference(rows[L], ids[:, i], stores[L].row_ranges))
                assert not buf[tokens:].any(), f"{how}: padded rows past {tokens} tokens are not +0.0"
            maintenance.between_steps()
        assert staged.staged_steps == 6
    finally:
        close(stores)


def test_staging_on_a_gpu_takes_the_stores_stream_path_in_order(tables, rng):
    """The GPU path, with the recording stand-in for the stream operations: device ids go to
    pinned memory on the forward stream, each store's worker waits for that copy, the rows
    are copied in and decoded on the forward stream, then copied into the buffers; no
    hazard over many steps of changing sizes, bits exact."""
    from tests.support.fake_streams import RecordingStreams

    table_dir, rows = tables
    stores = open_store(table_dir, "disk", cfg=CFG)
    fake = RecordingStreams()
    for s in stores.values():
        s._streams = fake
    try:
        staged = staged_for(stores)
        for step, tokens in enumerate((CAP, 3, 9, CAP, 1, 12, 6, 2)):
            ids = random_ids(rng, tokens)
            staged.stage(ids)
            for i, L in enumerate(CFG.layer_ids):
                buf = bf16_bits(staged.buffers[L])
                assert torch.equal(buf[:tokens], reference(rows[L], ids[:, i])), f"step {step}, layer {L}"
                assert not buf[tokens:].any()
            if step % 3 == 2:
                fake.flush()  # the GPU catches up only now and then
        fake.flush()
        assert fake.hazards == []
        assert len(fake.ops("to_host")) == 8 * len(CFG.layer_ids)  # the ids, from the device, per layer and step
        assert all(e[2] is fake.default for e in fake.ops("to_device"))
    finally:
        close(stores)


def test_reserve_and_stage_refuse_what_would_break_a_graph(tables, rng):
    table_dir, _ = tables
    stores = open_store(table_dir, "disk", cfg=CFG)
    try:
        staged = staged_for(stores)
        staged.reserve(CAP // 2)  # smaller: the buffers stay
        with pytest.raises(EngramError, match="capture the largest size first"):
            staged.reserve(2 * CAP)  # would move buffers a captured graph holds
        with pytest.raises(EngramError, match=f"a step of {CAP + 1} tokens, but the buffers hold {CAP}"):
            staged.stage(random_ids(rng, CAP + 1))
        with pytest.raises(EngramError, match="reserve"):
            staged.view(CFG.layer_ids[0], CAP + 1)
        # A device or host placement has nothing to stage.
        host = open_store(table_dir, "host", cfg=CFG)
        try:
            assert not StagedRows(host, {L: i for i, L in enumerate(CFG.layer_ids)}, C, "cpu").layers
        finally:
            close(host)
    finally:
        close(stores)


# ------------------------------------------------------------------ the captured part
def make_runtime(table_dir, rng, **settings):
    from engram_sglang.serving.runtime import EngramRuntime

    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    runtime = EngramRuntime(CFG, hasher, ServeSettings(placement="disk", disk_graphs=True, **settings), table_dir,
                            torch.device("cpu"))
    runtime.staged.reserve(CAP)
    return runtime


def captured_part(runtime, hash_ids, tokens):
    """What the captured decode forward does with Engram: begin, each layer's rows, end."""
    step = runtime.begin(hash_ids, torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int64),
                         torch.zeros(tokens, dtype=torch.int64), "decode")
    out = [runtime.rows(step, L) for L in CFG.layer_ids]
    runtime.end(step, 0.0, 0.0, len(CFG.layer_ids))
    return out


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_captured_part_passes_the_capture_fixture(tables, rng, prefetch):
    table_dir, rows = tables
    runtime = make_runtime(table_dir, rng, prefetch=prefetch)
    try:
        ids = random_ids(rng, CAP)
        runtime.staged.stage(ids)
        watched = (runtime, runtime.staged, *runtime.stores.values())
        with capture(*watched) as cap:
            got = captured_part(runtime, cap.fake(ids, "cuda"), CAP)
            assert [tuple(g.shape) for g in got] == [(CAP, C, ROW_VALUES)] * len(CFG.layer_ids)
        # The real buffers were never touched by the fake run: still the staged rows.
        for i, L in enumerate(CFG.layer_ids):
            assert torch.equal(bf16_bits(runtime.staged.buffers[L]), reference(rows[L], ids[:, i]))
    finally:
        runtime.close()


def test_negative_control_a_store_read_in_the_captured_part_raises(tables, rng, monkeypatch):
    """The same captured part, its staged handle replaced by a read of the store (what the
    runtime did before): the fixture stops it at the read's host sync."""
    table_dir, _ = tables
    runtime = make_runtime(table_dir, rng)
    try:
        ids = random_ids(rng, CAP)
        runtime.staged.stage(ids)
        step_ids = {}

        def reads_the_store(layer_id, tokens):
            return Prefetch(rows=runtime.stores[layer_id].gather(step_ids["ids"][:, runtime.layer_index[layer_id]]))

        monkeypatch.setattr(runtime.staged, "handle", reads_the_store)
        with pytest.raises(HostSync, match="blocking device-to-host copy"):
            with capture(runtime, *runtime.stores.values()) as cap:
                step_ids["ids"] = cap.fake(ids, "cuda")
                captured_part(runtime, step_ids["ids"], CAP)
        # And staging itself refuses to run inside a capture.
        with pytest.raises(EngramError, match="never inside a CUDA-graph capture"):
            with capture(runtime.staged) as cap:
                StagedRows.stage(runtime.staged, cap.fake(ids))
    finally:
        runtime.close()


def test_replays_read_what_was_staged_before_each(tables, rng, monkeypatch):
    """The captured part traced once at the largest batch (its graph holds the buffers by
    reference, as a CUDA graph holds their addresses), then replayed after each step's
    staging with fewer real tokens (SGLang pads to the captured size): real rows exact,
    padded rows +0.0."""
    from torch.fx.experimental.proxy_tensor import make_fx

    table_dir, rows = tables
    runtime = make_runtime(table_dir, rng)
    try:
        with monkeypatch.context() as m:
            m.setattr(maintenance, "capturing", lambda: True)
            graph = make_fx(lambda ids: captured_part(runtime, ids, CAP))(random_ids(rng, CAP))
        for tokens in (CAP, 7, 12, 2):
            ids = random_ids(rng, tokens)
            runtime.staged.stage(ids)
            padded = torch.cat([ids, torch.zeros(CAP - tokens, *ids.shape[1:], dtype=ids.dtype)])
            got = graph(padded)  # a replay: no Python of the runtime or the stores runs
            for i, L in enumerate(CFG.layer_ids):
                bits = bf16_bits(got[i])
                assert torch.equal(bits[:tokens], reference(rows[L], ids[:, i])), f"layer {L}, {tokens} tokens"
                assert not bits[tokens:].any()
            maintenance.between_steps()
    finally:
        runtime.close()


# ------------------------------------------------------------------ SGLang glue
def decode_batch(slots, tokens, rng):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, input_ids=torch.randint(0, CFG.vocab_size, (tokens,), generator=rng),
        positions=torch.randint(8, 100, (tokens,), generator=rng), req_pool_indices=slots,
        out_cache_loc=torch.arange(1, tokens + 1), extend_seq_lens=None, engram_history=None)


def with_history(runtime, rng, slots: int = 8):
    hasher = runtime.step_hasher
    hasher.history = torch.randint(0, CFG.vocab_size, (slots + 1, CFG.max_ngram_size - 1), generator=rng,
                                   dtype=torch.int32)
    return hasher


def test_peek_decode_gives_forwards_ids_and_commits_nothing(tables, rng):
    table_dir, _ = tables
    runtime = make_runtime(table_dir, rng)
    try:
        hasher = with_history(runtime, rng)
        fb = decode_batch(torch.tensor([3, 1, 6, 4]), 4, rng)
        before = hasher.history.clone()
        peeked = hasher.peek_decode(fb.input_ids, fb)
        assert torch.equal(hasher.history, before)
        out = hasher(fb.input_ids, fb)
        ids = out[0] if isinstance(out, tuple) else out
        assert torch.equal(peeked, ids) and not torch.equal(hasher.history, before)  # forward commits
    finally:
        runtime.close()


def test_the_plugin_stages_before_each_replay_and_reserves_before_capture(tables, rng):
    from engram_sglang import plugin

    table_dir, rows = tables
    runtime = make_runtime(table_dir, rng)
    try:
        hasher = with_history(runtime, rng)
        calls = []

        class DecodeCudaGraphRunner:
            max_bs, captured_req_width = CAP, 1

            def capture(self):
                calls.append(("capture", runtime.staged.capacity))

            def execute(self, forward_batch, pp_proxy_tensors=None):
                calls.append(("replay", forward_batch.input_ids.shape[0]))
                return "out"

        plugin.patch(types.SimpleNamespace(DecodeCudaGraphRunner=DecodeCudaGraphRunner),
                     "sglang.srt.model_executor.runner.decode_cuda_graph_runner")
        runner = DecodeCudaGraphRunner()
        runner.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(runtime=runtime))
        runner.capture()
        fb = decode_batch(torch.tensor([2, 5, 7]), 3, rng)
        ids = hasher.peek_decode(fb.input_ids, fb)
        assert runner.execute(fb) == "out" and calls == [("capture", CAP), ("replay", 3)]
        for i, L in enumerate(CFG.layer_ids):
            assert torch.equal(bf16_bits(runtime.staged.buffers[L][:3]), reference(rows[L], ids[:, i]))
        # A failed read fails the step's requests (the runtime's containment), the rest goes on.
        store = runtime.stores[CFG.layer_ids[0]]
        failed = Future()
        failed.set_exception(TableIOError("layer file truncated"))
        store.prefetch = lambda ids: Prefetch(future=failed)
        runner.execute(decode_batch(torch.tensor([4, 6]), 2, rng))
        assert sorted(runtime.take_failed_requests()) == [4, 6]
        assert not runtime.staged.buffers[CFG.layer_ids[0]].any()
        # Some rows failed: only the request whose token needed one fails, the others' rows are kept.
        fb = decode_batch(torch.tensor([4, 6]), 2, rng)
        ids = hasher.peek_decode(fb.input_ids, fb)[:, 0]
        partial = reference(rows[CFG.layer_ids[0]], ids).view(torch.bfloat16)
        fault = TableReadFault("one row failed", failed_ids=np.array([int(ids[1, 0])]), rows=partial)
        failed = Future()
        failed.set_exception(fault)
        runner.execute(fb)
        assert sorted(runtime.take_failed_requests()) == ([4, 6] if int(ids[1, 0]) in ids[0].tolist() else [6])
        assert torch.equal(bf16_bits(runtime.staged.buffers[CFG.layer_ids[0]][:2]), bf16_bits(partial))
        # An idle batch (a data-parallel rank without requests) clears the rows; only decode
        # batches are staged.
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        runner.execute(types.SimpleNamespace(**{**vars(fb), "forward_mode": ForwardMode.IDLE}))
        assert not any(b.any() for b in runtime.staged.buffers.values())
        with pytest.raises(EngramError, match="a EXTEND batch"):
            runner.execute(types.SimpleNamespace(**{**vars(fb), "forward_mode": ForwardMode.EXTEND}))
    finally:
        runtime.close()


def test_the_wraps_target_what_sglang_calls():
    """What the wraps rely on in the installed SGLang: the decode runner knows its largest
    batch and tokens per request before it captures (in its constructor), and the model
    runner replays a decode step through `execute` (never `backend.replay` directly)."""
    import inspect

    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner

    init = inspect.getsource(runner.DecodeCudaGraphRunner.__init__)
    assert init.index("self.captured_req_width =") < init.index("self.max_bs = max(self.capture_bs)") \
        < init.index("self.capture()")
    assert "self.decode_cuda_graph_runner.execute(" in inspect.getsource(model_runner.ModelRunner._forward_raw)


# ------------------------------------------------------------------ policy
OVERLAP_OFF = ["--disable-overlap-schedule"]


def test_disk_keeps_decode_graphs_only_when_staged_with_the_overlap_scheduler_off():
    add, why = graphs.graph_args("disk", OVERLAP_OFF, disk_graphs=True)
    assert add == ["--cuda-graph-backend-prefill", "disabled"] and "decode graphs kept" in why
    # An explicit decode backend is fine then; an explicit prefill one is not.
    assert graphs.graph_args("disk", OVERLAP_OFF + ["--cuda-graph-backend-decode", "full"], disk_graphs=True)[0] == [
        "--cuda-graph-backend-prefill", "disabled"]
    with pytest.raises(EngramConfigError, match="drop --cuda-graph-backend-prefill full"):
        graphs.graph_args("disk", OVERLAP_OFF + ["--cuda-graph-backend-prefill", "full"], disk_graphs=True)
    with pytest.raises(EngramConfigError, match="needs --disable-overlap-schedule"):
        graphs.graph_args("disk", [], disk_graphs=True)
    with pytest.raises(EngramConfigError, match="drop it"):
        graphs.graph_args("device", OVERLAP_OFF, disk_graphs=True)
    # Without the staging: every graph off, as before.
    add, _ = graphs.graph_args("disk", OVERLAP_OFF)
    assert add == ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    # A step trace still needs the host in the step: every graph off.
    assert len(graphs.graph_args("disk", OVERLAP_OFF, trace="/tmp/t", disk_graphs=True)[0]) == 4


def test_the_scheduler_side_check():
    disk = [types.SimpleNamespace(placement="disk", needs_host_ids=True)]
    cuda = torch.device("cuda")
    graphs.check_capturable(disk, cuda, phases=["decode"], staged=True, overlap=False)
    graphs.check_capturable(disk, cuda, phases=[], staged=True, overlap=True)
    with pytest.raises(EngramError, match="start SGLang with --disable-overlap-schedule"):
        graphs.check_capturable(disk, cuda, phases=["decode"], staged=True, overlap=True)
    with pytest.raises(EngramError, match="--cuda-graph-backend-prefill disabled"):
        graphs.check_capturable(disk, cuda, phases=["decode", "prefill"], staged=True, overlap=False)
    with pytest.raises(EngramError, match="cannot replay"):
        graphs.check_capturable(disk, cuda, phases=["decode"], staged=False, overlap=False)
    with pytest.raises(EngramError, match="cannot replay"):
        graphs.check_capturable(disk, cuda, phases=["decode"], trace="/tmp/t", staged=True, overlap=False)
