"""sglang.srt.managers.tokenizer_manager: a request's token ids range-checked against the model's
vocabulary (serving/request_check.py) and its Engram mode checked, where SGLang checks its
sampling params (a ValueError there is HTTP 400), and the mode made part of its prefix-cache key
(serving/modes.py)."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.managers.tokenizer_manager"
_settings = []  # read once, on the first request (the flags are exported by then)


def create_tokenized_object(original, self, *args, **kwargs):
    tokenized = original(self, *args, **kwargs)
    from ..serving.request_check import check_token_ids, model_vocab_size

    # Every request, any placement, modes or not: SGLang does not range-check input_ids.
    check_token_ids(tokenized, model_vocab_size(self))
    if hasattr(tokenized, "extra_key") and hasattr(tokenized, "sampling_params"):
        from ..serving import modes

        if not _settings:
            _settings.append(modes.server_settings())
        modes.check_request(tokenized, _settings[0])
    return tokenized


TARGETS = (Target(MODULE, "TokenizerManager._create_tokenized_object", "wrap", create_tokenized_object),)
