"""DeepSeek-V4.1-Flash's KV cache as SGLang itself sizes it, for the planner.

SGLang sizes DeepSeek-V4's pools in `DSV4PoolConfigurator` (model_executor/pool_configurator.py):
bytes per full token (compressed KV and indexer of the layers that own compressed storage)
plus fixed bytes (the sliding-window pool, sized from the request cap when
`--swa-full-tokens-ratio` is not given, as SGLang does for `deepseek_v41`). This module runs
that class, unmodified, over the model's text config with SGLang's own default server
arguments for it (parsed by SGLang's CLI parser, resolved by its model overrides), and writes
the figures with the SGLang version into configs/models/deepseek_v41.json, which the planner
reads: the core never imports sglang.

    python -m engram_sglang.tools.kv_facts            # print the figures
    python -m engram_sglang.tools.kv_facts --write    # and record them for the planner

tests/tools/test_kv_facts.py recomputes them and fails when the file is stale.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from ..core.config import configs_dir

MODEL_TYPE = "deepseek_v41"

# The text config the pools are sized from. SGLang's DeepSeekV4Config defaults (configs/deepseek_v4.py)
# are V4-Flash's; DeepSeek-V4.1-Flash's own compress_ratios and kv_source_layer_ids are not published.
_COMPRESSED = [4 if i % 2 == 0 else 128 for i in range(41)]
TEXT_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 43,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "sliding_window": 128,
    "window_size": 128,
    "max_position_embeddings": 1048576,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "compress_ratios": [0, 0] + _COMPRESSED,
    "kv_source_layer_ids": [],
}
TEXT_CONFIG_SOURCES: dict[str, str] = {
    "num_hidden_layers": "SGLang 0.5.23 DeepSeekV4Config default (43); V4.1-Flash's own count is not published: assumption",
    "head_dim": "SGLang DeepSeekV4Config: qk_nope_head_dim 448 + qk_rope_head_dim 64 (ModelConfig derives nope = head_dim - rope)",
    "qk_rope_head_dim": "SGLang DeepSeekV4Config default",
    "index_head_dim": "SGLang DeepSeekV4Config default",
    "sliding_window": "SGLang DeepSeekV4Config window_size default (128)",
    "window_size": "SGLang DeepSeekV4Config default",
    "max_position_embeddings": "vllm-project/recipes DeepSeek-V4.1-Flash.yaml: context_length 1048576",
    "num_attention_heads": "configs/models/deepseek_v41.json num_attention_heads (sglang PR 39674)",
    "num_key_value_heads": "one latent KV head (MLA-style)",
    "compress_ratios": ("assumption: two sliding-window-only layers, then ratio 4 and 128 alternating (21 and 20 "
                        "layers); V4.1-Flash's list is not published. Each ratio-4 layer costs ~179 B per token, "
                        "each ratio-128 layer ~7 B"),
    "kv_source_layer_ids": "assumption: none shared (every compressed layer owns its storage: an upper bound)",
}
# The server flags the figures are for: SGLang's defaults for the model on an NVIDIA GPU.
SERVER_ARGV = ("--skip-tokenizer-init",)
# vLLM PR 57491 (MI355X TP4): KV capacity 4.325 M -> 6.195 M tokens for ~47 GiB of HBM freed.
VLLM_BYTES_PER_TOKEN = 47 * (1 << 30) / (6.195e6 - 4.325e6)


@contextlib.contextmanager
def _quiet():
    """SGLang logs and warns at import and while resolving (CPU-only quantization notes)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def compute(text_config: Optional[dict[str, Any]] = None, argv: Sequence[str] = SERVER_ARGV) -> dict[str, Any]:
    """SGLang's DSV4PoolConfigurator over `text_config` at the server flags `argv`."""
    text = dict(TEXT_CONFIG if text_config is None else text_config)
    with tempfile.TemporaryDirectory(prefix="engram-kv-facts-") as d, _quiet():
        import sglang
        from sglang.srt import runtime_context
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": MODEL_TYPE, "text_config": text}
        (Path(d) / "config.json").write_text(json.dumps(config))
        server_args = prepare_server_args(["--model-path", d, "--device", "cpu", *argv])
        context = runtime_context.create_context(server_args, role="scheduler")
        with runtime_context.use_context(context):
            resolved = context.resolved_server_args_dict()
            model_config = ModelConfig.from_server_args(server_args)
            # What KVCacheConfigurator hands the pool configurator on one rank (no PP, no draft).
            kvc = types.SimpleNamespace(
                kv_cache_dtype_str=resolved["kv_cache_dtype"], model_config=model_config,
                spec_algorithm=SpeculativeAlgorithm.NONE, spec_aux_config=None,
                layer_info=types.SimpleNamespace(start_layer=0, end_layer=text["num_hidden_layers"]),
                pp_size=1, pp_group=None, sliding_window_size=text["sliding_window"],
                page_size=resolved["page_size"], attn_dp_size=1)
            pools = DSV4PoolConfigurator(kvc)
            fixed = float(pools._get_swa_fixed_bytes())
            return {
                "sglang_version": sglang.__version__,
                "server_args": {k: resolved.get(k) for k in (
                    "page_size", "kv_cache_dtype", "max_running_requests", "chunked_prefill_size",
                    "attention_backend", "disable_radix_cache")},
                "kv_latent_slot_bytes": pools.kv_bytes,
                "bytes_per_full_token": float(pools.bytes_per_full_token),
                "bytes_per_swa_token": float(pools.bytes_per_swa_token),
                "swa_cap_tokens": pools.swa_cap_tokens,
                "swa_fixed_bytes": fixed,
                "layers_owning_compressed_kv": {str(r): len(v) for r, v in sorted(pools.stage_owner_layers.items())},
            }


