"""`engram-sglang demo-model DIR`: a small Qwen3 + Engram model built here, from nothing.

* Tokenizer: byte-level BPE trained locally on text this machine has (corpus.py).
* Backbone weights: drawn from a fixed seed (small, so the backbone barely moves the
  residual stream).
* Engram tables: n-gram memory of the same corpus. Every hash column's row holds the mean
  embedding of the tokens that followed the n-grams hashed into it (rotated by a fixed
  random orthogonal matrix per column, which the value projection undoes), quantized to
  the packed fp8 row format. Rows no n-gram reached hold small noise.

So the model completes text from its Engram rows: the embeddings are tied, the value
projection turns the retrieved rows back into next-token embeddings, and the logits pick
the token most columns vote for. Switching Engram off (scale 0) leaves a near-random
backbone that mostly repeats its input: the tests use that to prove Engram matters.
Everything is deterministic: two builds give the same files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from ...core.config import DEFAULT_TABLE_DIR, EngramConfig
from ...core.hashing import EngramLayout, NgramHasher, compressed_token_map
from ...core.rowformat import ROW_VALUES, quantize
from .corpus import demo_corpus, train_tokenizer

DEMO_SEED = 20261129
TABLE_DIR_NAME = DEFAULT_TABLE_DIR  # the demo writes its tables where serving looks for them

# The model's shape (small: a CPU serves it at a few hundred tokens/s).
HIDDEN = 256
LAYERS = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
INTERMEDIATE = 512
VOCAB = 1500
ENGRAM_LAYERS = (1, 3)
MAX_NGRAM, ENGRAM_HEADS, ROW_DIM = 4, 4, ROW_VALUES
ENGRAM_VOCAB = 48_000  # where the prime search starts: ~48k rows per hash column (~290 MiB of tables).
# At 12k rows a 3- or 4-gram row held 4-6 of the corpus's n-grams on average and 5 of the demo's 8
# completions looped ("by by by"); at 48k all 8 read as the corpus continues.
ORDER_WEIGHT = {2: 0.5, 3: 1.0, 4: 1.5}  # longer n-grams are more specific: more weight
CONV_STD = 0.5  # the short conv moves the output visibly (so a wrong conv state shows)

DEMO_PROMPTS = (
    "def __init__(self",
    "    for i in range(",
    "        raise ValueError(",
    "Café naïve",
    "    return self.",
    "def read(self, size=-1):",
)


def _engram_config(tokenizer, source: str) -> EngramConfig:
    _, compressed = compressed_token_map(tokenizer)
    return EngramConfig(
        layer_ids=ENGRAM_LAYERS, max_ngram_size=MAX_NGRAM, n_heads=ENGRAM_HEADS, head_dim=ROW_DIM,
        vocab_size=ENGRAM_VOCAB, compressed_vocab_size=compressed, pad_token_id=tokenizer.pad_token_id,
        hidden_size=HIDDEN, source=source,
    )


def _hf_config(vocab: int, cfg: EngramConfig) -> dict:
    return {
        "architectures": ["Qwen3EngramForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": None,
        **cfg.hash_fields(),
    }


def _weights(gen: torch.Generator, vocab: int, cfg: EngramConfig) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Backbone and Engram weights (float32), and one orthogonal rotation per hash column."""

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=1.0),
                                  "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        w[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        w[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    rotations = [torch.linalg.qr(torch.randn(ROW_DIM, ROW_DIM, generator=gen))[0] for _ in range(cfg.hash_columns)]
    order_of = [o for o in range(2, MAX_NGRAM + 1) for _ in range(ENGRAM_HEADS)]
    # value_proj block c maps a rotated row back to hidden space: v = sum_c weight_c * mean next embedding.
    value = torch.cat([ORDER_WEIGHT[order_of[c]] * rotations[c][:HIDDEN] for c in range(cfg.hash_columns)], dim=1)
    for L in cfg.layer_ids:
        p = f"model.layers.{L}.engram."
        w[p + "value_proj.weight"] = value.clone()
        w[p + "key_proj.weight"] = normal(HIDDEN, cfg.hash_columns * ROW_DIM)
        w[p + "norm_h.weight"] = torch.ones(HIDDEN)
        w[p + "norm_k.weight"] = torch.ones(HIDDEN)
        w[p + "norm_v.weight"] = torch.ones(HIDDEN)
        w[p + "conv.weight"] = normal(HIDDEN, 1, 4, std=CONV_STD)
    return w, rotations


