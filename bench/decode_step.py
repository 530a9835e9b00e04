"""Decode steps of a model-shaped layer stack with Engram tables in device vs host memory.

A standalone stand-in for serving (no SGLang needed, so it runs on a lent GPU machine):
N decoder layers of plain torch (RMSNorm, QKV/O projections, GQA attention over a static
KV cache, SiLU MLP, all bf16) with `engram_sglang.models.layer.EngramLayer` at the config's Engram
layer ids, rows served by `engram_sglang.core.stores` from a packed table directory of several
GiB. Per step: the batch's next tokens are hashed on the device with the real
`NgramHasher` (a synthetic Zipf token stream, per-request n-gram history kept in a static
buffer), every Engram layer's prefetch is issued at step start and each Engram layer waits
on its own handle (or, prefetch off, gathers inside the layer). Compared in one run, with
the samples of every variant interleaved so drift hits all alike:

  * a no-Engram baseline, and each placement (device, host; disk with --disk) with
    prefetch on and off, at decode batches 64 and 256 (and one prefill chunk, --prefill);
  * with --graphs (GPU), the same decode steps captured once in a CUDA graph and replayed:
    device and host as they are; disk with its rows staged before each replay (the host
    hashes the step, reads its rows into fixed device buffers, then the graph replays:
    serving/staged_rows.py, what --engram-disk-graphs does in SGLang), so one GPU run shows
    disk graphs on vs off beside host; a failed capture is reported in the table and JSON,
    not raised. A CPU run lists these rows as "needs a GPU".

Engram conv: a per-request conv state, the last (kernel - 1) x dilation conv inputs of each
request in a static [batch, 12, hidden] buffer (shifted each step), as a serving engine
keeps them; a prefill chunk is one fresh sequence (`EngramLayer.forward`). The KV cache is
static (read, never appended). Token positions are fixed past the n-gram reach, so no
look-back is blocked. Disk: its store needs the ids on the host, so they are hashed there.

Reports ms per step, steps/s, tokens/s, host/device decode throughput (the goal on a GPU:
>= 0.98), Engram ms per step (variant minus baseline) against one decoder layer's time,
and the same-run limits: host-to-device copy from pinned memory and device copy (GPU), or
the host's copy bandwidth (CPU). Checks that every placement's Engram outputs of the same
step are bit-identical to the device placement's (bf16 bit patterns). Writes
OUT/decode_step.json and .png.

    python -m bench.decode_step --small                  # CPU (the default there): tiny sizes, < 1 min
    python -m bench.decode_step --graphs                 # one GPU: 43 layers x hidden 4096, 4 GiB tables
    python -m bench.decode_step --graphs --disk --prefill 8192 --table-gib 8
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
from bench import common
from engram_sglang.core.config import EngramConfig
from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout, NgramHasher
from engram_sglang.core.rowformat import PAYLOAD_BYTES, ROW_BYTES, bf16_bits
from engram_sglang.core.stores import maintenance, open_store
from engram_sglang.core.tablefile import open_tables, write_tables
from engram_sglang.models.layer import EngramLayer
from engram_sglang.serving.staged_rows import StagedRows

TABLE_CONTENT_VERSION = 1  # bump when the rows written below change
POOL_ROWS = 1 << 18
POSITION = 4096  # decode tokens sit here: past the n-gram reach, no look-back blocked
LINES_PER_ROW = 5  # 64-byte lines a 264-byte row touches (what crosses the link from host memory)

PROFILES = {
    # DeepSeek-V4.1-Flash-like depth (43 layers, Engram at its layer ids) with a dense
    # stand-in layer of a 4096-wide model; tables of a few GiB.
    "full": dict(layers=43, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, context=1024,
                 table_gib=4.0, vocab=32768, steps=20, repeats=5, batches="64,256", threads=0),
    # CPU: tiny everything, well under a minute; one intra-op thread (a prefetch worker
    # thread runs beside it, and a busy shared machine makes OpenMP's spinning costly).
    "small": dict(layers=16, hidden=128, intermediate=256, heads=2, kv_heads=1, head_dim=64, context=32,
                  table_gib=0.05, vocab=4096, steps=2, repeats=3, batches="64,256", threads=1),
}


# ------------------------------------------------------------------ config and tables
def harness_config(preset: str, layer_ids, table_gib: float, vocab: int) -> EngramConfig:
    """The preset's hashing (orders, heads, pad, layer ids) with the prime search started so
    that the tables total about `table_gib` GiB, over a synthetic `vocab`-token vocabulary."""
    base = EngramConfig.resolve(preset)
    layer_ids = tuple(layer_ids) if layer_ids else base.layer_ids
    columns = (base.max_ngram_size - 1) * base.n_heads
    rows_per_layer = int(table_gib * 2**30 / ROW_BYTES / len(layer_ids))
    return EngramConfig(
        layer_ids=layer_ids, max_ngram_size=base.max_ngram_size, n_heads=base.n_heads, head_dim=base.head_dim,
        vocab_size=max(3, rows_per_layer // columns), compressed_vocab_size=vocab, pad_token_id=base.pad_token_id,
        source=f"decode_step ({base.source} hashing, ~{table_gib:g} GiB)",
    )


def valid_pool(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random rows that decode to finite values: no fp8 NaN code (0x7F/0xFF), scale bytes
    120..127 (x 2^-7 .. 2^0)."""
    rows = rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8)
    no_nan = np.arange(256, dtype=np.uint8)
    no_nan[0x7F], no_nan[0xFF] = 0x7E, 0xFE
    rows[:, :PAYLOAD_BYTES] = no_nan[rows[:, :PAYLOAD_BYTES]]
    rows[:, PAYLOAD_BYTES:] = 120 + (rows[:, PAYLOAD_BYTES:] & 7)
    return rows


