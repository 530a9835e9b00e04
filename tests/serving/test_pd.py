"""serving/pd.py: the Engram state components of SGLang's PD transfer, the identity check on
the decode side, and the backends refused (the transfer itself: tests/e2e/test_e2e_pd.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engram_sglang.core.errors import EngramConfigError
from engram_sglang.serving import pd

pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang (make setup)")

ID_A = pd.identity_line("aaaabbbb", "on", False)
ID_B = pd.identity_line("aaaabbbb", "on", True)


def kv_args():
    """SGLang's KVArgs with the state lists `setup_state_kv_args` starts from (empty: the
    demo's MHA pool has no state of its own)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    args = KVArgs()
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor",
                 "state_conv_shard_groups", "state_slice_outer_counts", "state_layer_ids"):
        setattr(args, name, [])
    return args


@pytest.fixture
def registered():
    """A KV pool stand-in (page size 4) with two layers' conv caches registered."""
    pool = SimpleNamespace(page_size=4)
    conv = [torch.zeros(4 * 8 + 1, 16, dtype=torch.bfloat16) for _ in range(2)]
    yield pool, conv
    pd._STATES.clear()


def test_identity_line_names_tables_mode_and_ablation():
    assert ID_A != ID_B and len(ID_A) == pd.IDENTITY_BYTES
    assert pd.identity_line("aaaabbbc", "on", False) != ID_A
    assert pd.identity_line("aaaabbbb", "prefill", False) != ID_A
    assert ID_A.rstrip(b"\0").decode().endswith("mode on ablation off")


def test_both_components_registered_page_indexed_and_per_request_slot(registered):
    from sglang.srt.disaggregation.base.conn import StateType

    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A)
    args = kv_args()
    pd.add_state_components(args, pool, SimpleNamespace(size=5), "prefill", "mooncake")
    assert args.state_types == [StateType.BLOCK_SCALE, StateType.REQUEST_ROW]
    assert args.state_data_ptrs[0] == [t.data_ptr() for t in conv]
    assert args.state_item_lens[0] == [4 * 16 * 2] * 2  # one KV page of conv inputs per item
    assert args.state_layer_ids == [[3, 7], [3]]
    rows = pd.active().rows
    assert args.state_item_lens[1] == [pd.IDENTITY_BYTES] and rows.shape == (6, pd.IDENTITY_BYTES)
    assert all(bytes(r.tolist()) == ID_A for r in rows)  # prefill: every slot says who computed it


def prebuilt(*slots, rids=None):
    """SGLang's prebuilt batch (a decode server's newly transferred requests) of these slots,
    as its `_verify_kv_checksums` gets it."""
    rids = rids or [f"req-{s}" for s in slots]
    reqs = [SimpleNamespace(rid=rid, kv=SimpleNamespace(req_pool_idx=s), to_finish=None) for s, rid in zip(slots, rids)]
    return SimpleNamespace(reqs=reqs)


SCHEDULER = SimpleNamespace(attn_tp_cpu_group=None)  # one rank: no agreement to reach


def test_decode_refuses_a_transfer_from_a_prefill_of_other_settings_in_one_line(registered):
    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A)
    pd.add_state_components(kv_args(), pool, SimpleNamespace(size=5), "decode", "mooncake_tcp")
    rows = pd.active().rows
    # What the transfer writes into the decode server's rows (the real one: tests/e2e/test_e2e_pd.py).
    rows[1] = torch.frombuffer(bytearray(ID_A), dtype=torch.uint8)
    rows[2] = torch.frombuffer(bytearray(ID_B), dtype=torch.uint8)
    batch = prebuilt(1, 2, 4)
    assert pd.refuse_mismatched_transfers(SCHEDULER, batch) == 2
    ok, other, missing = (r.to_finish for r in batch.reqs)
    assert ok is None  # slot 1 agrees; slot 4 got nothing
    for finish in (other, missing):
        assert finish.status_code == 400 and "\n" not in finish.message
    assert "Engram identity (tables" in other.message and "ablation on) differs from this decode server's" in other.message
    assert "mode on ablation off): its transfer is refused" in other.message
    assert "none: not transferred" in missing.message
    # Read once: slot 1, reused by a request whose transfer carried no identity, does not pass
    # on its predecessor's row.
    assert "none: not transferred" in pd.check_transferred([1])[1]
    # SGLang's health probe on a decode server transfers nothing: never refused.
    probe = prebuilt(3, rids=["HEALTH_CHECK_probe"])
    assert pd.refuse_mismatched_transfers(SCHEDULER, probe) == 0 and probe.reqs[0].to_finish is None


def test_refused_request_finishes_before_its_first_decode_step(registered):
    """Through SGLang's own Req: the refusal is the finish reason its prebuilt result takes."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A)
    pd.add_state_components(kv_args(), pool, SimpleNamespace(size=5), "decode", "mooncake_tcp")
    pd.active().rows[2] = torch.frombuffer(bytearray(ID_B), dtype=torch.uint8)
    req = Req("r-1", "", [5, 6, 7], SamplingParams(max_new_tokens=4))
    req.kv.req_pool_idx = 2
    assert pd.refuse_mismatched_transfers(SCHEDULER, SimpleNamespace(reqs=[req])) == 1
    assert not req.finished()
    req.update_finish_state()  # what process_batch_result_prebuilt runs first
    assert req.finished() and req.finished_reason.status_code == 400


def test_prefill_and_plain_servers_refuse_nothing(registered):
    assert pd.refuse_mismatched_transfers(SCHEDULER, prebuilt(1)) == 0  # no PD state registered
    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A)
    pd.add_state_components(kv_args(), pool, SimpleNamespace(size=5), "prefill", "mooncake")
    assert pd.refuse_mismatched_transfers(SCHEDULER, prebuilt(1, 2)) == 0


def test_skip_conv_transfer_control_receives_into_scratch(registered):
    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A, debug=(pd.SKIP_DEBUG,))
    args = kv_args()
    pd.add_state_components(args, pool, SimpleNamespace(size=5), "decode", "mooncake")
    assert args.state_data_ptrs[0] != [t.data_ptr() for t in conv]
    assert args.state_data_ptrs[0] == [t.data_ptr() for t in pd.active().scratch]


@pytest.mark.parametrize("backend", ["nixl", "mori", "fake"])
def test_pd_with_another_transfer_backend_is_refused_in_one_line(registered, backend):
    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A)
    with pytest.raises(EngramConfigError, match=rf"^--disaggregation-transfer-backend {backend}: the Engram conv "
                                                r"state travels with mooncake or mooncake_tcp only [^\n]*$"):
        pd.add_state_components(kv_args(), pool, SimpleNamespace(size=5), "prefill", backend)


def test_a_pool_that_uses_the_carrier_itself_is_refused(registered):
    from sglang.srt.disaggregation.base.conn import StateType

    pool, conv = registered
    pd.register(pool, conv, [3, 7], ID_A)
    args = kv_args()
    args.state_types.append(StateType.BLOCK_SCALE)
    with pytest.raises(EngramConfigError, match="transfers BLOCK_SCALE state itself"):
        pd.add_state_components(args, pool, SimpleNamespace(size=5), "prefill", "mooncake")


def test_a_model_without_engram_state_adds_nothing():
    args = kv_args()
    pd.add_state_components(args, SimpleNamespace(page_size=1), SimpleNamespace(size=5), "prefill", "nixl")
    assert args.state_types == []
