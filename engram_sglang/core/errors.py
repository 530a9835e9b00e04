"""Errors a user can act on: each message is one line naming the file or field at fault."""


class EngramError(Exception):
    """Base of every error engram-sglang raises on bad input."""


class EngramConfigError(EngramError, ValueError):
    """An invalid or inconsistent Engram configuration."""


class TableFormatError(EngramError, ValueError):
    """A table directory, layer file or checkpoint that does not match what it claims."""


class TokenizerMismatchError(EngramConfigError):
    """The tokenizer normalizes to a different compressed vocabulary than the config says."""


class PatchTargetMissing(EngramError):
    """An SGLang attribute the plugin patches is not in the installed SGLang.

    SGLang's plugin loader logs and swallows every Exception a plugin raises, so the plugin
    turns this one into one line on stderr and SystemExit(2), which it does not catch."""
