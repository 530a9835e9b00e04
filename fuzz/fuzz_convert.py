"""Fuzz `tables convert`'s checkpoint reading: a small DeepSeek-style checkpoint (config.json,
one shard or two behind model.safetensors.index.json) whose safetensors headers (dtype,
shape, data_offsets, the length word), tensor bytes, index and config are edited, and
whose files may be directories, FIFOs, symlinks, ...; converted with `convert_checkpoint`
into a fresh directory or over a good table directory, then inspected as the CLI does.

Beyond the rule (fuzz/fuzz_common.py): a convert that succeeds wrote a directory that verifies,
holding exactly the rows the checkpoint's tensors pack to (read whole with safetensors);
a convert that fails left a good table directory it was writing over as it was.

    python -m fuzz.fuzz_convert -runs=500 -seed=1 NEW_DIR fuzz/corpus/convert
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import atheris
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from fuzz.fuzz_common import RuleBroken, Scratch, dump_json, edit_bytes, edit_json, fuzz_main, instrumented, keep_rule, pick_kind, place  # isort: skip (one line)

with instrumented():
    from engram_sglang.core.config import EngramConfig
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.rowformat import pack, split
    from engram_sglang.core.tablefile import convert_checkpoint, inspect_tables, open_tables, verify_tables, write_tables  # isort: skip

TINY = EngramConfig(layer_ids=(0, 2), max_ngram_size=2, n_heads=2, head_dim=256, vocab_size=3,
                    compressed_vocab_size=3, pad_token_id=0, hidden_size=64)
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
DTYPES = ("F8_E4M3", "F8_E8M0", "U8", "I8", "F16", "BF16", "F32", "F64", "I64", "BOOL", "F8_E5M2", "F4")

scratch = Scratch("convert")


def _baseline():
    """Config, shard bytes (one-shard and two-shard layouts) and the packed rows per layer."""
    rng = np.random.default_rng(0)
    rows = {L: rng.integers(0, 256, (n, 264), dtype=np.uint8) for L, n in zip(TINY.layer_ids, EngramLayout(TINY).num_embeddings)}
    tensors = {}
    for L, r in rows.items():
        w, s = split(torch.from_numpy(r))
        tensors[f"model.layers.{L}.engram.embed.weight"] = w
        tensors[f"model.layers.{L}.engram.embed.scale"] = s
    tensors["model.layers.0.mlp.weight"] = torch.zeros(2, 2)
    one = {"model.safetensors": save(tensors)}
    last = "model.layers.2.engram.embed.scale"
    two = {SHARDS[0]: save({k: v for k, v in tensors.items() if k != last}), SHARDS[1]: save({last: tensors[last]})}
    index = {"metadata": {"total_size": 0}, "weight_map": {k: SHARDS[k == last] for k in tensors}}
    config = {"architectures": ["DeepseekV41ForCausalLM"], "text_config": {**TINY.hash_fields(), "hidden_size": 64}}
    good = write_tables(scratch.fresh() / "good", TINY, rows, progress=False)
    good_files = {p.name: p.read_bytes() for p in good.iterdir()}
    return config, one, two, index, rows, good_files


CONFIG, ONE, TWO, BASE_INDEX, BASE_ROWS, GOOD_FILES = _baseline()
NAMES = (*SHARDS, "model.safetensors", INDEX, "config.json", "model.layers.0.engram.embed.weight",
         "layers.2.engram.embed.scale", "data_offsets", "dtype", "shape", "__metadata__", *DTYPES)


def _edit_shard(data: bytes, fdp: atheris.FuzzedDataProvider) -> bytes:
    """Edit a safetensors file: its header JSON (length word kept true or not), the length
    word, the tensor bytes, or the file as a whole."""
    region = fdp.ConsumeIntInRange(0, 3)
    (hlen,) = struct.unpack_from("<Q", data)
    if region == 0:
        header = dump_json(edit_json(json.loads(data[8 : 8 + hlen]), fdp, NAMES, max_edits=4))
        word = len(header) if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 2 * len(header))
        return struct.pack("<Q", word) + header + data[8 + hlen :]
    if region == 1:
        return edit_bytes(data[:8], fdp) + data[8:]
    if region == 2:
        return data[: 8 + hlen] + edit_bytes(data[8 + hlen :], fdp)
    return edit_bytes(data, fdp)


def make_checkpoint(fdp: atheris.FuzzedDataProvider, root: Path) -> Path:
    """The checkpoint an input describes, at root/ckpt."""
    ckpt, outside = root / "ckpt", root / "outside"
    ckpt.mkdir()
    config = CONFIG
    if fdp.ConsumeIntInRange(0, 3) == 0:
        config = edit_json(json.loads(json.dumps(config)), fdp, NAMES)
    place(ckpt / "config.json", dump_json(config), pick_kind(fdp), outside)
    sharded = fdp.ConsumeBool()
    shards = TWO if sharded else ONE
    if sharded or fdp.ConsumeIntInRange(0, 7) == 0:  # an index beside one shard, too
        index = BASE_INDEX if sharded else {"weight_map": {k: "model.safetensors" for k in BASE_INDEX["weight_map"]}}
        index = dump_json(edit_json(json.loads(json.dumps(index)), fdp, NAMES) if fdp.ConsumeBool() else index)
        place(ckpt / INDEX, edit_bytes(index, fdp, 1) if fdp.ConsumeIntInRange(0, 3) == 0 else index, pick_kind(fdp), outside)
    for name, data in shards.items():
        if fdp.ConsumeBool():
            data = _edit_shard(data, fdp)
        place(ckpt / name, data, pick_kind(fdp), outside)
    return ckpt


def _packed_from_checkpoint(ckpt: Path, layer_ids) -> dict[int, np.ndarray]:
    """The oracle: each layer's tensors read whole by safetensors (not convert's slices) and packed."""
    index = ckpt / INDEX
    if index.exists():
        where = {k: ckpt / v for k, v in json.loads(index.read_bytes())["weight_map"].items()}
    else:
        where = {}
        for shard in sorted(ckpt.glob("*.safetensors")):
            with safe_open(shard, framework="pt") as f:
                where.update({k: shard for k in f.keys()})
    out = {}
    for L in layer_ids:
        got = []
        for kind in ("weight", "scale"):
            name = next(n for n in (f"layers.{L}.engram.embed.{kind}", f"model.layers.{L}.engram.embed.{kind}") if n in where)
            with safe_open(where[name], framework="pt") as f:
                got.append(f.get_tensor(name))
        out[L] = pack(*got).numpy()
    return out


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    root = scratch.fresh()
    ckpt = make_checkpoint(fdp, root)
    out = root / "tables"
    over_good = fdp.ConsumeIntInRange(0, 3) == 0
    if over_good:
        out.mkdir()
        for name, blob in GOOD_FILES.items():
            (out / name).write_bytes(blob)
    cfg = TINY if fdp.ConsumeIntInRange(0, 3) == 0 else None
    names = [ckpt, out]
    done, err = keep_rule(lambda: convert_checkpoint(ckpt, out, cfg, chunk_rows=5, progress=False), names)
    if err is not None:
        if over_good:
            _, err2 = keep_rule(lambda: verify_tables(out, TINY, progress=False), names)
            if err2 is not None or any(not np.array_equal(open_tables(out)[L], r) for L, r in BASE_ROWS.items()):
                raise RuleBroken(f"a failed convert ({err}) changed the good table directory it was writing over ({err2})")
        return
    keep_rule(lambda: inspect_tables(out), names)
    _, err = keep_rule(lambda: verify_tables(out, progress=False), names)
    if err is not None:
        raise RuleBroken(f"convert succeeded, but its output does not verify: {err}")
    tables = open_tables(out)
    want = _packed_from_checkpoint(ckpt, tables.config.layer_ids)
    for L, rows in want.items():
        if not np.array_equal(tables[L], rows):
            raise RuleBroken(f"convert succeeded, but layer {L} holds other rows than the checkpoint's tensors pack to")


if __name__ == "__main__":
    fuzz_main(test_one_input)
