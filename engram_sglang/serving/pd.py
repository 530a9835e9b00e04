"""PD disaggregation: the Engram state that travels with SGLang's own KV transfer.

A prefill server computes a prompt's KV and a decode server continues it (SGLang's
`--disaggregation-mode prefill|decode`). For the Qwen3 family the short conv reads the
conv inputs of the 12 tokens before each token, kept per KV slot beside SGLang's KV pool
(models/qwen3_engram.py): a transfer that moves only the KV leaves the decode server's conv
inputs of every prompt position zero, and its first windows wrong. So each side registers
two state components with SGLang's transfer (`setup_state_kv_args`, plugin hooks
disaggregation_prefill.py, disaggregation_decode.py), and SGLang computes their index
payloads on both sides as for its own state:

* the conv inputs of every Engram layer, page-indexed like the KV (one item per KV page,
  the whole sequence's pages: SGLang's `BLOCK_SCALE` payload, which no Engram model's KV
  pool uses otherwise);
* this side's Engram identity, one row per request slot (SGLang's `REQUEST_ROW` payload):
  the tables' content identity and the settings that change outputs (mode, ablation). A
  prefill server fills every row with its own; the decode server checks the rows that
  arrived when SGLang hands it the transferred requests (its prebuilt batch, before their
  first decode step, eager or replayed) and finishes a request whose rows differ with HTTP
  400 and one line (`refuse_mismatched_transfers`); the server goes on.

Carried by the Mooncake backend (`mooncake`, `mooncake_tcp`: its page-indexed generic state
path; tested here over TCP). NIXL, Mori and Ascend are untested and refused in one line, as is
`fake`, which moves nothing.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..core.errors import EngramConfigError

logger = logging.getLogger(__name__)

CARRIERS = ("mooncake", "mooncake_tcp")  # --disaggregation-transfer-backend values (tcp: Mooncake over TCP)
CONV_STATE = "BLOCK_SCALE"  # SGLang StateType whose payload is the whole sequence's KV pages
IDENTITY_STATE = "REQUEST_ROW"  # SGLang StateType whose payload is the request slot
IDENTITY_BYTES = 64
SKIP_DEBUG = "skip-conv-transfer"  # --engram-debug: decode receives the conv state into scratch


@dataclass
class PdState:
    """One model's per-KV-slot Engram state (per process: one model runner)."""

    conv: list[torch.Tensor]  # per Engram layer [slots, D]
    layer_ids: list[int]
    page_size: int
    identity: bytes
    debug: tuple[str, ...] = ()
    role: Optional[str] = None  # "prefill" or "decode" once registered with a transfer
    rows: Optional[torch.Tensor] = None  # uint8 [request slots, IDENTITY_BYTES]
    scratch: list[torch.Tensor] = field(default_factory=list)


_STATES: dict[int, PdState] = {}  # id(KV pool) -> its Engram state


def identity_line(tables: str, mode: str, ablation: bool) -> bytes:
    """What both sides must agree on, as at most IDENTITY_BYTES of ASCII (NUL-padded); `tables`:
    the tables' content identity (serving/identity.py `serving_identity`)."""
    line = f"tables {tables} mode {mode} ablation {'on' if ablation else 'off'}".encode()
    if len(line) > IDENTITY_BYTES:
        raise EngramConfigError(f"Engram identity line is {len(line)} bytes, more than {IDENTITY_BYTES}")
    return line.ljust(IDENTITY_BYTES, b"\0")


def register(kv_pool, conv: Sequence[torch.Tensor], layer_ids: Sequence[int], identity: bytes,
             debug: Sequence[str] = ()) -> None:
    """The model's per-KV-slot state beside `kv_pool` (called once the pool exists)."""
    _STATES[id(kv_pool)] = PdState(list(conv), list(layer_ids), int(kv_pool.page_size), identity, tuple(debug))


def active() -> Optional[PdState]:
    """This process's state once registered with a PD transfer, else None."""
    return next((s for s in _STATES.values() if s.role is not None), None)


def with_engram_state(setup_state_kv_args):
    """SGLang's `setup_state_kv_args`, then the Engram components of this server's side (its
    `--disaggregation-mode`): the plugin's replacement of it in SGLang's prefill and decode
    modules (plugin/disaggregation_prefill.py, plugin/disaggregation_decode.py)."""

    @functools.wraps(setup_state_kv_args)
    def setup(kv_args, token_to_kv_pool, *args, **kwargs):
        from sglang.srt.runtime_context import get_disagg

        setup_state_kv_args(kv_args, token_to_kv_pool, *args, **kwargs)
        disagg = get_disagg()
        add_state_components(kv_args, token_to_kv_pool, kwargs.get("req_to_token_pool"),
                             str(disagg.disaggregation_mode), str(disagg.disaggregation_transfer_backend))

    return setup


