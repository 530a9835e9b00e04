"""The Engram layer (paper form) and the PyTorch reference forward, on CPU, without SGLang."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engram_sglang import EngramConfig, EngramConfigError
from engram_sglang.models.layer import EngramLayer


def random_layer(gen, hidden=48, columns=6, head_dim=32, dilation=4) -> EngramLayer:
    layer = EngramLayer(hidden, columns, head_dim, dilation, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim > 1 else 1.0) + (1.0 if p.ndim == 1 else 0.0))
    return layer


def test_gate_and_value_follow_the_spec(rng):
    """a_t = sigmoid(signed_sqrt(RMSNorm(h) . RMSNorm(k) / sqrt(D))), value = a_t * W_V e_t."""
    layer = random_layer(rng)
    T, D = 9, layer.hidden_size
    h = torch.randn(T, D, generator=rng)
    rows = torch.randn(T, layer.n_columns, layer.head_dim, generator=rng)
    e = rows.reshape(T, -1)
    k, v = e @ layer.key_proj.weight.T, e @ layer.value_proj.weight.T

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    dot = (norm(h, layer.norm_h.weight) * norm(k, layer.norm_k.weight)).sum(-1) / math.sqrt(D)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    torch.testing.assert_close(layer.gated_value(h, rows), gate.unsqueeze(-1) * v, rtol=1e-5, atol=1e-5)


def test_short_conv_is_a_causal_dilated_depthwise_conv1d(rng):
    """out = value + SiLU(Conv1d(RMSNorm(value))), kernel 4, dilation = max n-gram order,
    zero padding before the sequence start: checked against torch's own conv1d."""
    layer = random_layer(rng, dilation=3)
    T = 29  # longer than the reach (9), shorter parts exercise the zero padding
    h = torch.randn(T, layer.hidden_size, generator=rng)
    rows = torch.randn(T, layer.n_columns, layer.head_dim, generator=rng)
    value = layer.gated_value(h, rows)
    x = layer.conv_input(value, torch.float32)
    pad = layer.reach
    y = F.conv1d(F.pad(x.T.unsqueeze(0), (pad, 0)), layer.conv.weight, dilation=layer.dilation,
                 groups=layer.hidden_size)[0].T
    torch.testing.assert_close(layer(h, rows), value + F.silu(y), rtol=1e-5, atol=1e-5)


def test_windows_from_any_store_of_predecessors_give_the_same_output(rng):
    """A serving engine hands `finish` windows it gathered itself (per KV slot): splitting a
    sequence at any point and gathering the earlier conv inputs gives the one-pass bits."""
    layer = random_layer(rng).to(torch.bfloat16)
    T = 20
    h = torch.randn(T, layer.hidden_size, generator=rng).bfloat16()
    rows = torch.randn(T, layer.n_columns, layer.head_dim, generator=rng).bfloat16()
    whole = layer(h, rows)
    value = layer.gated_value(h, rows)
    x = layer.conv_input(value, h.dtype)
    cache = torch.zeros(64, layer.hidden_size, dtype=h.dtype)
    slots = torch.randperm(64, generator=rng)[:T]  # where each position's KV (and conv input) lives
    cache[slots] = x
    back = (layer.kernel_size - 1 - torch.arange(layer.kernel_size)) * layer.dilation
    src = torch.arange(T).unsqueeze(-1) - back
    window = cache[slots[src.clamp_min(0)]].masked_fill((src < 0).unsqueeze(-1), 0)
    served = layer.finish(value, window, h.dtype)
    assert torch.equal(served.view(torch.int16), whole.view(torch.int16))


def test_hyper_connections_are_refused_with_one_line():
    cfg = EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=256, vocab_size=100,
                       compressed_vocab_size=50, pad_token_id=0, hc_mult=4, source="x/config.json")

    class HF:
        hidden_size = 64

    with pytest.raises(EngramConfigError, match=r"x/config.json: hc_mult is 4.*must be 1") as e:
        EngramLayer.from_config(HF, cfg)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_reference_backbone_matches_transformers_qwen3():
    """With Engram off, the reference forward is a plain Qwen3: its logits equal Hugging Face
    transformers' Qwen3ForCausalLM on the same weights (float32)."""
    from transformers import Qwen3ForCausalLM

    from engram_sglang.models.reference import ReferenceModel
    from tests.support.demo_support import demo_dir, table_dir

    ref = ReferenceModel(demo_dir(), table_dir(), engram_scale=0.0, dtype=torch.float32)
    hf = Qwen3ForCausalLM.from_pretrained(str(demo_dir()), dtype=torch.float32).eval()
    ids = ref.tokenizer("def read(self, size=-1):\n    return self.raw.read(size)")["input_ids"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = ref.forward(ids).logits
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
