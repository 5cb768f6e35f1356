"""N-gram matching over a sequence's own tokens (prompt lookup): what the n-gram draft
(`engines.ngram_draft`) proposes, and the chains that lead a draft model's rounds
(`Speculator.match`, draft method "ngram+model")."""
from __future__ import annotations

import numpy as np


def propose(context: np.ndarray, max_ngram: int, min_ngram: int) -> int | None:
    """The token after the most recent earlier occurrence of `context`'s last n tokens,
    for the longest n in `[min_ngram, max_ngram]` that occurs; None when none does."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        starts = len(context) - n  # windows starting before the last n tokens' own
        found = context[:starts] == context[-n]
        for offset in range(1, n):
            found &= context[offset:starts + offset] == context[-n + offset]
        hits = np.flatnonzero(found)
        if len(hits):
            return int(context[hits[-1] + n])
    return None


def matched_chain(context: np.ndarray, k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to `k` proposals in a row, each matched on the context with the ones before it."""
    tokens: list[int] = []
    while len(tokens) < k and (token := propose(context, max_ngram, min_ngram)) is not None:
        tokens.append(token)
        context = np.append(context, token)
    return tokens
