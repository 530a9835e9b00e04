"""Engram modes (serving/modes.py): parsing, the request check and prefix key, the per-slot
record and per-token mask, and what "off" means in the Engram layer (engram_sglang/models/layer.py).
The served behaviour is tested end to end in test_e2e_modes.py."""

from __future__ import annotations

import types

import pytest
import torch

from engram_sglang.models.layer import EngramLayer
from engram_sglang.serving import modes
from engram_sglang.serving.modes import END, Mode, ModeError, SlotModes, parse_mode
from engram_sglang.serving.settings import ServeSettings


@pytest.mark.parametrize("value, span", [
    ("on", (0, END)), ("off", (0, 0)), ("prefill", (0, 7)), ("decode", (7, END)),
    ({"mode": "window", "from": 3, "until": 9}, (3, 9)), ({"mode": "window", "from": 4}, (4, END)),
    ({"mode": "window", "from": 2, "until": None}, (2, END)),
])
def test_each_mode_is_one_interval_of_positions(value, span):
    assert parse_mode(value).span(7) == span


@pytest.mark.parametrize("value, says", [
    ("of", "'of'"), ("ON", "'ON'"), (1, "got 1"), (None, "got None"), ({"mode": "prefill"}, "'prefill'"),
    ({"mode": "window"}, '["from"] must be an integer >= 0 (at most 2**62), got None'),
    ({"mode": "window", "from": 0, "until": 2**63}, f"got {2**63}"),  # would overflow int64 in the scheduler
    ({"mode": "window", "from": -1}, "got -1"), ({"mode": "window", "from": True}, "got True"),
    ({"mode": "window", "from": 1.5}, "got 1.5"), ({"mode": "window", "from": 0, "until": "9"}, "got '9'"),
    ({"mode": "window", "from": 5, "until": 4}, '"until" (4) must not be below "from" (5)'),
    ({"mode": "window", "from": 0, "to": 3}, "'to'"),
])
def test_a_bad_mode_is_one_line_naming_the_value(value, says):
    with pytest.raises(ModeError) as e:
        parse_mode(value)
    text = str(e.value)
    assert "\n" not in text and text.startswith('sampling_params.custom_params["engram"]') and says in text, text
    assert isinstance(e.value, ValueError)  # SGLang's HTTP 400


def test_request_modes_need_the_ablation_flag_and_default_to_the_servers():
    assert modes.request_mode(None, Mode("prefill")) == Mode("prefill")
    assert modes.request_mode({"thinking_budget": 3}, Mode("off"), allowed=False) == Mode("off")
    assert modes.request_mode({"engram": "decode"}, allowed=True) == Mode("decode")
    with pytest.raises(ModeError, match=r"needs a server started with --engram-ablation on"):
        modes.request_mode({"engram": "off"}, allowed=False)


def tokenized(params, ids=(1, 2, 3, 4), extra_key=None):
    return types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=params), input_ids=list(ids),
                                 input_embeds=None, extra_key=extra_key)


def test_the_prefix_cache_key_separates_every_pair_of_different_intervals():
    """Requests whose tokens' KV could differ never share a key; the key always begins with
    the mode, so a user's own extra_key cannot pose as another mode's; a server without modes
    keeps SGLang's own key."""
    settings = ServeSettings(ablation=True)
    keys = {}
    for value in ("on", "off", "prefill", "decode", {"mode": "window", "from": 1, "until": 3},
                  {"mode": "window", "from": 1}, {"mode": "window", "from": 0, "until": 3}):
        for n in (4, 5):
            req = tokenized({"engram": value}, ids=range(n), extra_key="user")
            modes.check_request(req, settings)
            keys.setdefault(req.extra_key, set()).add(parse_mode(value).span(n))
    assert all(len(spans) == 1 for spans in keys.values()), keys
    assert {k for k, spans in keys.items() if spans == {(0, END)}} == {"engram=on|user"}
    assert all(k.endswith("|user") for k in keys)  # SGLang appends a LoRA id after it
    posing = tokenized({"engram": "on"}, extra_key="engram=off|")
    modes.check_request(posing, settings)
    off = tokenized({"engram": "off"})
    modes.check_request(off, settings)
    assert posing.extra_key != off.extra_key == "engram=off|"
    session = tokenized({"engram": "off"})
    session.session_params = {"id": "s"}
    with pytest.raises(ModeError, match="session_params"):
        modes.check_request(session, settings)
    plain = tokenized(None)
    modes.check_request(plain, ServeSettings())
    assert plain.extra_key is None
    served_off = tokenized(None)
    modes.check_request(served_off, ServeSettings(mode="off"))
    assert served_off.extra_key == "engram=off|"
    with pytest.raises(ModeError, match="--engram-ablation on"):
        modes.check_request(tokenized({"engram": "on"}), ServeSettings())


