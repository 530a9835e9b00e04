"""The demo's text and tokenizer: text every machine has offline (prose that exercises
normalization, and Python's own standard library sources) and a byte-level BPE tokenizer
trained on it locally. The demo model is built from these (model.py); the demo, the
benchmarks and the tests read them too."""

from __future__ import annotations

import os
from pathlib import Path

# Prose with accents, mixed scripts and whitespace runs: normalization has work to do.
DEMO_PROSE = (
    "Café naïve Ünïcödé façade — déjà vu!\tTabs\t\tand   spaces\n\nNew paragraph. "
    "日本語のテキストと中文文本，还有 한국어 텍스트. Ελληνικά κείμενα. Русский текст.\r\n"
    "ﬁ ligatures, ① circled, ＦＵＬＬＷＩＤＴＨ letters, e\u0301 combining accents. "
)

def demo_corpus(limit_chars: int = 400_000) -> list[str]:
    """Text available offline: the prose above and Python's own standard library sources."""
    stdlib = Path(os.__file__).parent
    out, size = [DEMO_PROSE * 20], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(errors="replace")
        out.append(text)
        size += len(text)
        if size > limit_chars:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 1500):
    """A byte-level BPE fast tokenizer trained locally (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "<pad>", "</s>", "<image>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
