"""Hashing parity with upstream SGLang's own code (the installed sglang 0.5.23, on CPU),
and history bookkeeping: chunked prefill + decode + speculative verify == one-shot hashing."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from engram_sglang import EngramConfig, EngramLayout, HashHistory, NgramHasher
from engram_sglang.core.errors import EngramConfigError, EngramError, TokenizerMismatchError
from engram_sglang.core.hashing import compressed_token_map, hash_multipliers
from tests.support.tables import small_config


@pytest.fixture(scope="module")
def upstream():
    """sglang's Engram module: the oracle. Importing it pulls in sglang.srt (a few seconds)."""
    engram = pytest.importorskip("sglang.srt.layers.engram")
    from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE

    engram.MM_PAD_SHIFT_VALUE_ = MM_PAD_SHIFT_VALUE
    return engram


def as_hf_config(cfg: EngramConfig):
    """The attribute-style config upstream's EngramLayout.from_config reads."""
    fields = {**cfg.hash_fields(), "engram_num_embeddings": list(EngramLayout(cfg).num_embeddings)}
    return types.SimpleNamespace(**fields)


# ------------------------------------------------------------------------- layout
def test_deepseek_v41_row_counts_are_exact(upstream):
    cfg = EngramConfig.from_preset("deepseek-v4.1-flash")
    layout = EngramLayout(cfg)
    assert layout.num_embeddings == (384006168, 384016682)
    theirs = upstream.EngramLayout.from_config(as_hf_config(cfg))
    assert layout.primes == theirs.primes
    for i in range(cfg.n_layers):
        assert layout.column_bounds(i) == theirs.column_bounds(i)
    total = sum(layout.num_embeddings) * 264
    assert round(total / 2**30, 2) == 188.83


@pytest.mark.parametrize("layers,n,heads,vocab", [((0,), 2, 1, 2), ((2, 5, 7), 3, 5, 5000), ((1, 14), 5, 3, 123457)])
def test_layout_and_multipliers_match_upstream(upstream, layers, n, heads, vocab):
    cfg = EngramConfig(
        layer_ids=layers, max_ngram_size=n, n_heads=heads, head_dim=256, vocab_size=vocab,
        compressed_vocab_size=777, pad_token_id=0,
    )
    assert EngramLayout(cfg).primes == upstream.EngramLayout.from_config(as_hf_config(cfg)).primes
    theirs = upstream.compute_hash_multipliers(layers, n, 777).numpy()
    assert np.array_equal(hash_multipliers(cfg), theirs)


def test_config_row_counts_must_match_layout():
    with pytest.raises(EngramConfigError, match="engram_num_embeddings is \\[5, 6\\] but the prime layout"):
        EngramLayout(small_config(100, num_embeddings=(5, 6)))


# ------------------------------------------------------------- compressed vocab
@pytest.mark.parametrize("tok_fixture", ["bytelevel_tokenizer", "wordpiece_tokenizer"])
def test_compressed_token_map_matches_upstream(upstream, request, tok_fixture):
    tok = request.getfixturevalue(tok_fixture)
    ours, size = compressed_token_map(tok)
    theirs, their_size = upstream.build_compressed_token_map(tok)
    assert size == their_size
    assert ours.tolist() == theirs
    # The normalization really merges tokens here (else the test proves little).
    assert size < len(tok)


def test_tokenizer_with_other_compressed_size_is_refused(bytelevel_tokenizer):
    _, size = compressed_token_map(bytelevel_tokenizer)
    cfg = small_config(size + 1)
    with pytest.raises(TokenizerMismatchError, match=f"normalizes to {size} distinct tokens but engram_compressed_vocab_size is {size + 1}"):
        NgramHasher.from_tokenizer(cfg, bytelevel_tokenizer)


# ---------------------------------------------------------------------- hashing
def random_windows(gen: torch.Generator, count: int, n: int, vocab: int, image_id: int | None = None):
    tokens = torch.randint(0, vocab, (count, n), generator=gen)
    positions = torch.randint(0, n + 3, (count,), generator=gen)
    blocked = positions.unsqueeze(-1) < torch.arange(n)
    if image_id is not None:
        # Sprinkle image tokens so that blocking by image look-back occurs often.
        mask = torch.rand(count, n, generator=gen) < 0.15
        tokens = torch.where(mask, torch.full_like(tokens, image_id), tokens)
    return tokens, blocked


