"""EngramConfig: the fields of a model's Engram tables, read from presets or HF configs.

Every field feeds the hash (multipliers, primes, offsets) or the table shape, so a wrong
value silently rehashes every lookup. Each invalid value is refused with one line that
names the source and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import EngramConfigError
from .fileio import read_regular
from .placement_table import PLACEMENTS  # noqa: F401  (where a table can live: re-exported)

# The HF config.json keys, as DeepSeek-V4.1's `text_config` spells them.
_KEY_PREFIX = "engram_"

# Bounds on what a config may ask for, far above any real model (DeepSeek-V4.1-Flash: 2 Engram
# layers, n-grams up to 4, 8 heads, 48 hash columns, vocab_size 16e6). The prime layout
# restarts its search per (layer, order) and walks every prime taken before, so its cost
# grows with the square of the columns: an absurd config would compute for minutes (or
# size tables of petabytes) before anything could refuse it.
MAX_LAYER_ID = (1 << 16) - 1
MAX_ENGRAM_LAYERS = 64
MAX_NGRAM_SIZE = 8
MAX_HEADS = 64
MAX_HASH_COLUMNS = 512  # Engram layers x (max_ngram_size - 1) x n_heads: primes to find
MAX_VOCAB = 1 << 32  # vocab_size (where the prime search starts) and compressed_vocab_size
MAX_HEAD_DIM = 1 << 16
MAX_CONFIG_BYTES = 16 << 20  # a config.json larger than this is not a model config

# A model directory's packed tables, where no table directory is given (--engram-table-dir,
# a tool's --table-dir): the name serving reads and the demo writes.
DEFAULT_TABLE_DIR = "engram_tables"


def configs_dir() -> Path:
    """The repository's `configs/` folder (override with ENGRAM_CONFIGS_DIR)."""
    env = os.environ.get("ENGRAM_CONFIGS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True)
class EngramConfig:
    """Engram fields of a model (see docs/engram.md section 2).

    Attributes
    ----------
    layer_ids : transformer layers that carry an Engram lookup (one table each).
    max_ngram_size : largest n-gram order n; orders 2..n are hashed.
    n_heads : hash heads per n-gram order.
    head_dim : values per retrieved row (256 for the packed fp8 row format).
    vocab_size : where the prime search starts (not the tokenizer's vocabulary).
    compressed_vocab_size : distinct normalized tokens; every multiplier depends on it.
    pad_token_id : raw token id whose compressed id stands for look-back past the start.
    num_embeddings : rows per layer table, or None to derive them from the prime layout.
    hidden_size, hc_mult : the model's hidden size and hyper-connection branches.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int
    compressed_vocab_size: int
    pad_token_id: int
    num_embeddings: Optional[tuple[int, ...]] = None
    hidden_size: Optional[int] = None
    hc_mult: int = 1
    source: str = dataclasses.field(default="<dict>", compare=False)

    def __post_init__(self) -> None:
        def bad(field: str, want: str, got: Any) -> EngramConfigError:
            return EngramConfigError(
                f"{self.source}: {_KEY_PREFIX}{field} must be {want}, got {got!r}"
            )

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if (not isinstance(self.layer_ids, tuple) or not self.layer_ids
                or not all(is_int(i) and 0 <= i <= MAX_LAYER_ID for i in self.layer_ids)):
            raise bad("layer_ids", f"a non-empty list of layer indices >= 0 (and <= {MAX_LAYER_ID})", self.layer_ids)
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise bad("layer_ids", "a list without repeats", self.layer_ids)
        if len(self.layer_ids) > MAX_ENGRAM_LAYERS:
            raise bad("layer_ids", f"at most {MAX_ENGRAM_LAYERS} layers", f"{len(self.layer_ids)} layers")
        if not is_int(self.max_ngram_size) or not 2 <= self.max_ngram_size <= MAX_NGRAM_SIZE:
            raise bad("max_ngram_size", f"an integer >= 2 (and <= {MAX_NGRAM_SIZE})", self.max_ngram_size)
        if not is_int(self.n_heads) or not 1 <= self.n_heads <= MAX_HEADS:
            raise bad("n_heads", f"an integer >= 1 (and <= {MAX_HEADS})", self.n_heads)
        columns = len(self.layer_ids) * (self.max_ngram_size - 1) * self.n_heads
        if columns > MAX_HASH_COLUMNS:
            raise EngramConfigError(
                f"{self.source}: {len(self.layer_ids)} Engram layers x {self.max_ngram_size - 1} n-gram orders x "
                f"{self.n_heads} heads = {columns} hash columns; at most {MAX_HASH_COLUMNS} are supported"
            )
        if not is_int(self.head_dim) or not 1 <= self.head_dim <= MAX_HEAD_DIM:
            raise bad("head_dim", f"an integer >= 1 (and <= {MAX_HEAD_DIM})", self.head_dim)
        if not is_int(self.vocab_size) or not 2 <= self.vocab_size <= MAX_VOCAB:
            raise bad("vocab_size", "an integer >= 2 (and <= 2^32)", self.vocab_size)
        if not is_int(self.compressed_vocab_size) or not 1 <= self.compressed_vocab_size <= MAX_VOCAB:
            raise bad("compressed_vocab_size", "an integer >= 1 (and <= 2^32)", self.compressed_vocab_size)
        if not is_int(self.pad_token_id) or not 0 <= self.pad_token_id < MAX_VOCAB:
            raise bad("pad_token_id", "a token id >= 0 (and < 2^32)", self.pad_token_id)
        if self.num_embeddings is not None:
            if not isinstance(self.num_embeddings, tuple) or len(self.num_embeddings) != len(self.layer_ids) or not all(
                is_int(r) and r > 0 for r in self.num_embeddings
            ):
                raise bad(
                    "num_embeddings",
                    f"{len(self.layer_ids)} positive row counts (one per layer id)",
                    self.num_embeddings,
                )
        if self.hidden_size is not None and (not is_int(self.hidden_size) or not 1 <= self.hidden_size <= 1 << 20):
            raise EngramConfigError(f"{self.source}: hidden_size must be >= 1 (and <= 2^20), got {self.hidden_size!r}")
        if not is_int(self.hc_mult) or not 1 <= self.hc_mult <= 64:
            raise EngramConfigError(f"{self.source}: hc_mult must be >= 1 (and <= 64), got {self.hc_mult!r}")

    # ----------------------------------------------------------------- derived facts
    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def hash_columns(self) -> int:
        """Row ids per token per layer: (n - 1) orders x heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    def hash_fields(self) -> dict[str, Any]:
        """The fields that decide which row a token reads, in HF key spelling."""
        d = {
            "engram_layer_ids": list(self.layer_ids),
            "engram_max_ngram_size": self.max_ngram_size,
            "engram_n_heads": self.n_heads,
            "engram_head_dim": self.head_dim,
            "engram_vocab_size": self.vocab_size,
            "engram_compressed_vocab_size": self.compressed_vocab_size,
            "engram_pad_token_id": self.pad_token_id,
        }
        if self.num_embeddings is not None:
            d["engram_num_embeddings"] = list(self.num_embeddings)
        return d

    def fingerprint(self) -> str:
        """Stable digest of the fields that decide row ids: a table built for another config
        is refused. Row counts are left out: they follow from these (EngramLayout checks a
        config's stated counts), so a config.json that states them matches one that does not."""
        fields = {k: v for k, v in self.hash_fields().items() if k != "engram_num_embeddings"}
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "EngramConfig":
        """Read the `engram_*` keys of an HF config dict (top level or `text_config`)."""
        if "engram_layer_ids" not in d and isinstance(d.get("text_config"), Mapping):
            d = d["text_config"]
        required = (
            "layer_ids",
            "max_ngram_size",
            "n_heads",
            "head_dim",
            "vocab_size",
            "compressed_vocab_size",
            "pad_token_id",
        )
        missing = [_KEY_PREFIX + k for k in required if _KEY_PREFIX + k not in d]
        if missing:
            raise EngramConfigError(f"{source}: missing Engram field(s) {', '.join(missing)}")

        def as_tuple(key: str) -> Any:
            v = d[key]
            return tuple(v) if isinstance(v, (list, tuple)) else v

        num = d.get("engram_num_embeddings")
        return cls(
            layer_ids=as_tuple("engram_layer_ids"),
            max_ngram_size=d["engram_max_ngram_size"],
            n_heads=d["engram_n_heads"],
            head_dim=d["engram_head_dim"],
            vocab_size=d["engram_vocab_size"],
            compressed_vocab_size=d["engram_compressed_vocab_size"],
            pad_token_id=d["engram_pad_token_id"],
            num_embeddings=tuple(num) if isinstance(num, (list, tuple)) else num,
            hidden_size=d.get("hidden_size"),
            hc_mult=d.get("hc_mult", 1),
            source=source,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "EngramConfig":
        path = Path(path)
        try:
            text = read_regular(path, MAX_CONFIG_BYTES, EngramConfigError, "config file")
        except FileNotFoundError:
            raise EngramConfigError(f"{path}: no such config file") from None
        try:  # (apart from the read: EngramConfigError is a ValueError too)
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EngramConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except (UnicodeDecodeError, RecursionError) as e:
            raise EngramConfigError(f"{path}: not a JSON text ({type(e).__name__})") from None
        except ValueError as e:  # json reads an integer of more than 4300 digits into this
            raise EngramConfigError(f"{path}: not a JSON text ({str(e).split(';')[0]})") from None
        if not isinstance(data, Mapping):
            raise EngramConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "EngramConfig":
        """Read `config.json` of an HF model directory."""
        return cls.from_file(Path(model_dir) / "config.json")

    @classmethod
    def from_preset(cls, name: str) -> "EngramConfig":
        """A preset from `configs/NAME.json`, e.g. "deepseek-v4.1-flash"."""
        path = configs_dir() / f"{name}.json"
        if not path.is_file():
            known = sorted(p.stem for p in configs_dir().glob("*.json") if '"engram_layer_ids"' in p.read_text())
            raise EngramConfigError(f"unknown preset {name!r}; known presets: {', '.join(known)}")
        return cls.from_file(path)

    @classmethod
    def resolve(cls, spec: str | os.PathLike) -> "EngramConfig":
        """A preset name, a config.json path, or a model directory holding one."""
        p = Path(spec)
        if p.is_dir():
            return cls.from_pretrained(p)
        if p.suffix == ".json" or p.exists():
            return cls.from_file(p)
        return cls.from_preset(str(spec))