def ensure_tables(cfg: EngramConfig, root: Path) -> tuple[Path, float]:
    """A packed table directory for cfg of random valid rows, reused when it checks out.
    Returns (directory, seconds spent writing it: 0 when reused)."""
    try:
        open_tables(root, cfg)
        return root, 0.0
    except EngramError:
        pass
    t0 = time.perf_counter()
    layout = EngramLayout(cfg)
    pool = valid_pool(np.random.default_rng(TABLE_CONTENT_VERSION), POOL_ROWS)

    def chunks(layer_index: int, n: int):
        # Chunk k is the pool rotated by a chunk- and layer-dependent shift, its scale bytes
        # rotated too: rows differ across chunks (a misplaced read shows), writing is a copy.
        for k, lo in enumerate(range(0, n, POOL_ROWS)):
            c = np.roll(pool, (k * 7919 + layer_index * 104729) % POOL_ROWS, axis=0)[: min(POOL_ROWS, n - lo)]
            c[:, PAYLOAD_BYTES:] = 120 + ((c[:, PAYLOAD_BYTES:] + k + layer_index) & 7)
            yield c

    gib = layout.table_bytes(ROW_BYTES) / 2**30
    print(f"writing {gib:.2f} GiB of tables ({len(cfg.layer_ids)} layers) to {root} ...", flush=True)
    write_tables(root, cfg, {L: chunks(i, layout.rows(L)) for i, L in enumerate(cfg.layer_ids)}, progress=False)
    return root, time.perf_counter() - t0


