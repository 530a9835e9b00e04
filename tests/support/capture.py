"""A CPU stand-in for a CUDA-graph capture: `capture(*objects)`.

Inside `with capture(store) as cap:` the body runs as a captured region would have to:

* every tensor it computes on is a fake one (torch's FakeTensorMode): shapes, dtypes and
  devices without values, so any data-dependent host read raises `HostSync`: `.item()`,
  `int()`/`float()`/`bool()` of a tensor (an `if` on one), `.tolist()`, boolean-mask
  indexing, `nonzero`, `unique`, `masked_select`, `repeat_interleave`, `torch.equal`, and a
  blocking device-to-host copy (`.cpu()` of a CUDA tensor; the fakes can claim a CUDA device
  on a machine without one);
* the tensors the watched objects hold (walked through their attributes, lists and dicts)
  are swapped for fakes of the same shape for the duration and put back afterwards: the
  real tensors are never written, and one that the body rebinds is reported;
* `engram_sglang.core.stores.maintenance.capturing()` and `torch.cuda.is_current_stream_capturing()`
  say True, so code that asks sees a capture;
* afterwards (`CaptureViolation`, an AssertionError): any Python attribute of the watched
  objects that changed (a replay runs no Python: such state would advance only for the
  capture, never for the replays), any tensor attribute rebound, and any engram_* Prometheus
  sample that moved.

Inputs must be fakes too: `cap.fake(real_tensor)` (same values are not kept, only shape,
dtype and device), or any tensor created inside the block. A real tensor that reaches an op
raises (FakeTensorMode refuses non-fake inputs), so nothing is silently run for real.

It shows what a capture would refuse and what a replay would skip, not that a real CUDA
capture succeeds (bench/gpu_check.py does that on a GPU).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import numpy as np
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSync(RuntimeError):
    """A data-dependent read of a device value on the host inside the (simulated) capture."""


class CaptureViolation(AssertionError):
    """Python state that the captured call changed (a replay would not), or a rebound tensor."""


# ------------------------------------------------------------------ host syncs
class _RefuseHostSyncs(TorchDispatchMode):
    """Above FakeTensorMode: names the op that needs a device value on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._to_copy.default, aten.copy_.default):
            _check_copy(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException as e:
            raise HostSync(f"{func}: reads a device value on the host (.item(), int(), bool(), .tolist(), "
                           f"torch.equal) inside a capture") from e
        except DynamicOutputShapeException as e:
            raise HostSync(f"{func}: its output shape depends on the values (boolean mask, nonzero, unique, "
                           f"masked_select, repeat_interleave): the host must wait for the device") from e


def _check_copy(func, args, kwargs) -> None:
    if func is aten._to_copy.default:
        src, dst_device = args[0], kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
    else:
        dst, src = args[0], args[1]
        dst_device = dst.device
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if dst_device is not None and torch.device(dst_device).type == "cpu" and src.device.type == "cuda" and blocking:
        raise HostSync(f"{func}: a blocking device-to-host copy ({src.device} -> cpu) inside a capture")


# ------------------------------------------------------------------ python state
_ATOMS = (int, float, complex, str, bytes, bool, type(None), torch.device, torch.dtype)


def _walkable(value: Any, top: bool = False) -> bool:
    """The watched objects themselves, and the project's objects they reach."""
    module = type(value).__module__ or ""
    return hasattr(value, "__dict__") and (top or module.startswith("engram_sglang"))


def _walk(value: Any, path: str, state: dict, slots: list, seen: set, top: bool = False) -> None:
    """Record a comparable key for every reachable attribute, and where tensors sit."""
    if isinstance(value, torch.Tensor):
        state[path] = ("tensor", id(value))
        return
    if isinstance(value, _ATOMS):
        state[path] = value
        return
    if isinstance(value, np.ndarray):
        state[path] = ("ndarray", id(value), value.shape, value.tobytes() if value.nbytes <= 4096 else None)
        return
    if id(value) in seen:
        state[path] = ("seen", id(value))
        return
    if isinstance(value, (list, tuple, set, frozenset, dict)) or _walkable(value, top):
        seen.add(id(value))
    if isinstance(value, dict):
        state[path] = ("dict", len(value))
        for k, v in value.items():
            if isinstance(v, torch.Tensor):
                slots.append((value, k))
            _walk(v, f"{path}[{k!r}]", state, slots, seen)
    elif isinstance(value, list):
        state[path] = ("list", len(value))
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                slots.append((value, i))
            _walk(v, f"{path}[{i}]", state, slots, seen)
    elif isinstance(value, (tuple, set, frozenset)):
        state[path] = (type(value).__name__, len(value))
        for i, v in enumerate(sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value):
            _walk(v, f"{path}[{i}]", state, slots, seen)
    elif _walkable(value, top):
        state[path] = ("object", type(value).__name__, id(value))
        for k, v in vars(value).items():
            if isinstance(v, torch.Tensor):
                slots.append((value, k))
            _walk(v, f"{path}.{k}", state, slots, seen)
    else:  # locks, executors, mmaps, functions: identity only
        state[path] = ("other", type(value).__name__, id(value))


def _snapshot(objects) -> tuple[dict, list]:
    state, slots, seen = {}, [], set()
    for i, obj in enumerate(objects):
        _walk(obj, f"<{type(obj).__name__} #{i}>", state, slots, seen, top=True)
    return state, slots


def _get(holder, key):
    return holder[key] if isinstance(holder, (dict, list)) else getattr(holder, key)


def _set(holder, key, value) -> None:
    if isinstance(holder, (dict, list)):
        holder[key] = value
    else:
        object.__setattr__(holder, key, value)


def _engram_samples() -> dict:
    from prometheus_client import REGISTRY

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in REGISTRY.collect() if metric.name.startswith("engram")
            for s in metric.samples}