@pytest.mark.parametrize("n,heads,layers", [(4, 8, (1, 14)), (3, 2, (0, 2, 9)), (2, 1, (5,))])
def test_hash_windows_match_upstream(upstream, bytelevel_tokenizer, rng, n, heads, layers):
    _, size = compressed_token_map(bytelevel_tokenizer)
    cfg = small_config(size, max_ngram_size=n, n_heads=heads, layer_ids=layers, vocab_size=50000)
    ours = NgramHasher.from_tokenizer(cfg, bytelevel_tokenizer)
    theirs = upstream.EngramHasher(
        upstream.EngramLayout.from_config(as_hf_config(cfg)), bytelevel_tokenizer, cfg.pad_token_id, size
    )
    tokens, blocked = random_windows(rng, 4000, n, len(bytelevel_tokenizer))
    got = ours.hash_windows(tokens, blocked)
    want, _ = theirs.hash_windows(tokens, blocked)
    assert got.dtype == torch.int64 and got.shape == (4000, len(layers), (n - 1) * heads)
    assert torch.equal(got, want)
    # Row ids land inside each layer's table.
    for i, rows in enumerate(EngramLayout(cfg).num_embeddings):
        assert 0 <= int(got[:, i].min()) and int(got[:, i].max()) < rows
    # And through upstream's free function, fed the compressed pad id and per-column offsets.
    direct = upstream.compute_engram_hash_ids(
        tokens, blocked, ours.pad_id, ours.token_map, ours.multipliers, ours.primes, ours.offsets
    )
    assert torch.equal(got, direct)


def test_image_token_blocking_matches_upstream(upstream, bytelevel_tokenizer, rng):
    _, size = compressed_token_map(bytelevel_tokenizer)
    cfg = small_config(size)
    image_id = bytelevel_tokenizer.convert_tokens_to_ids("<image>")
    shift = upstream.MM_PAD_SHIFT_VALUE_
    ours = NgramHasher.from_tokenizer(cfg, bytelevel_tokenizer, image_token_id=image_id, mm_pad_shift=shift)
    theirs = upstream.EngramHasher(
        upstream.EngramLayout.from_config(as_hf_config(cfg)), bytelevel_tokenizer, cfg.pad_token_id, size
    )
    theirs.image_token_id = image_id
    tokens, blocked = random_windows(rng, 3000, 4, len(bytelevel_tokenizer), image_id)
    # Multimodal pad ids (>= the shift) read as the image token.
    tokens[::7, 1] = shift + 5
    want, _ = theirs.hash_windows(tokens, blocked)
    assert torch.equal(ours.hash_windows(tokens, blocked), want)


def test_out_of_vocabulary_token_is_a_clear_error(bytelevel_tokenizer):
    _, size = compressed_token_map(bytelevel_tokenizer)
    hasher = NgramHasher.from_tokenizer(small_config(size), bytelevel_tokenizer)
    bad = len(bytelevel_tokenizer) + 3
    with pytest.raises(EngramError, match=f"token id {bad} is outside the tokenizer's {len(bytelevel_tokenizer)} tokens"):
        hasher.hash_sequence([5, bad, 7])


