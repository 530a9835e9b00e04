"""SGLang model class of the Qwen3 + Engram family: architecture `Qwen3EngramForCausalLM`.

A Qwen3 decoder (SGLang's own attention, MLP, norms, paged KV cache) with the paper-form
Engram layer (engram_sglang.models.layer) added to the residual stream before the attention of
each layer in `engram_layer_ids`. Weights load from safetensors (Hugging Face Qwen3 names
plus `model.layers.{L}.engram.*`); tables come from the packed table directory through a
TableStore in the configured placement (`--engram-placement`, `--engram-table-dir`).

Per step: the runtime hashes every token (its StepHasher, with SGLang's per-request
history) and issues every Engram layer's gather at once (`begin_step`); each Engram layer
then asks the runtime for its rows (`rows`), waiting on its own gather.
The short conv reaches 12 tokens back: its inputs are kept per KV-cache slot
(`ServingEngramLayer`), so prefix-cache hits, chunked prefill and retraction read the same
predecessors as one pass over the whole sequence. That state is counted in the KV pool's
per-token cost and allocated right after the pool (plugin hooks), never during CUDA-graph
capture.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional, Tuple

import torch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.qwen2 import Qwen2MLP
from sglang.srt.models.qwen3 import Qwen3Attention
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix
from torch import nn

from ..core.config import EngramConfig
from ..core.errors import EngramError
from ..core.rowformat import bf16_bits
from .layer import EngramLayer

logger = logging.getLogger(__name__)


class ServingEngramLayer(EngramLayer):
    """EngramLayer over a batch of requests, with its conv inputs kept per KV-cache slot."""

    _cache: Optional[torch.Tensor] = None

    @staticmethod
    def cache_slots(token_to_kv_pool) -> int:
        """Conv-cache rows for a KV pool: one per KV slot (out_cache_loc < size + page_size)."""
        return token_to_kv_pool.size + token_to_kv_pool.page_size + 1

    def allocate_cache(self, slots: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self._cache = torch.zeros(slots, self.hidden_size, dtype=dtype, device=device)
        logger.info("engram conv cache: %d slots x %d (%.1f MiB)", slots, self.hidden_size,
                    self._cache.numel() * self._cache.element_size() / 2**20)
        return self._cache

    def _conv_cache(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._cache is None:
            # The model runner allocates it once the KV pool exists (plugin hook); this
            # fallback serves a runner that did not, but never inside a graph capture.
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise EngramError("the Engram conv cache was not allocated before CUDA-graph capture "
                                  "(init_engram_buffers was not called)")
            from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

            self.allocate_cache(self.cache_slots(get_token_to_kv_pool()), dtype, device)
        if self._cache.dtype != dtype:
            raise EngramError(f"Engram conv cache holds {self._cache.dtype}, the step computes in {dtype}")
        return self._cache

    def forward_batch(self, h: torch.Tensor, rows: torch.Tensor, token_req: torch.Tensor, positions: torch.Tensor,
                      forward_batch: ForwardBatch, on: Optional[torch.Tensor] = None,
                      window_sums: Optional[list] = None) -> torch.Tensor:
        """Engram output [T, D] for a batch: h [T, D], rows [T, C, 256]; `on` bool [T]: the
        tokens with Engram on (serving/modes.py; None: all), the others add 0 and keep a
        zero conv input. `window_sums` (the trace's): gets each token's conv window checksums,
        int64 [T, kernel], one per entry (its bf16 bits summed), oldest first."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        value = self.gated_value(h, rows)
        x = self.conv_input(value, h.dtype, on)
        cache = self._conv_cache(h.dtype, h.device)
        loc = forward_batch.out_cache_loc
        if loc.device.type == "cpu" and loc.numel() and int(loc.max()) >= cache.shape[0]:
            raise EngramError(f"KV slot {int(loc.max())} is outside the Engram conv cache ({cache.shape[0]} slots)")
        cache[loc.to(torch.int64)] = x
        req_to_token = get_req_to_token_pool().req_to_token
        back = (self.kernel_size - 1 - torch.arange(self.kernel_size, device=h.device)) * self.dilation
        src = positions.to(torch.int64).unsqueeze(-1) - back  # [T, K]
        slots = req_to_token[token_req.unsqueeze(-1), src.clamp_min(0)].to(torch.int64)
        window = cache[slots].masked_fill((src < 0).unsqueeze(-1), 0)
        if window_sums is not None:
            window_sums.append(bf16_bits(window).to(torch.int64).sum(-1))
        return self.finish(value, window, h.dtype, on)


class Qwen3EngramDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer; an Engram layer adds to the residual stream before attention."""

    def __init__(self, config, layer_id: int, engram: Optional[EngramConfig], quant_config=None, prefix: str = ""):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        self.self_attn = Qwen3Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            layer_id=layer_id,
            rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 1000000)),
            rope_scaling=rope or getattr(config, "rope_scaling", None),
            head_dim=getattr(config, "head_dim", None),
            max_position_embeddings=getattr(config, "max_position_embeddings", 32768),
            quant_config=quant_config,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=getattr(config, "attention_bias", False),
            prefix=add_prefix("self_attn", prefix),
        )
        self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=add_prefix("mlp", prefix))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.engram = (ServingEngramLayer.from_config(config, engram, dtype=torch.get_default_dtype())
                       if engram is not None else None)
        self.layer_id = layer_id
        self.tp_size = get_parallel().tp_size

    def forward(self, positions: torch.Tensor, h: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        x = self.input_layernorm(h)
        attn = self.self_attn(positions=positions, hidden_states=x, forward_batch=forward_batch)
        if self.tp_size > 1:
            from sglang.srt.distributed import tensor_model_parallel_all_reduce

            attn = tensor_model_parallel_all_reduce(attn)  # o_proj leaves the reduce to the caller
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h), forward_batch=forward_batch)


class Qwen3EngramModel(nn.Module):
    def __init__(self, config, engram: EngramConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=add_prefix("embed_tokens", prefix))
        self.layers = nn.ModuleList(
            Qwen3EngramDecoderLayer(config, i, engram if i in engram.layer_ids else None, quant_config,
                                    prefix=add_prefix(f"layers.{i}", prefix))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.start_layer, self.end_layer = 0, config.num_hidden_layers


class Qwen3EngramForCausalLM(nn.Module):
    """Qwen3 + Engram (docs/engram.md §5) served by SGLang with engram-sglang's stores."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from ..serving.settings import ServeSettings

        self.config = config
        self.quant_config = quant_config
        self.pp_group = get_parallel().pp_group
        if self.pp_group.world_size > 1:
            raise EngramError("Qwen3EngramForCausalLM does not support pipeline parallelism (--pp-size must be 1)")
        self.settings = ServeSettings.from_env()
        source = f"{getattr(config, '_name_or_path', '') or 'model'}/config.json"
        self.engram_config = EngramConfig.from_dict(config.to_dict(), source=source)
        if self.engram_config.hidden_size not in (None, config.hidden_size):
            raise EngramError(f"{source}: hidden_size {config.hidden_size} disagrees with the Engram config's "
                              f"{self.engram_config.hidden_size}")
        self.model = Qwen3EngramModel(config, self.engram_config, quant_config, prefix=add_prefix("model", prefix))
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                          prefix=add_prefix("lm_head", prefix))
        self.logits_processor = LogitsProcessor(config)
        self.runtime = _build_runtime(self.engram_config, self.settings)
        # The runtime's step hasher, an upstream EngramHasher subclass, as a submodule: SGLang's
        # scheduler finds it there and keeps its per-request history.
        self.engram_hasher = self.runtime.step_hasher

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    # ------------------------------------------------- state kept per KV-cache slot
    def _engram_layers(self) -> list[ServingEngramLayer]:
        return [layer.engram for layer in self.model.layers if layer.engram is not None]

    def engram_bytes_per_kv_token(self) -> int:
        """Bytes of Engram state per KV-cache token (the conv inputs of every Engram layer,
        in the residual stream's dtype): the plugin adds them to the KV pool's per-token
        cost, so SGLang sizes the pool with them."""
        dtype = self.model.embed_tokens.weight.dtype
        return sum(e.hidden_size for e in self._engram_layers()) * torch.empty((), dtype=dtype).element_size()

    def init_engram_buffers(self, token_to_kv_pool) -> None:
        """Allocate the per-KV-slot conv caches (the plugin calls this once the KV pool
        exists, before attention backends and CUDA-graph capture)."""
        weight = self.model.embed_tokens.weight
        slots = ServingEngramLayer.cache_slots(token_to_kv_pool)
        caches = [layer.allocate_cache(slots, weight.dtype, weight.device) for layer in self._engram_layers()]
        # Under PD disaggregation they travel with SGLang's KV transfer (serving/pd.py).
        from ..serving import pd

        layer_ids = [layer.layer_id for layer in self.model.layers if layer.engram is not None]
        pd.register(token_to_kv_pool, caches, layer_ids, self.runtime.pd_identity(),
                    self.settings.debug)

    @property
    def start_layer(self) -> int:
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        return self.model.end_layer

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                input_embeds: Optional[torch.Tensor] = None, get_embedding: bool = False, pp_proxy_tensors=None):
        if get_embedding:
            raise EngramError("Qwen3EngramForCausalLM is a generation model (no embedding mode)")
        step = self.runtime.begin_step(input_ids, positions, forward_batch)
        token_req = step.token_req
        # The step's ids: an id the tokenizer does not know is the pad token there, its request
        # aborted after the batch (EngramRuntime.refuse_unknown_tokens): the embedding sees known ids only.
        h = self.model.embed_tokens(step.input_ids) if input_embeds is None else input_embeds
        engram_seconds = layer_seconds = 0.0
        layer_calls = 0
        for layer in self.model.layers:
            if layer.engram is not None:
                t0 = time.perf_counter()
                rows = self.runtime.rows(step, layer.layer_id)
                sums = [] if self.runtime.tracing and not step.captured else None
                h = h + layer.engram.forward_batch(h, rows, token_req, positions, forward_batch, on=step.on,
                                                   window_sums=sums)
                if sums:
                    step.windows[layer.layer_id] = sums[0]
                engram_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            h = layer(positions, h, forward_batch)
            layer_seconds += time.perf_counter() - t0
            layer_calls += 1
        h = self.model.norm(h)
        self.runtime.end(step, engram_seconds, layer_seconds, layer_calls)
        return self.logits_processor(step.input_ids, h, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        stacked = [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for param_name, shard_name, shard_id in stacked:
                if shard_name in name and ".engram." not in name:
                    target = name.replace(shard_name, param_name)
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise EngramError(f"checkpoint tensor {name} has no parameter in Qwen3EngramForCausalLM")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        missing = sorted(n for n in params if n not in loaded and not (n == "lm_head.weight" and self.config.tie_word_embeddings))
        if missing:
            raise EngramError(f"checkpoint lacks {len(missing)} tensor(s) of Qwen3EngramForCausalLM, e.g. {missing[0]}")


def _build_runtime(cfg: EngramConfig, settings):
    """Open the tables and the hasher (serving/startup.py); configuration errors surface there, as one line."""
    from sglang.srt.runtime_context import get_model, get_serving

    from ..serving.startup import open_runtime

    try:
        model_path = get_model().model_path
        tokenizer_path = get_serving().tokenizer_path or model_path
    except (AttributeError, ValueError):
        raise EngramError("Qwen3EngramForCausalLM must be built inside SGLang (no model path published)") from None
    # One runtime per model, our NgramHasher over the served tokenizer, rows sharded over the TP ranks.
    return open_runtime(settings, parallel=get_parallel(), model_path=model_path, cfg=cfg,
                        tokenizer_path=tokenizer_path)


EntryClass = Qwen3EngramForCausalLM