def _tables(gen, texts, tokenizer, cfg: EngramConfig, embed: torch.Tensor, rotations) -> dict[int, torch.Tensor]:
    """Packed rows per layer: the mean next-token embedding per row, rotated per column."""
    hasher = NgramHasher.from_tokenizer(cfg, tokenizer)
    layout = hasher.layout
    ids_per_doc, next_per_doc = [], []
    for text in texts:
        toks = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
        if toks.numel() < 2:
            continue
        ids_per_doc.append(hasher.hash_sequence(toks)[:-1])  # [T-1, L, C]: n-grams that have a successor
        next_per_doc.append(toks[1:])
    hash_ids, nxt = torch.cat(ids_per_doc), torch.cat(next_per_doc)
    target = embed[nxt].bfloat16().float()  # what the model's tied head scores against
    out = {}
    for i, L in enumerate(cfg.layer_ids):
        rows = layout.num_embeddings[i]
        sums = torch.zeros(rows, HIDDEN)
        counts = torch.zeros(rows)
        flat = hash_ids[:, i].reshape(-1)
        sums.index_add_(0, flat, target.repeat_interleave(cfg.hash_columns, dim=0))
        counts.index_add_(0, flat, torch.ones(flat.numel()))
        mean = sums / counts.clamp_min(1).unsqueeze(-1)
        values = torch.randn(rows, ROW_DIM, generator=gen) * 0.05
        bounds = layout.column_bounds(i)
        for c in range(cfg.hash_columns):
            lo, hi = bounds[c], bounds[c + 1]
            hit = counts[lo:hi] > 0
            rotated = mean[lo:hi] @ rotations[c][:HIDDEN]
            values[lo:hi][hit] = rotated[hit]
        out[L] = quantize(values)
    return out


def build_demo_model(out_dir: str | os.PathLike, *, overwrite: bool = False, progress: bool = False) -> Path:
    """Write the demo model into `out_dir`: config.json, model.safetensors, tokenizer files,
    and the packed Engram tables in `out_dir/engram_tables/`. Returns `out_dir`.

    Written into a hidden sibling and renamed into place when complete: a failure (a full or
    read-only filesystem, an interrupt) removes the sibling and leaves `out_dir` as it was."""
    import tempfile

    from safetensors import SafetensorError

    from ...core.errors import EngramError
    from ..outputs import check_output

    out = Path(out_dir)
    check_output(out, "", directory=True, parents=True)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise EngramError(f"{out}: exists and is not empty; pass --overwrite to rebuild the demo model there")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".engram-demo-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise EngramError(f"{out}: cannot write the demo model there ({e.strerror or e})") from None
    try:
        _write_model(work, Path(os.path.abspath(out)) / "config.json", progress)
        if out.is_dir():
            shutil.rmtree(out)
        os.rename(work, out)
    except (OSError, SafetensorError) as e:  # safetensors' write errors (ENOSPC) are not OSErrors
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise EngramError(f"{out}: cannot write the demo model ({why}); nothing was left") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone after the rename; a partial model on failure
    return out


def _write_model(out: Path, config_source: Path, progress: bool) -> None:
    """The demo model's files, into directory `out` (its config names `config_source`)."""
    from safetensors.torch import save_file

    from ...core.tablefile import checkpoint_provenance, write_tables

    texts = demo_corpus()
    tokenizer = train_tokenizer(texts, VOCAB)
    cfg = _engram_config(tokenizer, source=str(config_source))
    # Name the row counts, as config.json does: the tables' fingerprint covers them.
    cfg = dataclasses.replace(cfg, num_embeddings=EngramLayout(cfg).num_embeddings)
    gen = torch.Generator().manual_seed(DEMO_SEED)
    weights, rotations = _weights(gen, len(tokenizer), cfg)
    tables = _tables(gen, texts, tokenizer, cfg, weights["model.embed_tokens.weight"], rotations)
    (out / "config.json").write_text(json.dumps(_hf_config(len(tokenizer), cfg), indent=2) + "\n")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    # The tables belong to this checkpoint (and to the Engram-off copy the demo serves, whose
    # weights differ only in value: the same safetensors header).
    write_tables(out / TABLE_DIR_NAME, cfg, tables, progress=progress, provenance=checkpoint_provenance(out))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}) + "\n")


# ------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> None:
    """`engram-sglang demo-model DIR`: the subcommand, for cli.build_parser."""
    p = subparsers.add_parser("demo-model", help="build the small Qwen3 + Engram demo model locally (no downloads)")
    p.add_argument("out_dir", help=f"model directory to write (config, weights, tokenizer, {DEFAULT_TABLE_DIR}/)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty directory")
    p.set_defaults(func=_cmd_demo_model)


def _cmd_demo_model(args) -> int:
    import time

    from ...core.tablefile import inspect_tables

    t0 = time.perf_counter()
    out = build_demo_model(args.out_dir, overwrite=args.overwrite)
    print(f"demo model written to {out} in {time.perf_counter() - t0:.1f} s")
    print(inspect_tables(out / TABLE_DIR_NAME))
    return 0