def batch(*reqs):
    """A scheduler batch as SGLang 0.5.23 lays it out (the slot on each request's KV record)."""
    return types.SimpleNamespace(reqs=[types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=slot),
                                                             origin_input_ids=[0] * n,
                                                             sampling_params=types.SimpleNamespace(custom_params=p))
                                       for slot, n, p in reqs])


def test_the_request_slot_is_read_where_sglang_keeps_it():
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo

    kv = ReqKvInfo()
    kv.req_pool_idx = 7
    assert modes.request_slot(types.SimpleNamespace(kv=kv)) == 7
    assert "kv" in Req.__init__.__code__.co_names  # Req() makes its KV record


def test_per_token_mask_from_slots_and_positions():
    """One step of three requests (slot, prompt length, mode): prefill chunk, decode, window."""
    slots = SlotModes()
    settings = ServeSettings(ablation=True)
    modes.record_batch(batch((2, 5, {"engram": "prefill"}), (0, 3, {"engram": "decode"}),
                             (7, 9, {"engram": {"mode": "window", "from": 1, "until": 3}})), settings, slots)
    token_req = torch.tensor([2, 2, 2, 0, 0, 7, 7, 7, 7])
    positions = torch.tensor([3, 4, 5, 2, 3, 0, 1, 2, 3])
    on = slots.token_mask(token_req, positions)
    assert on.tolist() == [True, True, False, False, True, False, True, True, False]
    # A batch whose requests are all on: no mask at all (the step runs as without modes).
    modes.record_batch(batch((2, 5, {"engram": "on"}), (0, 3, None)), settings, slots)
    assert slots.token_mask(token_req[:5], positions[:5]) is None
    # A server without modes records nothing.
    fresh = SlotModes()
    modes.record_batch(batch((2, 5, {"engram": "off"})), ServeSettings(), fresh)
    assert fresh.token_mask(torch.tensor([2]), torch.tensor([0])) is None
    modes.record_batch(batch((2, 5, None)), ServeSettings(mode="off"), fresh)
    assert fresh.token_mask(torch.tensor([2]), torch.tensor([0])).tolist() == [False]


def test_mask_for_a_sequence_is_the_reference_s():
    assert modes.mask_for(Mode("prefill"), 3, 5) == [True, True, True, False, False]
    assert modes.mask_for(Mode("decode"), 3, 5) == [False, False, False, True, True]
    assert modes.mask_for(parse_mode({"mode": "window", "from": 1, "until": 2}), 3, 4) == [False, True, False, False]


