"""Demo prompts the demo model can recall: chosen from its corpus by a rule on the corpus alone.

The demo model (model.py) is an n-gram memory of its corpus: at every token its Engram
rows hold the mean embedding of what followed the same 2-, 3- and 4-grams in the corpus
(hashed into small tables, quantized to fp8), and its logits add those votes up, longer
n-grams weighing more (demo_model.ORDER_WEIGHT). Its ideal is the corpus's own interpolated
n-gram model: score each token by sum over orders of weight x the share of that order's
n-gram followed by it, take the best. That model never leaves the corpus, but where two
tokens score alike the memory holds a blend and decoding may leave the text (the near-random
backbone then mostly repeats its input: "= = = ="), and where it comes back to a 4-gram it
has continued before it loops for good. So the demo asks for prompts, a few tokens starting
a line, from which that ideal chain runs `new_tokens` tokens with a clear winner at every
step (by `margin`) and no 4-gram twice (n-grams keyed as the hasher keys them: compressed
token ids). No model output takes part in the choice; the demo prints how many completion
tokens match the chain with Engram on and off.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import NamedTuple, Sequence

from .model import MAX_NGRAM as ORDER
from .model import ORDER_WEIGHT


class RecallPrompt(NamedTuple):
    prompt: list[int]  # token ids
    source: list[int]  # the ideal memory's continuation (see above)
    document: int  # index into the corpus texts


def recall_prompts(tokenizer, texts: Sequence[str], n: int, new_tokens: int, prompt_tokens: int = 12,
                   min_chars: int = 40, margin: float = 0.1) -> list[RecallPrompt]:
    """`n` distinct prompts of `prompt_tokens` tokens, taken round robin over the corpus
    texts (earliest first, non-overlapping within a text), whose ideal chain runs `new_tokens`
    tokens, each step's winner ahead of the runner-up by `margin` (of a total weight of 3),
    without a repeated 4-gram, and holds at least `min_chars` non-blank characters."""
    from ...core.hashing import compressed_token_map

    token_map, _ = compressed_token_map(tokenizer)
    docs = [tokenizer(t)["input_ids"] for t in texts]
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)  # n-gram (any order) -> its successors
    for ids in docs:
        key = [int(token_map[i]) for i in ids]
        for q in range(len(ids) - 1):
            for order in range(2, min(ORDER, q + 1) + 1):
                counts[tuple(key[q - order + 1:q + 1])][ids[q + 1]] += 1

    def best(gram: tuple[int, ...]):
        """The ideal memory's next token after `gram` (the last ORDER keys), None when unclear."""
        score: Counter = Counter()
        for order in range(2, ORDER + 1):
            c = counts.get(gram[-order:])
            if c:
                total = sum(c.values())
                for tok, k in c.items():
                    score[tok] += ORDER_WEIGHT[order] * k / total
        top = score.most_common(2)
        if not top or (len(top) == 2 and top[0][1] - top[1][1] < margin):
            return None
        return top[0][0]

    line_start = {i for i in range(len(token_map)) if tokenizer.decode([i]).endswith("\n")}

    def chain(prompt: list[int]) -> list[int] | None:
        gram = tuple(int(token_map[i]) for i in prompt[-ORDER:])
        seen, out = set(), []
        while len(out) < new_tokens:
            nxt = best(gram)
            if nxt is None or gram in seen:
                return None
            seen.add(gram)
            out.append(nxt)
            gram = gram[1:] + (int(token_map[nxt]),)
        return out

    def passages(d: int):
        ids, a = docs[d], 1
        while a < len(ids) - prompt_tokens:
            if ids[a - 1] in line_start:
                prompt = ids[a:a + prompt_tokens]
                source = chain(prompt)
                if source and len("".join(tokenizer.decode(source).split())) >= min_chars:
                    yield RecallPrompt(prompt, source, d)
                    a += prompt_tokens + new_tokens  # the text's next prompt starts after this passage
                    continue
            a += 1

    chosen: list[RecallPrompt] = []
    seen_prompts = set()
    sources = [passages(d) for d in range(len(docs))]
    while len(chosen) < n and sources:
        for gen in list(sources):
            p = next(gen, None)
            if p is None:
                sources.remove(gen)
            elif len(chosen) < n and tuple(p.prompt) not in seen_prompts:
                seen_prompts.add(tuple(p.prompt))
                chosen.append(p)
    return chosen
