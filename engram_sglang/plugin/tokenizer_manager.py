"""sglang.srt.managers.tokenizer_manager: a request's Engram mode checked where SGLang checks
its sampling params (a ValueError there is HTTP 400) and made part of its prefix-cache key
(serving/modes.py)."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.managers.tokenizer_manager"
_settings = []  # read once, on the first request (the flags are exported by then)


def create_tokenized_object(original, self, *args, **kwargs):
    tokenized = original(self, *args, **kwargs)
    if hasattr(tokenized, "extra_key") and hasattr(tokenized, "sampling_params"):
        from ..serving import modes

        if not _settings:
            _settings.append(modes.server_settings())
        modes.check_request(tokenized, _settings[0])
    return tokenized


TARGETS = (Target(MODULE, "TokenizerManager._create_tokenized_object", "wrap", create_tokenized_object),)
