"""A draft without a model: n-gram matching over the sequence's own tokens (prompt lookup),
the method vLLM calls `ngram` and TensorRT-LLM NGram decoding.

A row proposes the token that followed the most recent earlier occurrence of its last n
tokens in its own context (the prompt, what was committed, and what was drafted before it),
trying n from `max_ngram` down to `min_ngram`. Answers quote their question, repeat their
own phrases and lists, and continue text that repeats: there a proposal costs a search of a
few hundred tokens, not a forward, and chains of them are accepted whole.

It is an engine like the model drafts (caches, batched forwards, the branch plan), so the
decoding rounds, pre-speculation and the load policy run over it unchanged: a row's logits put
all the mass on its proposal (0 there, `NOT_PROPOSED` elsewhere), so a draft's q is one-hot and
verification accepts a sampled proposal x with probability p(x), otherwise resampling from
p without x: the target's distribution exactly, as with any draft. Where no n-gram of at
least `min_ngram` tokens matches, drafting stops (`Rows.proposes`): the round verifies
the drafts before it, or none, and costs what an autoregressive step costs. (Such a row's
logits still name a token, its own last one, for the branch plan of a pre-speculation,
which drafts from every row.) Its caches hold token ids, not K/V.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.runtime.core.contracts import EngineInfo, OneSequenceForms, Rows, Step
from saguaro.runtime.core.ngram import propose
from saguaro.runtime.core.sampling import NOT_PROPOSED
from saguaro.runtime.engines.kv_cache import check_gather, check_truncate

BACKEND = "ngram"
DEFAULT_MAX_NGRAM = 4  # vLLM's prompt_lookup_max default is 5, TensorRT-LLM's max_matching_ngram_size 4
DEFAULT_MIN_NGRAM = 2  # a one-token match proposed more than it got accepted on chat answers


class TokenCache:
    """A draft cache of token ids: the `contracts.Cache` operations over a row of ints."""

    def __init__(self, capacity: int):
        self.tokens = np.zeros(capacity, np.int64)
        self.length = 0

    @property
    def capacity(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        self.length = length

    def gather(self, start: int, source_indices: torch.Tensor) -> None:
        """Keep `[0, start)`, then the entries at `source_indices`, in order (a branch commit)."""
        sources = check_gather(self.length, start, source_indices)
        self.tokens[start:start + len(sources)] = self.tokens[sources]
        self.length = start + len(sources)

    def fork(self) -> "TokenCache":
        twin = TokenCache(self.capacity)
        twin.tokens[:self.length] = self.tokens[:self.length]
        twin.length = self.length
        return twin

    def append(self, tokens: np.ndarray) -> None:
        if self.length + len(tokens) > self.capacity:
            raise ValueError(f"a cache of {self.capacity} entries cannot take {len(tokens)} more after {self.length}")
        self.tokens[self.length:self.length + len(tokens)] = tokens
        self.length += len(tokens)

    def release(self) -> None:
        pass


def row_contexts(cache: TokenCache, step: Step) -> list[np.ndarray]:
    """Each row's context, ending at the row's own token: the cache's entries its mask lets
    it see (all of them when causal) in cache order, which is position order along a branch."""
    whole = np.concatenate((cache.tokens[:cache.length], step.tokens.numpy()))
    if step.mask is None:
        return [whole[:row + 1] for row in range(cache.length, len(whole))]
    return [whole[row_mask] for row_mask in step.mask.numpy()]


class NgramDraft(OneSequenceForms):
    """The n-gram draft for `target` (its vocabulary, tokenizer, context and limits)."""

    def __init__(self, target, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max; got min {min_ngram}, max {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokenizer = target.tokenizer
        info = target.info
        self.info = EngineInfo(backend=BACKEND, path=f"{BACKEND}:{min_ngram}-{max_ngram}", vocab_size=info.vocab_size,
                               max_context=info.max_context, eos_token_ids=info.eos_token_ids,
                               bos_token_id=info.bos_token_id, tokenizer_fingerprint=info.tokenizer_fingerprint,
                               limits=info.limits, on_host=True)

    def new_cache(self, capacity: int) -> TokenCache:
        return TokenCache(capacity)

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        return [rows.logits for rows in self.forward_rows(steps)]

    def forward_rows(self, steps: Sequence[Step]) -> list[Rows]:
        return [self._forward(step) for step in steps]

    def _forward(self, step: Step) -> Rows:
        proposals = self.proposals(step)
        own_tokens = step.tokens[-len(proposals):].tolist()
        logits = torch.full((len(proposals), self.info.vocab_size), NOT_PROPOSED)
        columns = [own if proposal is None else proposal for own, proposal in zip(own_tokens, proposals)]
        logits[torch.arange(len(proposals)), torch.tensor(columns)] = 0.0
        return Rows(logits, proposes=proposals[-1] is not None)

    def proposals(self, step: Step) -> list[int | None]:
        """Each row's proposal (its last only for a `last_only` step; None where nothing
        matches), the step's tokens appended to its cache."""
        cache = step.cache
        assert isinstance(cache, TokenCache)  # made by `new_cache`
        contexts = row_contexts(cache, step)
        cache.append(step.tokens.numpy())
        if step.last_only:
            contexts = contexts[-1:]
        return [propose(context, self.max_ngram, self.min_ngram) for context in contexts]

    def verify_batch(self, steps):
        raise TypeError("the n-gram draft proposes tokens; it verifies none")

    def plan_branches(self, scores, draft_tokens, fanout, context_length):
        return plan_branches(scores, draft_tokens, fanout, context_length)
