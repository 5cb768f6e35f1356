"""The draft side of one sequence: ordinary drafting, pre-speculation of likely outcomes,
branch commit.

The speculator owns the sequence's draft KV cache. `cached` lists the tokens whose KV
fills the cache's linear prefix; everything after it (branch entries of a
pre-speculation tree) is scratch. Every call brings the cache in line with the committed
context first, so a round can follow any earlier one: a hit, a miss, or plain
speculative decoding.

`draft` and `prespeculate` are coroutines: each forward they need is yielded as a `Step`
and its logits are sent back, so `lockstep` can run many sequences' steps as one batched
forward while each sequence's code reads as if it ran alone.
"""
from __future__ import annotations

from typing import Generator, Sequence

import torch

from saguaro.plugins.branch_draft.reference import commit_indices, feasible_fanout, step_mask
from saguaro.runtime.contracts import Draft, SpeculationCache, Step
from saguaro.runtime.sampling import SaguaroSampling, SamplingParams, pick_tokens

Forwards = Generator[Step, torch.Tensor, object]  # yields steps, receives their logits


def lockstep(engine, coroutines: Sequence[Forwards]) -> list:
    """Run several sequences' coroutines together: every round of their pending steps is
    one batched forward. Returns each coroutine's result, in order."""
    results, pending = [None] * len(coroutines), {}

    def advance(index: int, logits=None) -> None:
        try:
            pending[index] = coroutines[index].send(logits)
        except StopIteration as finished:
            pending.pop(index, None)
            results[index] = finished.value

    for index in range(len(coroutines)):
        advance(index)
    while pending:
        order = list(pending)
        for index, logits in zip(order, engine.forward_batch([pending[i] for i in order])):
            advance(index, logits)
    return results


def empty_draft(vocab: int, sampling: SamplingParams) -> Draft:
    return Draft(torch.empty(0, dtype=torch.int64), None if sampling.greedy else torch.empty(0, vocab),
                 torch.empty(0, vocab))


class Speculator:
    def __init__(self, engine, sampling: SamplingParams, saguaro: SaguaroSampling | None, capacity: int):
        self.engine, self.sampling, self.saguaro = engine, sampling, saguaro
        self.cache = engine.new_cache(capacity)
        self.cached: list[int] = []

    def release(self) -> None:
        self.cache.release()

    def _feed(self, tokens: list[int], first_position: int) -> Forwards:
        positions = torch.arange(first_position, first_position + len(tokens))
        logits = yield Step(self.cache, torch.tensor(tokens), positions)
        self.cached.extend(tokens)
        return logits[-1]

    def _keep(self, length: int) -> None:
        self.cache.truncate(length)
        del self.cached[length:]

    def _sync(self, ids: list[int]) -> Forwards:
        """Roll the cache back to what it shares with `ids`, feed the rest, return the
        logits that follow `ids` (the last token is re-fed if it was already cached)."""
        shared = 0
        for cached, wanted in zip(self.cached, ids[:-1]):
            if cached != wanted:
                break
            shared += 1
        self._keep(shared)
        return (yield from self._feed(ids[shared:], shared))

    def lag(self, ids: list[int]) -> int:
        """Committed tokens the cache lacks (at most K + 1 after an ordinary round)."""
        return len(ids) - len(self.cached)

    def catch_up(self, ids: list[int]) -> Forwards:
        """Feed the committed tokens the cache lacks, so that the next draft has only the
        newest to feed (a sequence that drafted nothing for a while)."""
        if self.lag(ids) > 0:
            yield from self._sync(ids)

    def draft(self, ids: list[int], k: int) -> Forwards:
        """Ordinary drafting: k tokens from `ids`, one forward each (the last not fed)."""
        if k == 0:
            return empty_draft(self.engine.info.vocab_size, self.sampling)
        logits = yield from self._sync(ids)
        tokens, probs, rows = [], [], []
        for step in range(k):
            token, q = pick_tokens(logits, self.sampling, self.saguaro, torch.tensor(len(ids) + step))
            tokens.append(int(token))
            probs.append(q)
            rows.append(logits)
            if step < k - 1:
                logits = yield from self._feed([tokens[-1]], len(ids) + step)
        return Draft(torch.tensor(tokens), None if self.sampling.greedy else torch.stack(probs),
                     torch.stack(rows))

    def prespeculate(self, ids: list[int], draft: Draft, fanout: torch.Tensor) -> Forwards:
        """While the target verifies `draft` (K tokens): draft K tokens for each likely
        outcome (j, t), all branches advancing together in one tree forward per step."""
        k, context_length = len(draft), len(ids)
        self._keep(context_length + k - 1)  # the round may verify fewer drafts than were drafted
        fanout = feasible_fanout(torch.as_tensor(fanout, dtype=torch.int64), self.engine.info.vocab_size)
        glue = yield from self._feed([int(draft.tokens[-1])], context_length + k - 1)
        scores = torch.cat((draft.logits, glue.unsqueeze(0)))
        plan = self.engine.plan_branches(scores, draft.tokens, fanout, context_length)
        branches = plan.branches
        fed, step_probs, step_logits = [plan.token], [], []
        for step in range(k):
            mask = step_mask(plan.window_mask, context_length, step, branches, k)
            logits = yield Step(self.cache, fed[-1], plan.positions[step], mask)
            tokens, q = pick_tokens(logits, self.sampling, self.saguaro, plan.positions[step] + 1)
            fed.append(tokens)
            step_logits.append(logits)
            step_probs.append(q)
        drafted = torch.stack(fed[1:], dim=1)  # [B, K]: e_1..e_K of each branch
        logits = torch.stack(step_logits, dim=1)
        probs = None if self.sampling.greedy else torch.stack(step_probs, dim=1)
        drafts = [Draft(drafted[b], None if probs is None else probs[b], logits[b]) for b in range(branches)]
        keys = {(int(j), int(t)): b for b, (j, t) in enumerate(zip(plan.depth, plan.token))}
        return SpeculationCache(keys, drafts, scores, context_length)

    def adopt(self, new_ids: list[int], speculation: SpeculationCache, branch: int) -> Draft:
        """A hit: the branch's KV (its key token and K-1 drafts) joins the committed prefix."""
        k = len(speculation.drafts[branch])
        accepted = len(new_ids) - 1 - speculation.context_length
        sources = commit_indices(speculation.context_length, k, len(speculation.drafts), branch, k)
        self.cache.gather(speculation.context_length + accepted, sources)
        draft = speculation.drafts[branch]
        self.cached = list(new_ids) + draft.tokens[:-1].tolist()
        return draft
