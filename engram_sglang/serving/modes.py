"""Engram modes: which tokens of a request use Engram (ablation, docs/engram.md §8).

A mode is decided per token by its absolute position in the sequence against the request's
prompt length, never by the kind of batch it runs in, so a retracted request that prefills
its generated tokens again keeps its mode. Every mode switches Engram on for one interval of
positions [lo, hi):

    on        [0, inf)          every token (the default)
    off       []                no token
    prefill   [0, prompt)       prompt positions
    decode    [prompt, inf)     generated positions
    window    [from, until)     absolute positions (teacher-forced answer spans), until optional

A token outside the interval reads no rows, adds nothing to the residual stream, and its
short-conv input is zero for the tokens after it: exactly the reference forward with Engram
off for that token (`models/reference.py`).

Where a mode comes from: per request `sampling_params.custom_params["engram"]` (only with
`--engram-ablation on`), else the server's `--engram-mode`. The tokenizer manager checks it
(`check_request`: a ValueError there is SGLang's HTTP 400) and keys the request's cached
prefixes by it (`prefix_key`); the scheduler records each batch's intervals per request slot
before the batch runs (`record_batch`); the model asks for the step's per-token mask
(`token_mask`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

MODES = ("on", "off", "prefill", "decode")
WINDOW = "window"
PARAM = "engram"  # the key in sampling_params.custom_params
END = 1 << 62  # "to the end of the sequence"


class ModeError(ValueError):
    """A bad or unallowed Engram mode in a request (SGLang answers a ValueError with HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str  # one of MODES or "window"
    start: int = 0  # window only
    until: Optional[int] = None  # window only; None: to the end

    def span(self, prompt_len: int) -> tuple[int, int]:
        """The positions [lo, hi) where Engram is on for a request with this prompt length."""
        if self.name == "on":
            return 0, END
        if self.name == "off":
            return 0, 0
        if self.name == "prefill":
            return 0, prompt_len
        if self.name == "decode":
            return prompt_len, END
        return self.start, END if self.until is None else self.until

    def key(self, prompt_len: int) -> Optional[str]:
        """What the prefix cache keys this request's prefixes by (None: on, shared with every
        request of a server without modes). A cached token's KV depends on which earlier
        positions used Engram: equal keys mean equal intervals. Prefill and decode depend on
        the prompt length, so it is part of their key."""
        if self.name == "on":
            return None
        if self.name in ("prefill", "decode"):
            return f"engram={self.name}:{prompt_len}"
        if self.name == WINDOW:
            return f"engram=window:{self.start}:{'' if self.until is None else self.until}"
        return "engram=off"

    def describe(self) -> Any:
        if self.name != WINDOW:
            return self.name
        out = {"mode": WINDOW, "from": self.start}
        if self.until is not None:
            out["until"] = self.until
        return out


ON = Mode("on")


ECHO_CHARS = 64  # how much of a request's value an error line echoes


def echo(value: Any) -> str:
    """A request value for an error line: its repr, cut to ECHO_CHARS characters so a 1 MiB
    value does not become a 1 MiB error body and log line."""
    text = repr(value)
    if len(text) <= ECHO_CHARS:
        return text
    return f"{text[:ECHO_CHARS]}... ({len(text)} bytes)"


def parse_mode(value: Any) -> Mode:
    """A request's `custom_params["engram"]`: "on" | "off" | "prefill" | "decode" or
    {"mode": "window", "from": INT, "until": INT (optional)}. Raises ModeError (one line)."""
    where = f'sampling_params.custom_params["{PARAM}"]'
    shape = (f'one of {", ".join(MODES)} or {{"mode": "window", "from": INT, "until": INT}} '
             f"(token positions, until optional)")
    if isinstance(value, str):
        if value in MODES:
            return Mode(value)
        raise ModeError(f"{where} must be {shape}, got {echo(value)}")
    if not isinstance(value, dict):
        raise ModeError(f"{where} must be {shape}, got {echo(value)}")
    unknown = sorted(set(value) - {"mode", "from", "until"})
    if value.get("mode") != WINDOW or unknown:
        raise ModeError(f"{where} must be {shape}, got {echo(value)}")
    bounds = {}
    for name in ("from", "until"):
        v = value.get(name)
        if v is None and name == "until":
            bounds[name] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= END:
            raise ModeError(f'{where}["{name}"] must be an integer >= 0 (at most 2**62), got {echo(v)}')
        bounds[name] = v
    if bounds["until"] is not None and bounds["until"] < bounds["from"]:
        raise ModeError(f'{where}: "until" ({bounds["until"]}) must not be below "from" ({bounds["from"]})')
    return Mode(WINDOW, bounds["from"], bounds["until"])


def request_mode(custom_params: Any, default: Mode = ON, *, allowed: bool = True) -> Mode:
    """The mode of a request with these custom_params on a server whose mode is `default`;
    `allowed`: whether the server takes per-request modes (--engram-ablation on)."""
    if not isinstance(custom_params, dict) or custom_params.get(PARAM) is None:
        return default
    if not allowed:
        raise ModeError(f'sampling_params.custom_params["{PARAM}"] needs a server started with '
                        f"--engram-ablation on (ENGRAM_ABLATION=1)")
    return parse_mode(custom_params[PARAM])


def server_mode(settings) -> Mode:
    return Mode(settings.mode)


def modes_in_use(settings) -> bool:
    """Whether any token of this server may run with Engram off."""
    return bool(settings.ablation) or settings.mode != "on"


# ------------------------------------------------------------ tokenizer manager
def check_params(params: Any, settings, session_params: Any = None) -> Mode:
    """A request's `custom_params` on this server: its mode, or ModeError (one line)."""
    if settings.ablation and params is not None and not isinstance(params, dict):
        # Silently ignored, it would serve the server's mode to a request that asked for another.
        raise ModeError(f"sampling_params.custom_params must be a JSON object such as "
                        f'{{"{PARAM}": "off"}}, got {echo(params)}')
    mode = request_mode(params, server_mode(settings), allowed=settings.ablation)
    if mode != ON and session_params:
        # A session's next turn reuses the last turn's KV (computed in that turn's mode) and
        # its prompt is all turns: neither the key nor the interval would be this request's.
        raise ModeError(f'sampling_params.custom_params["{PARAM}"] cannot be combined with session_params')
    return mode


def check_request(tokenized, settings) -> None:
    """Check a tokenized generate request's mode (ModeError: HTTP 400) and key its cached
    prefixes by it: the mode's key goes in front of the request's `extra_key`, which scopes
    SGLang's radix cache (SGLang appends a LoRA id at its end)."""
    params = getattr(getattr(tokenized, "sampling_params", None), "custom_params", None)
    mode = check_params(params, settings, getattr(tokenized, "session_params", None))
    ids = tokenized.input_ids if tokenized.input_ids is not None else (tokenized.input_embeds or ())
    key = mode.key(len(ids))
    if key is None and modes_in_use(settings):
        key = "engram=on"  # the key always begins with the mode: a user's extra_key cannot pose as another
    if key is not None:
        tokenized.extra_key = key + "|" + (tokenized.extra_key or "")


# ------------------------------------------------------------------- scheduler
class SlotModes:
    """Per request slot (req_pool_idx): the interval of positions where Engram is on, for
    the requests of the batch about to run. Written by the scheduler's thread before it runs
    a batch, read by that batch's forward in the same process (the forward runs inside
    `run_batch`; a step's tokens name only its batch's slots)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: dict[int, tuple[int, int]] = {}
        self._batch_all_on = True

    def record(self, spans: dict[int, tuple[int, int]]) -> None:
        """The intervals of the batch about to run, per slot (replacing the last batch's)."""
        with self._lock:
            self._spans = dict(spans)
            self._batch_all_on = all(span == (0, END) for span in spans.values())

    def token_mask(self, token_req, positions):
        """bool [T]: whether each token of the step uses Engram (token_req: its request slot,
        -1 for graph padding; positions: its absolute position); None when every token of
        the batch does."""
        import torch

        with self._lock:
            if self._batch_all_on or token_req.numel() == 0:
                return None
            spans = self._spans
        slots = torch.tensor(list(spans), dtype=torch.int64)
        table = torch.tensor([[0, END]], dtype=torch.int64).repeat(int(slots.max()) + 1, 1)
        table[slots] = torch.tensor(list(spans.values()), dtype=torch.int64)
        table = table.to(token_req.device, non_blocking=True)
        req = token_req.to(torch.int64).clamp(0, table.shape[0] - 1)
        pos = positions.to(torch.int64)
        return (pos >= table[req, 0]) & (pos < table[req, 1])


SLOTS = SlotModes()


def request_span(req, default: Mode, allowed: bool) -> tuple[int, int]:
    """The interval of one scheduler Req (its custom_params were checked at the tokenizer
    manager; the prompt length is that of its original input)."""
    params = getattr(req.sampling_params, "custom_params", None)
    return request_mode(params, default, allowed=allowed).span(len(req.origin_input_ids))


def request_slot(req) -> Optional[int]:
    """A scheduler Req's request slot (req_pool_idx; SGLang 0.5.23 keeps it in `req.kv`)."""
    kv = getattr(req, "kv", None)
    return getattr(kv, "req_pool_idx", None) if kv is not None else getattr(req, "req_pool_idx", None)


def record_batch(batch, settings, slots: SlotModes = SLOTS) -> None:
    """Before the scheduler runs `batch`: record each request's interval by its slot."""
    if batch is None or not modes_in_use(settings):
        return
    default = server_mode(settings)
    spans = {}
    for req in getattr(batch, "reqs", None) or ():
        slot = request_slot(req)
        if slot is not None:
            spans[int(slot)] = request_span(req, default, settings.ablation)
    slots.record(spans)


def mask_for(mode: Mode, prompt_len: int, length: int) -> list[bool]:
    """Per position 0..length-1 of one sequence: whether it uses Engram (for the reference)."""
    lo, hi = mode.span(prompt_len)
    return [lo <= p < hi for p in range(length)]



# ------------------------------------------------------------------- settings
def server_settings():
    """The server's settings, as the hooks read them (plugin/scheduler.py, plugin/tokenizer_manager.py)."""
    from .settings import ServeSettings

    return ServeSettings.from_env()
