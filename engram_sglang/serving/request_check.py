"""Token ids checked where a request enters: the tokenizer manager (plugin/tokenizer_manager.py).

SGLang does not range-check a request's `input_ids`. An id the model cannot embed (or our
hasher cannot hash) would raise inside the scheduler's forward and take the whole server
down with it, whatever the placement or mode. So every tokenized request is checked against
the model's vocabulary before it leaves the tokenizer manager: a ValueError there is SGLang's
HTTP 400 for that request alone. The check does not depend on Engram modes being in use.

An id that reaches the forward anyway (a path that skips the tokenizer manager, or an id the
model embeds but the tokenizer's compressed vocabulary does not hold) fails only its request,
as a failed table read does (`EngramRuntime.refuse_unknown_tokens`, serving/faults.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from .modes import echo


class TokenIdError(ValueError):
    """A request's token id outside the model's vocabulary (SGLang answers a ValueError with HTTP 400)."""


def model_vocab_size(tokenizer_manager) -> Optional[int]:
    """The vocabulary the model embeds (`TokenizerManager.model_config.vocab_size`; SGLang's
    own token_ids_logprob check reads the same); None where it has none."""
    size = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def check_token_ids(tokenized: Any, vocab_size: Optional[int]) -> None:
    """Raise TokenIdError (one line) if a tokenized request holds an id outside [0, vocab_size).

    One min and one max over the request's ids (an `array("q")` or a list): no torch. Requests
    without ids (input_embeds) pass; so do multimodal ones, whose ids the multimodal processor
    made and may carry placeholder values the model maps itself."""
    ids = getattr(tokenized, "input_ids", None)
    if vocab_size is None or not ids or getattr(tokenized, "mm_inputs", None) is not None:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise TokenIdError(f"input_ids: token id {echo(bad)} is outside the model's vocabulary of {vocab_size} tokens "
                           f"(valid ids are 0..{vocab_size - 1})")


def check_before_stream(obj, settings, vocab_size: Optional[int]) -> None:
    """A streamed /generate request (SGLang's GenerateReqInput, not yet normalized) before
    SGLang answers 200 (plugin/http_server.py): each element's Engram mode and its token ids
    as given, with the lines the tokenizer manager would raise (ValueError: HTTP 400)."""
    from . import modes

    params, ids = obj.sampling_params, obj.input_ids
    id_lists = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    param_list = params if isinstance(params, list) else None
    batch = param_list is not None or len(id_lists) > 1 or isinstance(getattr(obj, "text", None), list)
    n = max(len(param_list or ()), len(id_lists), len(obj.text) if isinstance(getattr(obj, "text", None), list) else 1)
    multimodal = bool(getattr(obj, "contains_mm_input", lambda: False)())
    for i in range(n):
        p = param_list[i] if param_list is not None and i < len(param_list) else params
        element_ids = id_lists[i] if i < len(id_lists) else None
        try:
            custom = p.get("custom_params") if isinstance(p, dict) else None
            modes.check_params(custom, settings, getattr(obj, "session_params", None))
            if not multimodal and isinstance(element_ids, list) and all(type(t) is int for t in element_ids):
                check_token_ids(SimpleNamespace(input_ids=element_ids), vocab_size)
        except ValueError as e:
            if not batch:
                raise
            raise type(e)(f"batch[{i}] of {n}: {e}") from None