def _diff(before: dict, after: dict, limit: int = 8) -> list[str]:
    out = []
    for k in sorted(set(before) | set(after)):
        if before.get(k, "<absent>") != after.get(k, "<absent>"):
            out.append(f"{k}: {before.get(k, '<absent>')!r} -> {after.get(k, '<absent>')!r}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


# ------------------------------------------------------------------ the context
class Capture:
    def __init__(self, mode: FakeTensorMode):
        self.mode = mode

    def fake(self, tensor: torch.Tensor, device=None) -> torch.Tensor:
        """A fake input like `tensor` (optionally claiming another device, e.g. "cuda")."""
        with self.mode:
            if device is None:
                return self.mode.from_tensor(tensor)
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


@contextlib.contextmanager
def capture(*objects, metrics: bool = True) -> Iterator[Capture]:
    """Run the body as a captured CUDA-graph region would (see the module docstring);
    `objects`: what the body must leave as it found it (stores, caches, runtimes)."""
    import torch.cuda as torch_cuda

    from engram_sglang.core.stores import maintenance

    state, slots = _snapshot(objects)
    samples = _engram_samples() if metrics else {}
    mode = FakeTensorMode()
    real = [(holder, key, _get(holder, key)) for holder, key in slots]
    fakes = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(maintenance, "capturing", lambda: True))
        stack.enter_context(_patched(torch_cuda, "is_current_stream_capturing", lambda: True))
        for holder, key, tensor in real:
            fake = mode.from_tensor(tensor)
            _set(holder, key, fake)
            fakes.append(fake)
        # The op's alignment check reads a fake's data pointer (0): expected here.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        try:
            with mode, _RefuseHostSyncs():
                yield Capture(mode)
        finally:
            rebound = [f"{type(h).__name__}.{k}" if not isinstance(h, (dict, list)) else f"[{k!r}]"
                       for (h, k, _), fake in zip(real, fakes) if _get(h, k) is not fake]
            for holder, key, tensor in real:
                _set(holder, key, tensor)
    if rebound:
        raise CaptureViolation(f"the captured call rebound tensor attribute(s) {rebound}: a replay would keep "
                               "writing the old tensor")
    changed = _diff(state, _snapshot(objects)[0])
    if changed:
        raise CaptureViolation("the captured call changed Python state (a replay runs no Python, so it would "
                               "advance for the capture only): " + "; ".join(changed))
    if metrics:
        moved = _diff(samples, _engram_samples())
        if moved:
            raise CaptureViolation("the captured call moved Prometheus metrics (a replay would not): "
                                   + "; ".join(moved))


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
