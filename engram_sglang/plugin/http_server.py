"""sglang.srt.entrypoints.http_server: a streamed `/generate` request checked before its stream
starts, so a bad Engram mode or token id is HTTP 400 there too (serving/request_check.py
`check_before_stream`). SGLang runs every check of a streamed request, its own too, inside
the StreamingResponse, after the 200 has gone out: they arrive as an error event."""

from __future__ import annotations

import functools
import logging
import sys

from .targets import Target

MODULE = "sglang.srt.entrypoints.http_server"
_settings = []  # read once, on the first streamed request (the flags are exported by then)


def serve_generate_request(original):
    @functools.wraps(original)
    async def serve(obj, request, *args, **kwargs):
        if getattr(obj, "stream", False):
            from ..serving import modes
            from ..serving.request_check import check_before_stream, model_vocab_size

            http = sys.modules[MODULE]
            if not _settings:
                _settings.append(modes.server_settings())
            state = getattr(http, "_global_state", None)
            try:
                check_before_stream(obj, _settings[0], model_vocab_size(getattr(state, "tokenizer_manager", None)))
            except ValueError as e:
                logging.getLogger(MODULE).error(f"[http_server] Error: {e}")
                return http._create_error_response(e)  # what an unstreamed request's ValueError gets
        return await original(obj, request, *args, **kwargs)

    return serve


def used_as_is(attribute) -> None:
    """Declared so that an SGLang without it stops at import, not at a bad request."""


TARGETS = (Target(MODULE, "serve_generate_request", "replace", serve_generate_request),
           Target(MODULE, "_create_error_response", "extend", used_as_is, says="answers a refused stream with"))