def add_state_components(kv_args, kv_pool, req_to_token_pool, role: str, backend: str) -> None:
    """Append the conv inputs and the identity rows to SGLang's `kv_args` (after SGLang's own
    components, in the same order on both sides)."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    state = _STATES.get(id(kv_pool))
    if state is None:
        return  # a model without per-KV-slot Engram state
    if backend not in CARRIERS:
        raise EngramConfigError(f"--disaggregation-transfer-backend {backend}: the Engram conv state travels "
                                f"with {' or '.join(CARRIERS)} only (NIXL, Mori, Ascend untested; fake moves nothing)")
    conv_type, identity_type = StateType[CONV_STATE], StateType[IDENTITY_STATE]
    taken = [t.name for t in kv_args.state_types if t in (conv_type, identity_type)]
    if taken:
        raise EngramConfigError(f"the KV pool {type(kv_pool).__name__} transfers {', '.join(taken)} state itself: "
                                "the Engram conv state has no component to travel in")
    if req_to_token_pool is None:
        raise EngramConfigError("SGLang's PD transfer set-up gave no request pool: no identity rows to transfer")
    conv = state.conv
    if role == "decode" and SKIP_DEBUG in state.debug:
        # Negative control: what arrives goes to scratch, the conv inputs stay as they were.
        logger.warning("engram-sglang DEBUG %s: the conv state arrives in scratch, not in the conv cache", SKIP_DEBUG)
        state.scratch = [torch.zeros_like(t) for t in conv]
        conv = state.scratch
    if not all(t.is_contiguous() for t in conv):
        raise EngramConfigError("the Engram conv cache is not contiguous: it cannot be transferred by KV page")
    item = [state.page_size * t.shape[1] * t.element_size() for t in conv]
    append_state_component(kv_args, conv_type, [t.data_ptr() for t in conv], [t.nbytes for t in conv], item,
                           layer_ids=state.layer_ids)
    state.rows = torch.zeros(int(req_to_token_pool.size) + 1, IDENTITY_BYTES, dtype=torch.uint8)
    if role == "prefill":
        state.rows[:] = torch.frombuffer(bytearray(state.identity), dtype=torch.uint8)
    append_state_component(kv_args, identity_type, [state.rows.data_ptr()], [state.rows.nbytes], [IDENTITY_BYTES],
                           layer_ids=state.layer_ids[:1])
    state.role = role
    logger.info("engram PD (%s): conv state of %d Engram layers (%d B per KV page) and the Engram identity travel "
                "with the %s transfer; identity: %s", role, len(conv), sum(item), backend,
                state.identity.rstrip(b"\0").decode())


def check_transferred(slots: Sequence[int]) -> dict[int, str]:
    """On a decode server: request slot -> why its transfer is refused, for newly transferred
    requests (SGLang's prebuilt batch) whose identity row (what the prefill server sent)
    differs from this server's. Read on the scheduler, before the request's first decode step
    (eager or a CUDA-graph replay), from host memory: no device sync. Each row is cleared once
    read, so a slot reused by a request whose transfer carried no identity never passes on its
    predecessor's."""
    state = active()
    if state is None or state.role != "decode" or state.rows is None or not len(slots):
        return {}
    index = torch.tensor(list(slots), dtype=torch.long)
    ours = torch.frombuffer(bytearray(state.identity), dtype=torch.uint8)
    got = state.rows[index].clone()
    state.rows[index] = 0
    out = {}
    for slot, row in zip(index.tolist(), got):
        if torch.equal(row, ours):
            continue
        theirs = bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") or "none: not transferred"
        out[slot] = (f"the prefill server's Engram identity ({theirs}) differs from this decode server's "
                     f"({state.identity.rstrip(bytes(1)).decode()}): its transfer is refused")
    return out


def refuse_mismatched_transfers(scheduler, batch) -> int:
    """Finish (HTTP 400, one line) the newly transferred requests of a decode server's prebuilt
    batch whose prefill server has other tables or settings; returns how many. Runs where SGLang
    verifies the transferred KV's checksums, before `process_prebuilt` and before any forward:
    the finish takes effect as the batch's first result is processed (its KV released as for
    any finished request); the rest of the batch and the server go on."""
    state = active()
    if state is None or state.role != "decode" or batch is None or not batch.reqs:
        return 0
    from http import HTTPStatus

    from sglang.srt.disaggregation.checksum import is_health_check_req
    from sglang.srt.disaggregation.utils import all_reduce_flags
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from .modes import request_slot

    reqs = [r for r in batch.reqs if not is_health_check_req(r)]  # a health probe transfers nothing
    refused = check_transferred([request_slot(r) for r in reqs])
    flags = [1 if request_slot(r) in refused else 0 for r in reqs]
    # The TP ranks agree on the set, as SGLang's checksum check does, or they run different batches.
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    if group is not None and torch.distributed.is_initialized():
        flags = all_reduce_flags(flags, group, torch.distributed.ReduceOp.MAX)
    if not any(flags):
        return 0
    other = "the prefill server's Engram identity differs from this decode server's (on another rank)"
    for req, flag in zip(reqs, flags):
        if flag:
            why = refused.get(request_slot(req), other)
            req.to_finish = FINISH_ABORT(why, HTTPStatus.BAD_REQUEST, "EngramIdentityMismatch")
    logger.error("engram-sglang: %s; refusing %d request(s)", next(iter(refused.values()), other), sum(flags))
    return sum(flags)