def model_facts_path() -> Path:
    return configs_dir() / "models" / f"{MODEL_TYPE}.json"


def record(facts_path: Path, figures: dict[str, Any]) -> dict[str, Any]:
    """The model facts file with SGLang's figures in it (returned, not written)."""
    facts = json.loads(facts_path.read_text())
    version = figures["sglang_version"]
    per_token = figures["bytes_per_full_token"]
    args = figures["server_args"]
    facts["kv_bytes_per_token"] = per_token
    facts["kv_bytes_per_token_source"] = (
        f"SGLang {version} DSV4PoolConfigurator over the text config in sglang_pools (its default flags: "
        f"kv {args['kv_cache_dtype']}, page {args['page_size']}, {args['attention_backend']} with "
        f"{figures['kv_latent_slot_bytes']} B latent slots): compressed KV and indexer of the layers owning "
        f"compressed storage, per rank (the one latent head is not split over TP); written by "
        f"engram_sglang/tools/kv_facts.py")
    facts["kv_bytes_per_token_elsewhere"] = round(VLLM_BYTES_PER_TOKEN)
    facts["kv_bytes_per_token_elsewhere_source"] = (
        "vLLM PR 57491 (MI355X TP4): KV capacity 4.325 M -> 6.195 M tokens for ~47 GiB of HBM freed, in vLLM's "
        "own accounting; SGLang prices DeepSeek-V4.1's sliding-window pool as fixed bytes, not per token")
    facts["kv_fixed_bytes_per_rank"] = figures["swa_fixed_bytes"]
    facts["kv_fixed_bytes_per_rank_source"] = (
        f"SGLang {version} DSV4PoolConfigurator: the sliding-window pool sized from the request cap "
        f"({figures['swa_cap_tokens']} slots x {figures['bytes_per_swa_token']:g} B at max_running_requests "
        f"{args['max_running_requests']}, radix cache on), taken before KV tokens are counted")
    facts["sglang_pools"] = {
        "_comment": "Written by engram_sglang/tools/kv_facts.py; recomputed by tests/tools/test_kv_facts.py.",
        **figures,
        "text_config": TEXT_CONFIG,
        "text_config_sources": TEXT_CONFIG_SOURCES,
    }
    return facts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engram_sglang.tools.kv_facts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"record the figures in configs/models/{MODEL_TYPE}.json")
    args = parser.parse_args(argv)
    figures = compute()
    ratio = VLLM_BYTES_PER_TOKEN / figures["bytes_per_full_token"]
    print(f"SGLang {figures['sglang_version']}: {figures['bytes_per_full_token']:g} B per KV token, "
          f"{figures['swa_fixed_bytes'] / (1 << 30):.2f} GiB fixed sliding-window pool per rank "
          f"({figures['swa_cap_tokens']} slots x {figures['bytes_per_swa_token']:g} B); "
          f"vLLM PR 57491's ~{VLLM_BYTES_PER_TOKEN:.0f} B per token is {ratio:.1f}x that")
    if args.write:
        path = model_facts_path()
        path.write_text(json.dumps(record(path, figures), indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