# ------------------------------------------------------------ history bookkeeping
def oracle_windows(seq: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of a whole sequence by an explicit loop: the simplest possible statement."""
    tokens = [[seq[t - s] if t - s >= 0 else 0 for s in range(n)] for t in range(len(seq))]
    blocked = [[t - s < 0 for s in range(n)] for t in range(len(seq))]
    return torch.tensor(tokens), torch.tensor(blocked)


@pytest.fixture(scope="module")
def hasher(bytelevel_tokenizer):
    _, size = compressed_token_map(bytelevel_tokenizer)
    return NgramHasher.from_tokenizer(small_config(size), bytelevel_tokenizer)


def test_one_shot_sequence_equals_explicit_windows(hasher, rng):
    seq = torch.randint(0, 1500, (57,), generator=rng).tolist()
    assert torch.equal(hasher.hash_sequence(seq), hasher.hash_windows(*oracle_windows(seq, hasher.n)))


def run_chunked_then_decode(hasher, seqs, chunk, decode_from, corrupt=None):
    """Serve several requests as a scheduler would: chunked prefill of seq[:decode_from]
    (each chunk seeded from the tokens before it), then one token per request per decode
    step in a shared batch, committing history after every step. Returns per-request ids."""
    n = hasher.n
    hist = HashHistory(num_slots=8, max_ngram_size=n)
    out = {i: [] for i in range(len(seqs))}
    slots = {i: 2 * i + 1 for i in range(len(seqs))}
    for i, seq in enumerate(seqs):
        for lo in range(0, decode_from, chunk):
            hi = min(decode_from, lo + chunk)
            hist.seed(slots[i], seq[:lo])
            ids = torch.tensor(seq[lo:hi])
            got, windows = hasher.hash_batch(
                ids, torch.arange(lo, hi), hist.rows(torch.tensor([slots[i]])), torch.tensor([hi - lo])
            )
            hist.commit(torch.tensor([slots[i]]), windows, torch.tensor([hi - lo - 1]))
            out[i].append(got)
    if corrupt is not None:
        hist.table[slots[corrupt]] = hist.table[slots[corrupt]].roll(1)
    for t in range(decode_from, len(seqs[0])):
        batch_slots = torch.tensor([slots[i] for i in range(len(seqs))])
        ids = torch.tensor([seq[t] for seq in seqs])
        got, windows = hasher.hash_batch(
            ids, torch.full((len(seqs),), t), hist.rows(batch_slots), torch.ones(len(seqs), dtype=torch.long)
        )
        hist.commit(batch_slots, windows, torch.arange(len(seqs)))
        for i in range(len(seqs)):
            out[i].append(got[i : i + 1])
    return {i: torch.cat(v) for i, v in out.items()}


@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_chunked_prefill_and_decode_equal_one_shot(hasher, rng, chunk):
    seqs = [torch.randint(0, 1500, (40,), generator=rng).tolist() for _ in range(3)]
    got = run_chunked_then_decode(hasher, seqs, chunk, decode_from=17)
    for i, seq in enumerate(seqs):
        assert torch.equal(got[i], hasher.hash_sequence(seq)), f"request {i}"


def test_corrupted_history_is_detected(hasher, rng):
    """Negative control: a wrong history row must change the decode hashes."""
    seqs = [torch.randint(0, 1500, (30,), generator=rng).tolist() for _ in range(2)]
    # Make the rolled history row differ from itself (distinct tokens around the boundary).
    seqs[1][12:17] = [101, 202, 303, 404, 505]
    got = run_chunked_then_decode(hasher, seqs, 4, decode_from=17, corrupt=1)
    assert torch.equal(got[0], hasher.hash_sequence(seqs[0]))
    want = hasher.hash_sequence(seqs[1])
    assert torch.equal(got[1][:17], want[:17])
    assert not torch.equal(got[1][17], want[17])


def test_speculative_verify_commits_only_accepted_tokens(hasher, rng):
    n = hasher.n
    seq = torch.randint(0, 1500, (12,), generator=rng).tolist()
    hist = HashHistory(num_slots=2, max_ngram_size=n)
    slot = torch.tensor([0])
    hist.seed(0, seq)
    accepted = [777, 888]  # the anchor and one accepted draft
    block = accepted + [999, 111]  # two rejected drafts
    got, _ = hasher.hash_batch(torch.tensor(block), torch.arange(12, 16), hist.rows(slot), torch.tensor([4]))
    assert torch.equal(got, hasher.hash_sequence(seq + block)[12:])
    hist.commit_after_verify(slot, torch.tensor([block]), torch.tensor([len(accepted)]))
    bonus = 222
    step, _ = hasher.hash_batch(torch.tensor([bonus]), torch.tensor([14]), hist.rows(slot), torch.tensor([1]))
    assert torch.equal(step[0], hasher.hash_sequence(seq + accepted + [bonus])[-1])
    # Negative control: committing the whole block would hash the bonus differently.
    wrong = HashHistory(num_slots=2, max_ngram_size=n)
    wrong.seed(0, seq)
    wrong.commit_after_verify(slot, torch.tensor([block]), torch.tensor([len(block)]))
    bad, _ = hasher.hash_batch(torch.tensor([bonus]), torch.tensor([14]), wrong.rows(slot), torch.tensor([1]))
    assert not torch.equal(bad[0], step[0])


def test_mixed_batch_of_runs_equals_per_request(hasher, rng):
    """Runs of different lengths in one batch (extend after prefix hits) hash as alone."""
    seqs = [torch.randint(0, 1500, (k,), generator=rng).tolist() for k in (9, 3, 20, 1)]
    starts = [4, 0, 11, 0]  # tokens before each run (a prefix-cache hit)
    hist = HashHistory(num_slots=4, max_ngram_size=hasher.n)
    for i, (seq, s) in enumerate(zip(seqs, starts)):
        hist.seed(i, seq[:s])
    ids = torch.tensor([t for seq, s in zip(seqs, starts) for t in seq[s:]])
    positions = torch.tensor([p for seq, s in zip(seqs, starts) for p in range(s, len(seq))])
    lens = torch.tensor([len(seq) - s for seq, s in zip(seqs, starts)])
    got, _ = hasher.hash_batch(ids, positions, hist.rows(torch.arange(4)), lens)
    want = torch.cat([hasher.hash_sequence(seq)[s:] for seq, s in zip(seqs, starts)])
    assert torch.equal(got, want)