# ------------------------------------------------------------- "off" in the layer
def layer_and_inputs(T=20, D=32, C=6, seed=0):
    torch.manual_seed(seed)
    layer = EngramLayer(D, C, 16, dilation=3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer, torch.randn(T, D), torch.randn(T, C, 16)


def test_an_off_token_adds_exactly_zero_and_feeds_zero_to_the_conv_of_later_tokens():
    layer, h, rows = layer_and_inputs()
    on = torch.ones(20, dtype=torch.bool)
    on[[4, 9, 10]] = False
    out = layer(h, rows, on)
    assert torch.equal(out[~on], torch.zeros_like(out[~on]))
    assert torch.equal(out[:4], layer(h, rows)[:4])  # before the first off token nothing changes
    # Whatever an off token's hidden state and rows are, no later token sees them: its conv input is 0.
    h2, rows2 = h.clone(), rows.clone()
    h2[~on], rows2[~on] = torch.randn_like(h2[~on]), torch.randn_like(rows2[~on])
    assert torch.equal(layer(h2, rows2, on), out)
    # Without the mask they do (the control: the dilated conv reaches 3, 6 and 9 tokens back).
    assert not torch.equal(layer(h2, rows2)[on], layer(h, rows)[on])
    # Token 13 reaches back to 10 (off), so it differs from the all-on output; all on == no mask.
    assert not torch.equal(out[13], layer(h, rows)[13])
    assert torch.equal(layer(h, rows, torch.ones(20, dtype=torch.bool)), layer(h, rows))


def test_modes_turn_cuda_graphs_off_with_one_line():
    """Each step's modes are applied from the host (a mask, reads of the on tokens only),
    which a captured graph would not replay."""
    from engram_sglang.core.errors import EngramConfigError
    from engram_sglang.serving.graphs import graph_args

    assert graph_args("device", []) == ([], None)
    extra, why = graph_args("device", [], modes="--engram-ablation on")
    assert extra == ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    assert why.startswith("--engram-ablation on switches Engram per token") and "\n" not in why
    with pytest.raises(EngramConfigError, match="--engram-mode prefill switches"):
        graph_args("host", ["--cuda-graph-backend-decode", "full"], modes="--engram-mode prefill")


# ------------------------------------------------------------------ the runtime
@pytest.mark.parametrize("placement", ["device", "disk"])
def test_the_runtime_reads_only_the_rows_of_tokens_with_engram_on(tmp_path, placement):
    """One step of two requests (slot 0 off after position 2, slot 5 off): the stores are
    asked for the on tokens' rows only, every off token gets +0.0 rows, the on tokens their
    exact rows, and the statistics count the off tokens. Then the same step with every
    request on reads every row (the control)."""
    from engram_sglang.core import rowformat
    from engram_sglang.core.hashing import NgramHasher
    from engram_sglang.serving.runtime import EngramRuntime
    from tests.support.tables import random_table_dir, small_config

    cfg = small_config(400)
    root, table = random_table_dir(tmp_path, cfg)
    gen = torch.Generator().manual_seed(0)
    hasher = NgramHasher(cfg, torch.randint(0, cfg.compressed_vocab_size, (cfg.vocab_size,), generator=gen))
    tokens = torch.randint(0, cfg.vocab_size, (10,), generator=gen)
    hash_ids = hasher.hash_sequence(tokens.tolist())
    token_req = torch.tensor([0] * 6 + [5] * 4)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    want_on = torch.tensor([True, True, False, False, False, False, False, False, False, False])
    slots, cols = SlotModes(), hash_ids.shape[2]
    runtime = EngramRuntime(cfg, hasher, ServeSettings(placement=placement), root, torch.device("cpu"))
    try:
        for record, on in (({0: (0, 2), 5: (0, 0)}, want_on), ({0: (0, END), 5: (0, END)}, torch.ones(10, dtype=torch.bool))):
            slots.record(record)
            served_before = [runtime.stores[L].stats()["rows_served"] for L in cfg.layer_ids]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("engram_sglang.serving.runtime.SLOTS", slots)
                step = runtime.begin(hash_ids, token_req, positions, tokens, "extend")
                assert (step.on is None) == bool(on.all())
                for i, L in enumerate(cfg.layer_ids):
                    got = rowformat.bf16_bits(runtime.rows(step, L))
                    full = rowformat.dequantize(torch.from_numpy(table[L][hash_ids[:, i].reshape(-1).numpy()]))
                    full = full.view(10, cols, -1)
                    full[~on] = 0
                    assert torch.equal(got, rowformat.bf16_bits(full)), L
                runtime.end(step, 0.0, 0.0, 1)
            served = [runtime.stores[L].stats()["rows_served"] - b for L, b in zip(cfg.layer_ids, served_before)]
            assert served == [int(on.sum()) * cols] * len(cfg.layer_ids), served
        assert runtime.stats()["engram_off_tokens"] == 8
    finally:
        runtime.close()


def test_a_huge_bad_mode_is_echoed_cut_short():
    from engram_sglang.serving.modes import ModeError, parse_mode
    big = "x" * (1 << 20)
    for value in (big, {"mode": big}, {"mode": "window", "from": big}):
        try:
            parse_mode(value)
        except ModeError as e:
            line = str(e)
        else:
            raise AssertionError("no ModeError")
        assert len(line) < 400 and "bytes)" in line and "\n" not in line
    try:
        parse_mode("bogus")
    except ModeError as e:  # negative control: a short value is echoed whole
        assert "'bogus'" in str(e) and "bytes)" not in str(e)


def test_a_non_object_custom_params_is_refused_where_modes_are_taken():
    for params in ("engram=off", ["off"], 3):
        with pytest.raises(ModeError, match="must be a JSON object"):
            modes.check_request(tokenized(params), ServeSettings(ablation=True))
    # Negative control: a server without per-request modes leaves SGLang's custom_params alone.
    modes.check_request(tokenized("engram=off"), ServeSettings())
