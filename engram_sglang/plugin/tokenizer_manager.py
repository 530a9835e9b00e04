"""sglang.srt.managers.tokenizer_manager: a request's token ids range-checked against the model's
vocabulary (serving/request_check.py) and its Engram mode checked, where SGLang checks its
sampling params (a ValueError there is HTTP 400), and the mode made part of its prefix-cache key
(serving/modes.py). A batch's error line names its bad element (`handle_batch_request`)."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.managers.tokenizer_manager"
_settings = []  # read once, on the first request (the flags are exported by then)


def create_tokenized_object(original, self, *args, **kwargs):
    tokenized = original(self, *args, **kwargs)
    from ..serving.request_check import check_token_ids, model_vocab_size

    try:
        # Every request, any placement, modes or not: SGLang does not range-check input_ids.
        check_token_ids(tokenized, model_vocab_size(self))
        if hasattr(tokenized, "extra_key") and hasattr(tokenized, "sampling_params"):
            from ..serving import modes

            if not _settings:
                _settings.append(modes.server_settings())
            modes.check_request(tokenized, _settings[0])
    except ValueError as e:
        e.engram_request = args[0] if args else kwargs.get("obj")  # a batch's wrapper names its index
        raise
    return tokenized


async def handle_batch_request(original, self, obj, *args, **kwargs):
    """A batch (a list of prompts or of input_ids lists) fails whole at its first bad element,
    as SGLang's own checks do; our line names that element: "batch[3] of 8: input_ids: ..."."""
    responses = original(self, obj, *args, **kwargs)
    try:
        async for response in responses:
            yield response
    except ValueError as e:
        where = batch_element(obj, getattr(e, "engram_request", None))
        if where is None:
            raise
        raise type(e)(f"{where}: {e}") from None
    finally:
        await responses.aclose()  # a client gone mid-batch: SGLang's own clean-up runs now


def batch_element(batch, element) -> str | None:
    """The "batch[i] of N" for the element of `batch` that `element` is (SGLang caches each
    `batch[i]` in `_sub_obj_cache`, so its tokenizer sees those very objects); None if none."""
    if element is None:
        return None
    cache = getattr(batch, "__dict__", {}).get("_sub_obj_cache") or {}
    for i, sub in cache.items():
        if sub is element:
            return f"batch[{i}] of {getattr(batch, 'batch_size', len(cache))}"
    return None


TARGETS = (Target(MODULE, "TokenizerManager._create_tokenized_object", "wrap", create_tokenized_object),
           Target(MODULE, "TokenizerManager._handle_batch_request", "wrap", handle_batch_request))
