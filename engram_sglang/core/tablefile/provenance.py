"""Where a table directory's rows came from: the checkpoint's identity, recorded in the
manifest (convert, or `tables verify --model DIR --record` for older tables) and checked at
start-up against the served model directory, so that tables of another checkpoint are not
served without a word.

    "provenance": {"checkpoint_sha256": 64 hex digits,
                   "hashed": "model.safetensors.index.json" | "safetensors headers",
                   "shards": [{"name": "model-00001-of-00002.safetensors", "bytes": N | null}, ...],
                   "revision": "the commit, where the directory says" | null}

The hash is of the index file's bytes (`sha256sum model.safetensors.index.json`), or, for a
checkpoint without one, of every shard's safetensors header (its 8-byte length and JSON:
tensor names, dtypes, shapes, offsets) end to end in name order (one shard: `head -c 8+N
model.safetensors | sha256sum`): a few KB read whatever the checkpoint's size. The key is
optional: manifests written before it still open.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Optional

from ..errors import EngramError, TableFormatError
from ..fileio import open_regular, pread_full, read_regular, tries_text
from .fileformat import MAX_MANIFEST_BYTES, _one_line, _plain_name, _short

INDEX = "model.safetensors.index.json"
HEADERS = "safetensors headers"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_MAX_HEADER = 100_000_000  # safetensors' own bound on a header
_MAX_REVISION = 200


def read_index(ckpt: Path) -> Optional[tuple[bytes, dict[str, str]]]:
    """(the index file's bytes, tensor name -> shard file name) of a checkpoint, or None
    without an index. Shards sit beside the index: a plain file name, never a path out."""
    index = ckpt / INDEX
    if not os.path.lexists(index):
        return None
    try:
        text = read_regular(index, MAX_MANIFEST_BYTES, TableFormatError, "checkpoint index")
    except FileNotFoundError:  # lexists: a symlink to nowhere
        raise TableFormatError(f"{index}: a symlink to a missing file ({os.path.realpath(index)})") from None
    try:  # (apart from the read: TableFormatError is a ValueError too)
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, not UTF-8, or an int of > 4300 digits
        raise TableFormatError(f"{index}: unreadable index ({type(e).__name__})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise TableFormatError(f"{index}: no weight_map object (tensor name -> shard file)")
    for name, shard in weight_map.items():
        if not _plain_name(shard):
            raise TableFormatError(f"{index}: tensor {_short(name)} maps to {_short(shard)}, not a shard file name")
    return text, weight_map


def _shard_header(shard: Path) -> bytes:
    """A safetensors file's header: its 8-byte little-endian length, then that many bytes."""
    try:
        fd = open_regular(shard, TableFormatError, "checkpoint shard")
    except FileNotFoundError:
        raise TableFormatError(f"{shard}: checkpoint shard missing") from None
    try:
        head = pread_full(fd, 8, 0)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < n <= _MAX_HEADER:
            raise TableFormatError(f"{shard}: not a safetensors file (header length {n})")
        body = pread_full(fd, n, 8)
    except OSError as e:
        raise TableFormatError(f"{shard}: cannot read the safetensors header ({e.strerror}, {tries_text(e)})") from None
    finally:
        os.close(fd)
    if len(body) != n:
        raise TableFormatError(f"{shard}: the safetensors header ends early ({len(body)} of {n} bytes)")
    return head + body


def checkpoint_hash(ckpt: str | os.PathLike) -> Optional[tuple[str, str, list[str]]]:
    """(sha256 hex, what was hashed, shard file names) of a checkpoint directory; None where
    it has neither an index nor a *.safetensors file (nothing to compare with)."""
    ckpt = Path(ckpt)
    index = read_index(ckpt)
    if index is not None:
        text, weight_map = index
        return hashlib.sha256(text).hexdigest(), INDEX, sorted(set(weight_map.values()))
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    if not shards:
        return None
    h = hashlib.sha256()
    for name in shards:
        h.update(_shard_header(ckpt / name))
    return h.hexdigest(), HEADERS, shards


def checkpoint_provenance(ckpt: str | os.PathLike) -> dict:
    """The manifest's provenance block for checkpoint directory `ckpt` (module docstring)."""
    ckpt = Path(ckpt)
    found = checkpoint_hash(ckpt)
    if found is None:
        raise TableFormatError(f"{ckpt}: no {INDEX} and no *.safetensors files: not a checkpoint directory")
    digest, hashed, names = found
    shards = []
    for name in names:
        try:
            size = os.stat(ckpt / name).st_size
        except OSError:  # a shard the index lists that was not downloaded: no Engram tensor in it
            size = None
        shards.append({"name": name, "bytes": size})
    return {"checkpoint_sha256": digest, "hashed": hashed, "shards": shards, "revision": revision(ckpt)}


def _small_text(path: Path) -> Optional[str]:
    try:
        return read_regular(path, 4096, EngramError, "file").decode("utf-8", "replace")
    except (FileNotFoundError, EngramError):
        return None


def revision(ckpt: Path) -> Optional[str]:
    """The checkpoint's commit where its directory says: a Hugging Face cache snapshot
    (`.../snapshots/COMMIT`), a `hf download --local-dir` copy (its `.cache/huggingface`
    metadata), a git clone's HEAD, or a "revision"/"_commit_hash" string in config.json."""
    real = Path(os.path.realpath(ckpt))
    if real.parent.name == "snapshots" and _COMMIT.fullmatch(real.name):
        return real.name
    meta = ckpt / ".cache" / "huggingface" / "download"
    for name in (INDEX, "config.json"):
        text = _small_text(meta / f"{name}.metadata")  # first line: the commit it was downloaded at
        if text and _COMMIT.fullmatch(text.split("\n", 1)[0].strip()):
            return text.split("\n", 1)[0].strip()
    head = (_small_text(ckpt / ".git" / "HEAD") or "").strip()
    if head.startswith("ref: "):
        ref = head[5:].strip()
        ok = ref.startswith("refs/") and ".." not in ref.split("/")
        head = (_small_text(ckpt / ".git" / ref) or "").strip() if ok else ""
        if ok and not head:  # a packed ref: "COMMIT REF" lines
            packed = _small_text(ckpt / ".git" / "packed-refs") or ""
            head = next((ln.split()[0] for ln in packed.splitlines() if ln.endswith(" " + ref)), "")
    if _COMMIT.fullmatch(head):
        return head
    text = _small_text(ckpt / "config.json")
    try:
        config = json.loads(text) if text else None
    except (ValueError, RecursionError):
        config = None
    for key in ("revision", "_commit_hash"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, str) and value and len(value) <= _MAX_REVISION and value.isprintable():
            return value
    return None


def check_provenance(block, where: str) -> None:
    """A provenance block as the manifest may hold it (nothing in a manifest is trusted)."""
    if not isinstance(block, dict):
        raise TableFormatError(f"{where}: provenance must be an object, found {_short(block)}")
    digest, hashed, shards, rev = (block.get(k) for k in ("checkpoint_sha256", "hashed", "shards", "revision"))
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise TableFormatError(f"{where}: provenance.checkpoint_sha256 must be 64 hex digits, found {_short(digest)}")
    if hashed not in (INDEX, HEADERS):
        raise TableFormatError(f"{where}: provenance.hashed must be {INDEX!r} or {HEADERS!r}, found {_short(hashed)}")
    if not isinstance(shards, list):
        raise TableFormatError(f"{where}: provenance.shards must be a list, found {_short(shards)}")
    for i, s in enumerate(shards):
        size = s.get("bytes") if isinstance(s, dict) else None
        if not isinstance(s, dict) or not _plain_name(s.get("name")) or not (
                size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 0)):
            raise TableFormatError(f"{where}: provenance.shards[{i}] must be {{name, bytes}}, found {_short(s)}")
    if rev is not None and not (isinstance(rev, str) and len(rev) <= _MAX_REVISION and rev.isprintable()):
        raise TableFormatError(f"{where}: provenance.revision must be a short string or null, found {_short(rev)}")


def describe(block: Optional[dict]) -> str:
    """One line about a provenance block, for inspect and the CLI."""
    if block is None:
        return "not recorded"
    total = sum(s["bytes"] or 0 for s in block["shards"])
    rev = f", revision {_one_line(block['revision'], 60)}" if block["revision"] else ""
    return (f"sha256 {block['checkpoint_sha256']} ({block['hashed']}), {len(block['shards'])} shard(s), "
            f"{total / 2**30:.3f} GiB{rev}")