# ------------------------------------------------------------------ the model stand-in
class DecoderLayer:
    """A pre-norm decoder layer of realistic cost: QKV and O projections, GQA attention
    (decode: one query per request over a static KV cache; prefill: causal over the chunk),
    SiLU-gated MLP; bf16 weights of the hidden size and intermediate size given."""

    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim, device, dtype, gen):
        def w(out_f, in_f):
            return torch.randn(out_f, in_f, device=device, dtype=dtype, generator=gen) * (0.5 / math.sqrt(in_f))

        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.wqkv = w(sum(self.split), hidden)
        self.wo = w(hidden, heads * head_dim)
        self.wgu = w(2 * intermediate, hidden)
        self.wdown = w(hidden, intermediate)
        self.n1 = torch.ones(hidden, device=device, dtype=dtype)
        self.n2 = torch.ones(hidden, device=device, dtype=dtype)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wqkv, self.wo, self.wgu, self.wdown))

    def __call__(self, h: torch.Tensor, kv) -> torch.Tensor:
        t = h.shape[0]
        x = F.rms_norm(h, (self.hidden,), self.n1, 1e-6)
        q, k, v = F.linear(x, self.wqkv).split(self.split, -1)
        g = self.heads // self.kv_heads
        if kv is not None:  # decode: each request's query heads of one KV head attend to its cache
            keys, values = kv
            q = q.reshape(t, self.kv_heads, g, self.head_dim)
            a = F.scaled_dot_product_attention(q, keys[:t], values[:t])
        else:  # prefill: one fresh sequence, causal over the chunk
            q = q.reshape(1, t, self.heads, self.head_dim).transpose(1, 2)
            k = k.reshape(1, t, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(g, 1)
            v = v.reshape(1, t, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(g, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        h = h + F.linear(a.reshape(t, -1), self.wo)
        x = F.rms_norm(h, (self.hidden,), self.n2, 1e-6)
        gate, up = F.linear(x, self.wgu).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, self.wdown)


def engram_decode(layer: EngramLayer, h: torch.Tensor, rows: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The Engram output of one decode token per request; state [B, reach, D] holds each
    request's last `reach` conv inputs (oldest first) and is shifted in place."""
    value = layer.gated_value(h, rows)
    x = layer.conv_input(value, h.dtype)
    # Slot j of the window reads x at t - (K-1-j) * dilation: state rows 0, d, 2d, ... (a
    # strided slice, not a list index: that would copy the index from pageable host memory,
    # which a CUDA graph cannot capture).
    window = torch.cat([state[:, 0 : state.shape[1] : layer.dilation], x.unsqueeze(1)], 1)
    out = layer.finish(value, window, h.dtype)
    state.copy_(torch.cat([state[:, 1:], x.unsqueeze(1)], 1))
    return out


class Harness:
    """Everything variants share: model weights, KV cache, Engram layers, hasher, token streams."""

    def __init__(self, args, cfg: EngramConfig, device: torch.device):
        self.args, self.cfg, self.device = args, cfg, device
        self.dtype = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(0)
        self.layers = [DecoderLayer(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim,
                                    device, self.dtype, gen) for _ in range(args.layers)]
        self.embed = torch.randn(args.vocab, args.hidden, device=device, dtype=self.dtype, generator=gen)
        bmax = max(args.batch_list)
        kv_shape = (bmax, args.kv_heads, args.context, args.head_dim)
        self.kv = (torch.randn(kv_shape, device=device, dtype=self.dtype, generator=gen),
                   torch.randn(kv_shape, device=device, dtype=self.dtype, generator=gen))
        torch.manual_seed(0)
        self.engram = {L: EngramLayer(args.hidden, cfg.hash_columns, cfg.head_dim, cfg.max_ngram_size,
                                      dtype=self.dtype).to(device).requires_grad_(False) for L in cfg.layer_ids}
        self.engram_index = {L: j for j, L in enumerate(cfg.layer_ids)}
        self.hasher = NgramHasher(cfg, torch.arange(args.vocab))  # synthetic vocabulary: identity map
        # Zipf-like token streams (frequent tokens repeat, as in text), fixed by the seed.
        rng = np.random.default_rng(1)
        perm = rng.permutation(args.vocab)

        def draw(shape):
            return torch.from_numpy(perm[np.minimum(rng.zipf(1.2, size=shape), args.vocab) - 1].astype(np.int64))

        self.n_token_steps = 64
        self.tokens_cpu = draw((self.n_token_steps, bmax))
        self.hist0_cpu = draw((bmax, cfg.max_ngram_size - 1))
        self.tokens = self.tokens_cpu.to(device)
        self.hist0 = self.hist0_cpu.to(device)
        self.prefill_cpu = draw((2, args.prefill)) if args.prefill else None
        self.prefill = self.prefill_cpu.to(device) if args.prefill else None
        self.stores: dict[str, dict] = {}

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Variant:
    """One way to run the step: a placement (None: no Engram), prefetch on/off, eager/graph."""

    def __init__(self, hz: Harness, shape: str, batch: int, placement, prefetch: bool, graphs: bool):
        self.hz, self.shape, self.batch, self.placement = hz, shape, batch, placement
        self.prefetch, self.graphs = prefetch, graphs
        self.name = ("baseline" if placement is None else f"{placement} {'prefetch' if prefetch else 'inline'}") + (
            " graph" if graphs else "")
        self.stores = hz.stores[placement] if placement else None
        self.host_ids = bool(self.stores) and any(s.needs_host_ids for s in self.stores.values())
        dev, n1 = hz.device, hz.cfg.max_ngram_size - 1
        t = batch if shape == "decode" else hz.args.prefill
        self.tokens_per_step = t
        self.tok = torch.zeros(t, dtype=torch.int64, device=dev)
        if shape == "decode":
            self.pos = torch.full((t,), POSITION, dtype=torch.int64, device=dev)
            self.lens = torch.ones(t, dtype=torch.int64, device=dev)
            self.hist = torch.zeros(t, n1, dtype=torch.int64, device=dev)
        else:  # one fresh sequence per step
            self.pos = torch.arange(t, dtype=torch.int64, device=dev)
            self.lens = torch.tensor([t], dtype=torch.int64, device=dev)
            self.hist = torch.zeros(1, n1, dtype=torch.int64, device=dev)
        if self.host_ids:
            self.tok_c, self.pos_c, self.lens_c, self.hist_c = (
                x.cpu() for x in (self.tok, self.pos, self.lens, self.hist))
        reach = hz.engram[hz.cfg.layer_ids[0]].reach
        self.conv = {L: torch.zeros(batch, reach, hz.args.hidden, dtype=hz.dtype, device=dev)
                     for L in hz.cfg.layer_ids} if shape == "decode" else {}
        self.last = {L: torch.zeros(t, hz.args.hidden, dtype=hz.dtype, device=dev) for L in hz.cfg.layer_ids}
        self.h_out = torch.zeros(t, hz.args.hidden, dtype=hz.dtype, device=dev)
        # A captured step of a host-reading placement (disk) reads its rows from fixed buffers
        # the host fills before each replay (serving/staged_rows.py, as the plugin does).
        self.staged = None
        if graphs and self.host_ids:
            self.staged = StagedRows(self.stores, hz.engram_index, hz.cfg.hash_columns, dev)
            self.staged.reserve(t)
        self.graph = None
        self.error = ""
        self.samples: list[float] = []
        self.reset()

    def reset(self):
        """The state every variant starts from, so step k is the same step for all."""
        self.cursor = 0
        if self.shape == "decode":
            self.hist.copy_(self.hz.hist0[: self.batch])
            if self.host_ids:
                self.hist_c.copy_(self.hz.hist0_cpu[: self.batch])
            for c in self.conv.values():
                c.zero_()

    def load_tokens(self):
        s = self.cursor
        self.cursor += 1
        if self.shape == "decode":
            k = s % self.hz.n_token_steps
            src, src_c = self.hz.tokens[k, : self.batch], self.hz.tokens_cpu[k, : self.batch]
        else:
            src, src_c = self.hz.prefill[s % 2], self.hz.prefill_cpu[s % 2]
        self.tok.copy_(src)
        if self.host_ids:
            self.tok_c.copy_(src_c)

    def hash_step(self) -> torch.Tensor:
        """This step's row ids [T, layers, C] (on the host for a host-reading placement); a
        decode step's tokens are committed to each request's history."""
        if self.host_ids:
            tok, pos, hist, lens = self.tok_c, self.pos_c, self.hist_c, self.lens_c
        else:
            tok, pos, hist, lens = self.tok, self.pos, self.hist, self.lens
        ids = self.hz.hasher.hash_batch(tok, pos, hist, lens)[0]
        if self.shape == "decode":
            hist.copy_(torch.cat([hist[:, 1:], tok.unsqueeze(1)], 1))
        return ids

    def forward(self):
        hz = self.hz
        ids = handles = None
        if self.stores is not None and self.staged is not None and maintenance.capturing():
            # Captured: the rows are staged before each replay (step()); nothing here reads the host.
            handles = [self.staged.handle(L, self.tokens_per_step) for L in hz.cfg.layer_ids]
        elif self.stores is not None:
            ids = self.hash_step().transpose(0, 1).contiguous()  # [layers, T, C]
            if self.prefetch:
                handles = [self.stores[L].prefetch(ids[j]) for j, L in enumerate(hz.cfg.layer_ids)]
        h = F.embedding(self.tok, hz.embed)
        kv = hz.kv if self.shape == "decode" else None
        for i, layer in enumerate(hz.layers):
            j = hz.engram_index.get(i)
            if j is not None and self.stores is not None:
                rows = handles[j].wait() if self.prefetch else self.stores[i].gather(ids[j])
                if self.shape == "decode":
                    out = engram_decode(hz.engram[i], h, rows, self.conv[i])
                else:
                    out = hz.engram[i](h, rows)
                self.last[i].copy_(out)
                h = h + out
            h = layer(h, kv)
        self.h_out.copy_(h)

    def step(self):
        self.load_tokens()
        if self.graph is not None:
            if self.staged is not None:  # the host hashes the step and reads its rows, then the replay
                self.staged.stage(self.hash_step())
            self.graph.replay()
        else:
            self.forward()

    def capture(self):
        """Capture forward() in a CUDA graph (warm-up on a side stream first, as torch asks)."""
        side = torch.cuda.Stream(self.hz.device)
        side.wait_stream(torch.cuda.current_stream(self.hz.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self.load_tokens()
                self.forward()
        torch.cuda.current_stream(self.hz.device).wait_stream(side)
        self.hz.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.forward()
        self.graph = graph
        self.reset()


# ------------------------------------------------------------------ measuring
def timed(hz: Harness, fn, n: int) -> float:
    """Seconds per call of fn over n back-to-back calls (device synchronized at both ends)."""
    hz.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    hz.sync()
    return (time.perf_counter() - t0) / n


def limits(device: torch.device, small: bool) -> dict:
    """Same-run copy limits: on a GPU host-to-device from pinned memory (bytes moved) and
    device-to-device (bytes read + written); on the CPU the host copy on every core."""
    if device.type != "cuda":
        return {"host_copy_GBps": common.torch_copy_bandwidth(64 << 20 if small else 512 << 20) / 1e9}
    n = 256 << 20
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    src = torch.ones(n, dtype=torch.uint8, device=device)

    from bench.gpu_check import time_gpu  # CUDA events, best of 3 (one timer for both scripts)

    torch.cuda.set_device(device)
    h2d = n / time_gpu(torch, lambda: dst.copy_(pinned, non_blocking=True), 5)
    d2d = 2 * n / time_gpu(torch, lambda: dst.copy_(src), 10)
    return {"h2d_pinned_GBps": h2d / 1e9, "d2d_GBps": d2d / 1e9}


def component_times(hz: Harness, batch: int, shape: str) -> dict:
    """ms of one decoder layer, one Engram layer's compute (rows resident), and one layer's
    gather per placement, alone, at this batch."""
    t = batch if shape == "decode" else hz.args.prefill
    gen = torch.Generator(device=hz.device).manual_seed(5)
    h = torch.randn(t, hz.args.hidden, device=hz.device, dtype=hz.dtype, generator=gen)
    kv = hz.kv if shape == "decode" else None
    n = max(3, hz.args.steps)
    out = {"layer_ms": 1e3 * min(timed(hz, lambda: hz.layers[0](h, kv), n) for _ in range(3))}
    L = hz.cfg.layer_ids[0]
    ids = torch.randint(0, hz.cfg.vocab_size, (t, hz.cfg.hash_columns), device=hz.device, generator=gen)
    for placement, stores in hz.stores.items():
        ids_p = ids.cpu() if stores[L].needs_host_ids else ids
        out[f"gather_ms_{placement}"] = 1e3 * min(timed(hz, lambda: stores[L].gather(ids_p), n) for _ in range(3))
    rows = next(iter(hz.stores.values()))[L].gather(ids)
    if shape == "decode":
        state = torch.zeros(t, hz.engram[L].reach, hz.args.hidden, dtype=hz.dtype, device=hz.device)
        fn = lambda: engram_decode(hz.engram[L], h, rows, state)  # noqa: E731
    else:
        fn = lambda: hz.engram[L](h, rows)  # noqa: E731
    out["engram_compute_ms"] = 1e3 * min(timed(hz, fn, n) for _ in range(3))
    return out


def run_group(hz: Harness, shape: str, batch: int, placements: list[str], graphs: bool, dump: dict) -> list[dict]:
    """Every variant of one (shape, batch): build, check bits, then interleaved timing."""
    args = hz.args
    variants = [Variant(hz, shape, batch, None, False, False)]
    for p in placements:
        for pre in (True, False):
            variants.append(Variant(hz, shape, batch, p, pre, False))
    # Captured variants: every placement, prefetch on and off; a host-reading one (disk) with
    # its rows staged before each replay, which is a prefetch (every layer's read at once).
    graphed = [(p, pre) for p in placements for pre in (True, False)
               if pre or not any(s.needs_host_ids for s in hz.stores[p].values())]
    if graphs and shape == "decode":
        variants.append(Variant(hz, shape, batch, None, False, True))
        for p, pre in graphed:
            variants.append(Variant(hz, shape, batch, p, pre, True))
        for v in variants:
            if v.graphs:
                try:
                    v.capture()
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    v.error = f"capture failed: {type(e).__name__}: {e}"
                    print(f"  [{shape} {batch}] {v.name}: {v.error}\n{traceback.format_exc(limit=4)}", flush=True)
                    v.graph = None
                    try:
                        hz.sync()
                    except Exception:  # noqa: BLE001
                        pass
    live = [v for v in variants if not v.error]
    # Bit check: the same step (after check_steps - 1 earlier ones) of every variant.
    snaps = {}
    for v in live:
        try:
            v.reset()
            for _ in range(args.check_steps):
                v.step()
            hz.sync()
            snaps[v.name] = ({L: t.cpu().clone() for L, t in v.last.items()}, v.h_out.cpu().clone())
        except Exception as e:  # noqa: BLE001
            v.error = f"step failed: {type(e).__name__}: {e}"
            print(f"  [{shape} {batch}] {v.name}: {v.error}\n{traceback.format_exc(limit=4)}", flush=True)
    live = [v for v in live if not v.error]
    ref_name = "device prefetch"
    for v in live:
        if v.stores is not None:
            for L, t in snaps[v.name][0].items():
                dump[f"{shape}/{batch}/{v.name}/layer{L}"] = t
    # Timing: warm up, then rounds in which every variant takes one sample.
    for v in live:
        for _ in range(args.warmup):
            v.step()
    for _ in range(args.repeats):
        for v in live:
            v.samples.append(timed(hz, v.step, args.steps))
    comp = component_times(hz, batch, shape)
    results = []
    med = {v.name: statistics.median(v.samples) for v in live}
    for v in variants:
        r = {"shape": shape, "batch": batch, "tokens_per_step": v.tokens_per_step, "variant": v.name,
             "placement": v.placement or "none", "prefetch": v.prefetch, "graphs": v.graphs, "error": v.error}
        if v.name in med:
            ms = 1e3 * med[v.name]
            r.update(ms_per_step=ms, steps_per_s=1e3 / ms, tokens_per_s=v.tokens_per_step * 1e3 / ms,
                     samples_ms=[1e3 * s for s in v.samples], **comp)
            base = med.get("baseline graph" if v.graphs else "baseline")
            if v.stores is not None:
                dev_name = f"device {'prefetch' if v.prefetch else 'inline'}{' graph' if v.graphs else ''}"
                r["vs_device"] = med[dev_name] / med[v.name] if dev_name in med else None
                r["engram_ms"] = ms - 1e3 * base if base else None
                r["engram_vs_layer"] = r["engram_ms"] / comp["layer_ms"] if base else None
                outs, hidden = snaps[v.name]
                ref = snaps.get(ref_name)
                r["engram_finite"] = all(bool(torch.isfinite(t.float()).all()) for t in outs.values())
                if ref is not None:
                    r["bits_equal_device"] = all(torch.equal(bf16_bits(t), bf16_bits(ref[0][L]))
                                                 for L, t in outs.items())
                    r["hidden_bits_equal_device"] = torch.equal(bf16_bits(hidden), bf16_bits(ref[1]))
        results.append(r)
    if not graphs and shape == "decode":  # the same rows, said to need a GPU, so a CPU run shows what one decides
        for p, pre in [(None, False)] + graphed:
            name = ("baseline" if p is None else f"{p} {'prefetch' if pre else 'inline'}") + " graph"
            results.append({"shape": shape, "batch": batch, "tokens_per_step": batch, "variant": name,
                            "placement": p or "none", "prefetch": pre, "graphs": True, "error": "",
                            "na": "needs a GPU" if hz.device.type != "cuda" else "not run (give --graphs)"})
    for v in variants:
        v.graph = None
    return results


# ------------------------------------------------------------------ report
def disk_graph_summary(results: list[dict]) -> dict:
    """Per decode batch, what decides --engram-disk-graphs: the disk placement's staged graph
    step against its eager step and against the host placement's graph step (throughput
    ratios, > 1: the staged graph is faster)."""
    ms = {(r["batch"], r["variant"]): r["ms_per_step"] for r in results if r["shape"] == "decode" and "ms_per_step" in r}
    rows = {(r["batch"], r["variant"]): r for r in results if r["shape"] == "decode"}
    out, lines = {}, []
    for batch in sorted({b for b, _ in ms} | {r["batch"] for r in results if r["shape"] == "decode"}):
        graph = ms.get((batch, "disk prefetch graph"))
        if graph is None:  # the row's own reason: a failed capture on a GPU must not read as "needs a GPU"
            row = rows.get((batch, "disk prefetch graph"), {})
            lines.append(f"disk staged graph, decode {batch}: {row.get('error') or row.get('na') or 'not run'}")
            continue
        vs_eager = ms[(batch, "disk prefetch")] / graph if (batch, "disk prefetch") in ms else None
        vs_host = ms[(batch, "host prefetch graph")] / graph if (batch, "host prefetch graph") in ms else None
        out[str(batch)] = {"graph_ms": graph, "vs_eager": vs_eager, "vs_host_graph": vs_host}
        lines.append(f"disk staged graph, decode {batch}: {graph:.3f} ms/step, x{vs_eager or float('nan'):.3f} vs disk "
                     f"eager, x{vs_host or float('nan'):.3f} vs host graph (throughput)")
    return {"batches": out, "lines": lines}


def plot(results: list[dict], lim: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "ms_per_step" in r]
    groups = sorted({(r["shape"], r["batch"]) for r in rows}, key=lambda g: (g[0] != "decode", g[1]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs, ys = [], []
        for gi, g in enumerate(groups):
            for r in rows:
                if (r["shape"], r["batch"]) == g and r["variant"] == name:
                    xs.append(gi + k * width)
                    ys.append(r["ms_per_step"])
        axes[0].bar(xs, ys, width=width, label=name)
    axes[0].set_xticks([gi + 0.4 - width / 2 for gi in range(len(groups))])
    axes[0].set_xticklabels([f"{s} {b}" for s, b in groups])
    axes[0].set_ylabel("ms per step")
    axes[0].set_title("step time per variant")
    axes[0].legend(fontsize=7, ncol=2)
    ratio = [r for r in rows if r.get("placement") not in ("none", "device") and r.get("vs_device")]
    labels = [f"{r['shape'][0]}{r['batch']} {r['variant']}" for r in ratio]
    axes[1].barh(labels, [r["vs_device"] for r in ratio], color="tab:blue")
    axes[1].axvline(0.98, color="tab:red", ls="--", label="goal 0.98")
    axes[1].axvline(1.0, color="gray", lw=0.8)
    axes[1].set_xlabel("throughput vs device placement (same mode)")
    axes[1].tick_params(axis="y", labelsize=7)
    axes[1].legend(fontsize=8)
    fig.suptitle(title + "  |  " + ", ".join(f"{k} {v:.1f}" for k, v in lim.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Defaults: the 'full' profile (GPU); --small: tiny CPU sizes. "
                                        "Explicit options override either.")
    ap.add_argument("--small", action="store_true", help="tiny model and tables (CPU, < 1 min)")
    ap.add_argument("--preset", default="deepseek-v4.1-flash", help="Engram hashing and layer ids from this config")
    ap.add_argument("--engram-layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="Engram layer ids (default: the preset's, 1,14)")
    for name, typ, what in [("layers", int, "decoder layers"), ("hidden", int, "hidden size"),
                            ("intermediate", int, "MLP intermediate size"), ("heads", int, "query heads"),
                            ("kv-heads", int, "KV heads"), ("head-dim", int, "attention head dim"),
                            ("context", int, "decode KV-cache length per request"),
                            ("table-gib", float, "total Engram table size"), ("vocab", int, "synthetic vocabulary"),
                            ("steps", int, "steps per timed sample"), ("repeats", int, "timed samples per variant"),
                            ("batches", str, "decode batches, comma-separated"),
                            ("threads", int, "torch intra-op threads (0: torch's default)")]:
        ap.add_argument(f"--{name}", type=typ, default=None, help=what)
    ap.add_argument("--prefill", type=int, default=0, help="also time one prefill chunk of this many tokens")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    ap.add_argument("--check-steps", type=int, default=3, help="the bit check compares this step's outputs")
    ap.add_argument("--disk", action="store_true", help="also the disk placement (captured too with --graphs: "
                    "rows staged before each replay)")
    ap.add_argument("--graphs", action="store_true", help="also CUDA-graph capture of the decode step (GPU)")
    ap.add_argument("--backend", default="auto", help="gather backend (auto: the device probe's choice)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    ap.add_argument("--table-dir", default=None, help="table directory (default: bench/out/decode-table-FINGERPRINT)")
    ap.add_argument("--out", default=None, help="where the JSON and PNG go (default: bench/out)")
    ap.add_argument("--name", default="decode_step", help="JSON/PNG file name")
    ap.add_argument("--dump-outputs", default=None, help="torch.save every variant's checked Engram outputs here")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)  # inference: no autograd records (nor saved activations)
    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    notes = []
    if device.type == "cpu" and not args.small:
        args.small = True
        notes.append("no GPU: the --small profile (explicit options still apply)")
        print(notes[-1])
    for k, v in PROFILES["small" if args.small else "full"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    out_dir = Path(args.out) if args.out else common.OUT
    common.OUT = out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    cfg = harness_config(args.preset, args.engram_layers, args.table_gib, args.vocab)
    bad = [L for L in cfg.layer_ids if L >= args.layers]
    if bad:
        print(f"decode_step: Engram layer(s) {bad} are not below --layers {args.layers}", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        print(f"decode_step: --heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}", file=sys.stderr)
        return 2
    table_dir = Path(args.table_dir) if args.table_dir else ROOT / "bench" / "out" / f"decode-table-{cfg.fingerprint()}"
    table_dir, write_s = ensure_tables(cfg, table_dir)
    table_gib = EngramLayout(cfg).table_bytes(ROW_BYTES) / 2**30

    hz = Harness(args, cfg, device)
    placements = ["device", "host"] + (["disk"] if args.disk else [])
    opened = {}
    for p in placements:
        t0 = time.perf_counter()
        hz.stores[p] = open_store(table_dir, p, device, cfg=cfg, backend=args.backend)
        opened[p] = {"seconds": round(time.perf_counter() - t0, 2),
                     "stores": [s.describe() for s in hz.stores[p].values()]}
    backend = next(iter(hz.stores["device"].values())).backend
    lim = limits(device, args.small)
    layer_gb = hz.layers[0].weight_bytes / 1e9
    print(f"device {device}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"torch {torch.__version__}, gather backend {backend}; tables {table_gib:.2f} GiB "
          f"({'written in %.0f s' % write_s if write_s else 'reused'}) at {table_dir}", flush=True)
    print(f"model: {args.layers} layers x (hidden {args.hidden}, MLP {args.intermediate}, {args.heads}/{args.kv_heads} "
          f"heads x {args.head_dim}, KV {args.context} per request; {layer_gb:.3f} GB weights per layer), Engram at "
          f"layers {list(cfg.layer_ids)} ({cfg.hash_columns} rows per token each); limits: "
          + ", ".join(f"{k} {v:.1f}" for k, v in lim.items()), flush=True)
    graphs = args.graphs and device.type == "cuda"
    if args.graphs and not graphs:
        notes.append("--graphs ignored: CUDA graphs need a GPU")
        print(notes[-1])

    results, dump = [], {}
    groups = [("decode", b) for b in args.batch_list] + ([("prefill", args.prefill)] if args.prefill else [])
    for shape, batch in groups:
        t0 = time.perf_counter()
        rs = run_group(hz, shape, batch, placements, graphs, dump)
        results.extend(rs)
        print(f"  {shape} {batch}: {len(rs)} variants in {time.perf_counter() - t0:.1f} s", flush=True)

    # Bytes that cross the link per step for the host placement, and its floor at the same-run H2D copy.
    table = []
    for r in results:
        if "ms_per_step" not in r:
            table.append([r["shape"], r["batch"], r["variant"], "-", "-", "-", "-", "-", "-", r.get("na") or r["error"]])
            continue
        rows_per_step = r["tokens_per_step"] * cfg.hash_columns * len(cfg.layer_ids)
        if "h2d_pinned_GBps" in lim and r["placement"] == "host":
            r["link_floor_ms"] = rows_per_step * LINES_PER_ROW * 64 / (lim["h2d_pinned_GBps"] * 1e9) * 1e3
        bits = r.get("bits_equal_device")
        table.append([r["shape"], r["batch"], r["variant"], r["ms_per_step"], r["steps_per_s"], r["tokens_per_s"],
                      "" if r.get("vs_device") is None else f"{r['vs_device']:.3f}",
                      "" if r.get("engram_ms") is None else f"{r['engram_ms']:.3f}",
                      "" if r.get("engram_vs_layer") is None else f"{r['engram_vs_layer']:.2f}",
                      "" if bits is None else ("yes" if bits and r.get("engram_finite") else "NO")])
    common.print_table(
        f"Decode steps, {args.layers} layers x hidden {args.hidden} on {device}, Engram tables {table_gib:.2f} GiB "
        f"({backend} gather); median of {args.repeats} x {args.steps} steps",
        ["shape", "batch", "variant", "ms/step", "steps/s", "tokens/s", "vs device", "Engram ms", "x layer",
         "bits = device"], table)
    comp_rows = []
    for shape, batch in groups:
        r = next(r for r in results if (r["shape"], r["batch"]) == (shape, batch) and "layer_ms" in r)
        comp_rows.append([shape, batch, r["layer_ms"], r["engram_compute_ms"],
                          *(r.get(f"gather_ms_{p}", float("nan")) for p in placements)])
    common.print_table("One layer alone (ms): decoder stand-in, Engram compute with rows resident, one layer's gather",
                       ["shape", "batch", "decoder layer", "Engram compute", *(f"gather {p}" for p in placements)],
                       comp_rows)
    host_ratios = [r["vs_device"] for r in results if r.get("placement") == "host" and r.get("vs_device")
                   and r["shape"] == "decode"]
    bits_ok = all(r.get("bits_equal_device", True) and r.get("engram_finite", True) for r in results)
    errors = [f"{r['shape']} {r['batch']} {r['variant']}: {r['error']}" for r in results if r["error"]]
    summary = {"host_vs_device_decode_min": min(host_ratios) if host_ratios else None,
               "goal": 0.98, "bits_equal_device": bits_ok, "errors": errors,
               "seconds": round(time.perf_counter() - t_start, 1)}
    print(f"\nhost/device decode throughput: min {summary['host_vs_device_decode_min']}"
          f" (goal >= 0.98 on a GPU); Engram outputs bit-identical to device: {bits_ok}; "
          f"{len(errors)} variant error(s); {summary['seconds']} s")
    if args.disk:
        summary["disk_graphs"] = disk_graph_summary(results)
        for line in summary["disk_graphs"]["lines"]:
            print(line)
    for p in placements:
        for s in hz.stores[p].values():
            s.close()
    payload = {"args": {k: v for k, v in vars(args).items()}, "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "backend": backend, "table_dir": str(table_dir), "table_gib": table_gib,
               "table_write_s": write_s, "config": cfg.hash_fields(), "stores": opened, "limits": lim,
               "layer_weight_GB": layer_gb, "notes": notes, "summary": summary, "results": results,
               "engram_conv": "per-request conv state [batch, 12, hidden] shifted each decode step; prefill: one "
                              "fresh sequence"}
    path = common.write_json(args.name, payload)
    plot(results, lim, f"{args.layers} layers x {args.hidden} on {payload['device_name']}, {table_gib:.2f} GiB tables",
         out_dir / f"{args.name}.png")
    if args.dump_outputs:
        torch.save(dump, args.dump_outputs)
    print(f"wrote {path} and {out_dir / (args.name + '.png')}")
    return 0 if bits_ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
