"""EngramConfig: presets, HF config.json (top level or text_config), one clear error per bad value."""

from __future__ import annotations

import json

import pytest

from engram_sglang import EngramConfig
from engram_sglang.core.errors import EngramConfigError


def test_preset_has_the_spec_fields():
    cfg = EngramConfig.from_preset("deepseek-v4.1-flash")
    assert cfg.layer_ids == (1, 14)
    assert (cfg.max_ngram_size, cfg.n_heads, cfg.head_dim) == (4, 8, 256)
    assert (cfg.vocab_size, cfg.compressed_vocab_size, cfg.pad_token_id) == (16_000_000, 99092, 2)
    assert cfg.num_embeddings == (384006168, 384016682)
    assert (cfg.hidden_size, cfg.hc_mult, cfg.hash_columns) == (5120, 4, 24)


@pytest.mark.parametrize("nest", [False, True])
def test_from_pretrained_reads_top_level_or_text_config(tmp_path, nest):
    fields = EngramConfig.from_preset("deepseek-v4.1-flash").hash_fields()
    doc = {"architectures": ["X"], "text_config": fields} if nest else {"architectures": ["X"], **fields}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    cfg = EngramConfig.from_pretrained(tmp_path)
    assert cfg == EngramConfig.from_preset("deepseek-v4.1-flash").__class__.from_dict(fields)
    assert cfg.fingerprint() == EngramConfig.from_preset("deepseek-v4.1-flash").fingerprint()


def test_fingerprint_changes_with_any_hash_field():
    base = EngramConfig.from_preset("deepseek-v4.1-flash")
    fields = base.hash_fields()
    for key, value in [("engram_compressed_vocab_size", 99093), ("engram_pad_token_id", 3), ("engram_n_heads", 7)]:
        other = EngramConfig.from_dict({**fields, key: value, "engram_num_embeddings": None})
        assert other.fingerprint() != base.fingerprint(), key


GOOD = EngramConfig.from_preset("deepseek-v4.1-flash").hash_fields()


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("engram_layer_ids", [], "engram_layer_ids must be a non-empty list"),
        ("engram_layer_ids", [1, 1], "without repeats"),
        ("engram_layer_ids", [-1], "layer indices >= 0"),
        ("engram_max_ngram_size", 1, r"engram_max_ngram_size must be an integer >= 2 \(and <= 8\), got 1"),
        ("engram_max_ngram_size", "4", r"engram_max_ngram_size must be an integer >= 2 \(and <= 8\), got '4'"),
        # Bounds far above any real model, checked before any prime search or allocation.
        ("engram_max_ngram_size", 10**6, r"engram_max_ngram_size must be an integer >= 2 \(and <= 8\), got 1000000"),
        ("engram_n_heads", 10**9, r"engram_n_heads must be an integer >= 1 \(and <= 64\)"),
        ("engram_layer_ids", list(range(1000)), "at most 64 layers, got '1000 layers'"),
        ("engram_layer_ids", [2**40], r"layer indices >= 0 \(and <= 65535\)"),
        ("engram_layer_ids", list(range(30)), "30 Engram layers x 3 n-gram orders x 8 heads = 720 hash columns; at most 512"),
        ("engram_vocab_size", 10**30, r"engram_vocab_size must be an integer >= 2 \(and <= 2\^32\)"),
        ("engram_compressed_vocab_size", 2**40, r"engram_compressed_vocab_size must be an integer >= 1 \(and <= 2\^32\)"),
        ("engram_head_dim", float("inf"), "engram_head_dim must be an integer >= 1"),
        ("engram_num_embeddings", 5, "engram_num_embeddings must be 2 positive row counts"),
        ("engram_layer_ids", {"1": 1}, "engram_layer_ids must be a non-empty list"),
        ("engram_n_heads", 0, "engram_n_heads must be an integer >= 1"),
        ("engram_head_dim", True, "engram_head_dim must be an integer >= 1"),
        ("engram_vocab_size", 1, "engram_vocab_size must be an integer >= 2"),
        ("engram_compressed_vocab_size", 0, "engram_compressed_vocab_size must be an integer >= 1"),
        ("engram_pad_token_id", -2, "engram_pad_token_id must be a token id >= 0"),
        ("engram_num_embeddings", [5], "engram_num_embeddings must be 2 positive row counts"),
    ],
)
def test_each_bad_value_gets_one_clear_line(tmp_path, key, value, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GOOD, key: value}))
    with pytest.raises(EngramConfigError, match=message) as e:
        EngramConfig.from_pretrained(tmp_path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_fields_and_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"engram_layer_ids": [1]}))
    with pytest.raises(EngramConfigError, match="missing Engram field\\(s\\) engram_max_ngram_size"):
        EngramConfig.from_pretrained(tmp_path)
    with pytest.raises(EngramConfigError, match="no such config file"):
        EngramConfig.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngramConfigError, match="not valid JSON"):
        EngramConfig.from_pretrained(tmp_path)
    with pytest.raises(EngramConfigError, match="unknown preset 'nope'; known presets: .*deepseek-v4.1-flash"):
        EngramConfig.from_preset("nope")


def test_config_file_that_is_a_fifo_directory_or_binary_gets_one_line(tmp_path):
    """Never a hang (a FIFO waits for a writer), never a traceback."""
    import os

    fifo = tmp_path / "fifo" / "config.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    with pytest.raises(EngramConfigError, match="config.json: the config file is a FIFO, not a regular file$") as e:
        EngramConfig.from_pretrained(fifo.parent)
    assert str(e.value).count("config.json") == 1  # its own line, not wrapped in another error
    with pytest.raises(EngramConfigError, match="config file is a FIFO"):
        EngramConfig.resolve(str(fifo))
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    with pytest.raises(EngramConfigError, match="config.json: the config file is a directory"):
        EngramConfig.from_pretrained(tmp_path / "dir")
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff\xfe"}')
    with pytest.raises(EngramConfigError, match=r"config.json: not a JSON text \(UnicodeDecodeError\)"):
        EngramConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(EngramConfigError, match="config.json: not a JSON text"):
        EngramConfig.from_pretrained(tmp_path)
