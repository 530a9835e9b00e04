"""What `ablate` and `scan` read: text files cut into documents, and prompt/answer pairs.

A file is tokenized whole with the model's tokenizer (no special tokens) and cut into
consecutive documents of `chunk_tokens` tokens; a last piece shorter than MIN_DOC_TOKENS is
dropped (too short to say anything on its own). Every document is scored alone, so its
first token, which has no context, is never scored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...core.errors import EngramError

MIN_DOC_TOKENS = 32
MAX_CHUNK_TOKENS = 1 << 20


@dataclass(frozen=True)
class Pair:
    prompt: list[int]
    answer: list[int]


def read_text(path: str | os.PathLike, what: str = "text file") -> str:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise EngramError(f"{path}: no such {what}") from None
    except OSError as e:
        raise EngramError(f"{path}: cannot read the {what} ({e.strerror})") from None
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EngramError(f"{path}: not UTF-8 text (byte {e.start}); give a text file") from None


def check_chunk_tokens(chunk_tokens) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or not (
            MIN_DOC_TOKENS <= chunk_tokens <= MAX_CHUNK_TOKENS):
        raise EngramError(f"--chunk-tokens must be a whole number from {MIN_DOC_TOKENS} to {MAX_CHUNK_TOKENS}, "
                          f"got {chunk_tokens!r}")


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def documents(tokenizer, path: str | os.PathLike, chunk_tokens: int, max_docs: Optional[int] = None) -> list[list[int]]:
    """The file's tokens cut into documents of `chunk_tokens` (the last one kept when it has
    at least MIN_DOC_TOKENS), at most `max_docs` of them, from the start of the file."""
    check_chunk_tokens(chunk_tokens)
    ids = encode(tokenizer, read_text(path))
    docs = [ids[a:a + chunk_tokens] for a in range(0, len(ids), chunk_tokens)]
    docs = [d for d in docs if len(d) >= MIN_DOC_TOKENS][:max_docs]
    if not docs:
        raise EngramError(f"{path}: {len(ids)} tokens, fewer than the {MIN_DOC_TOKENS} a document needs")
    return docs


def parse_domain(text: str) -> tuple[str, Path]:
    """`NAME=FILE` of --domain."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise EngramError(f"--domain takes NAME=FILE, got {text!r}")
    return name.strip(), Path(path)


def load_pairs(path: str | os.PathLike, tokenizer) -> list[Pair]:
    """Prompt/answer pairs of a JSONL file (one object per line with string fields `prompt`
    and `answer`; blank lines skipped). Prompt and answer are tokenized apart and joined, so
    the answer span's token positions are exact."""
    pairs = []
    for n, line in enumerate(read_text(path, "pairs file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EngramError(f"{path}:{n}: not JSON ({e.msg}); each line is {{\"prompt\": ..., \"answer\": ...}}") from None
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in ("prompt", "answer")):
            raise EngramError(f"{path}:{n}: each line is an object with string fields prompt and answer, got "
                              f"{line.strip()[:80]!r}")
        prompt, answer = encode(tokenizer, obj["prompt"]), encode(tokenizer, obj["answer"])
        if not prompt or not answer:
            raise EngramError(f"{path}:{n}: the {'prompt' if not prompt else 'answer'} is empty (no tokens)")
        pairs.append(Pair(prompt, answer))
    if not pairs:
        raise EngramError(f"{path}: no prompt/answer pairs")
    return pairs
