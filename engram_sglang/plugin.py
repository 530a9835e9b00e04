"""SGLang plugin entry point (group `sglang.srt.plugins`, name `engram`).

SGLang calls `load()` in every one of its processes (main, scheduler, detokenizer) before
it parses arguments. It must stay cheap and side-effect free at import: SGLang swallows
exceptions raised here, so configuration errors are raised where the model and its
tables are built, never here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_loaded = False


def load() -> None:
    """Install engram-sglang's hooks into this SGLang process (idempotent).

    Registering the Engram model family and taking over DeepSeek-V4.1's table lookup
    land with the SGLang integration; until then loading only announces the plugin.
    """
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import __version__

    logger.info("engram-sglang %s plugin loaded", __version__)
