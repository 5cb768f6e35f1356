"""The draft side of one sequence: ordinary drafting, pre-speculation of likely outcomes,
branch commit.

The speculator owns the sequence's draft KV cache. `cached` lists the tokens whose KV
fills the cache's linear prefix; everything after it (branch entries of a
pre-speculation tree) is scratch. Every call brings the cache in line with the committed
context first, so a round can follow any earlier one: a hit, a miss, or plain
speculative decoding.

`draft` and `prespeculate` are coroutines: each forward they need is yielded as a `Step`
and its rows (`Rows`: logits, and a feature draft's own features) are sent back, so
`lockstep` can run many sequences' steps as one batched forward while each sequence's
code reads as if it ran alone.

A feature draft (EAGLE-3) reads, beside each token, the feature of the position before it
(`DraftFeatures`): the target's, once its rows return them (the prefill, each round's
outcome), else its own prediction. Drafts run on its own predictions past the committed
context, and so do pre-speculated branches (the target's features for the accepted
prefix come only with the verify they run under); on the next sync, entries fed with
predicted features are fed again with the target's. Every draft is still verified
against the q it was sampled from, so which features a draft read changes acceptance
only, never the output.

With n-gram matches leading the model (draft method "ngram+model"), `match` drafts a round
from the sequence's own tokens where they propose its first token and the matches have
been accepted at least as often as the model's drafts (`LeadChoice`); such a round runs no
forward of the model and pre-speculates nothing, and the cache catches up later.
"""
from __future__ import annotations

import time
from typing import Generator, Sequence, TypeVar, cast

import numpy as np
import torch

from saguaro.plugins.branch_draft.reference import commit_indices, feasible_fanout, step_mask
from saguaro.runtime.core.contracts import Draft, Rows, SpeculationCache, Step
from saguaro.runtime.core.ngram import matched_chain
from saguaro.runtime.core.sampling import SaguaroSampling, SamplingParams, pick_tokens

_R = TypeVar("_R")
Forwards = Generator[Step, Rows, _R]  # yields steps, receives their rows, returns an _R


def lockstep(engine, coroutines: Sequence[Forwards], forward_seconds: list[float] | None = None) -> list:
    """Run several sequences' coroutines together: every round of their pending steps is
    one batched forward. Returns each coroutine's result, in order; appends each forward's
    seconds to `forward_seconds` when given."""
    results, pending = [None] * len(coroutines), {}

    def advance(index: int, rows=None) -> None:
        try:
            pending[index] = coroutines[index].send(rows)
        except StopIteration as finished:
            pending.pop(index, None)
            results[index] = finished.value

    for index in range(len(coroutines)):
        advance(index)
    while pending:
        order = list(pending)
        started = time.perf_counter()
        batch_rows = engine.forward_rows([pending[i] for i in order])
        if forward_seconds is not None:
            forward_seconds.append(time.perf_counter() - started)
        for index, rows in zip(order, batch_rows):
            advance(index, rows)
    return results


def empty_draft(vocab: int, sampling: SamplingParams, stopped: bool = False) -> Draft:
    return Draft(torch.empty(0, dtype=torch.int64), None if sampling.greedy else torch.empty(0, vocab),
                 torch.empty(0, vocab), stopped=stopped)


class DraftFeatures:
    """The target's features of the committed positions, as a feature draft reads them
    (projected), and how many leading draft-cache entries were fed with them (`exact`).
    They are projected when a draft first needs them, all at once: while the load policy
    drafts nothing a request's features pile up, and projecting each round's on arrival
    had cost an engine call per request per round (a twentieth of a round at 4 streams)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.known: list[torch.Tensor] = []      # by position: the target's projected feature
        self.unprojected: list[np.ndarray] = []  # the target's features of the positions after those
        self.exact = 0

    def observe(self, first_position: int, features: torch.Tensor | np.ndarray) -> None:
        """The target's features `[n, width]` of positions `first_position..` (kept as numpy
        rows: a round without drafts observes them with no torch call, see
        `OnnxRuntimeEngine.verify_batch`)."""
        if first_position < len(self.known):
            del self.known[first_position:]
            self.unprojected.clear()
        del self.unprojected[first_position - len(self.known):]
        rows = features.numpy() if isinstance(features, torch.Tensor) else features
        self.unprojected.extend(np.array(rows, np.float32))  # copied: not views that hold their whole batch's rows

    def before(self, first_position: int, count: int) -> torch.Tensor:
        """For tokens at `first_position..+count`: the features of the positions before
        them (zeros before position 0, which has none)."""
        reach = len(self.known) + len(self.unprojected)
        if first_position + count - 2 >= reach:
            raise RuntimeError(f"the target's features reach position {reach - 1}; a feature draft "
                               f"feeding positions up to {first_position + count - 1} needs those before them")
        if self.unprojected:
            self.known.extend(self.engine.project(torch.from_numpy(np.stack(self.unprojected))))
            self.unprojected.clear()
        zero = torch.zeros(self.engine.hidden_size)
        return torch.stack([self.known[p - 1] if p > 0 else zero for p in range(first_position, first_position + count)])


LEAD_FADING = 0.9  # the weight a round's measurement keeps after each later one of its kind


class LeadChoice:
    """Whether n-gram matches lead a sequence's rounds (`EngineInfo.ngram_lead`): while
    their proposals are accepted at least as often per token as the model's drafts. The
    model's rate is measured on the rounds it drafts; the matches' on every round where
    one was found, led or not, against the tokens the round committed (what a match
    would have had accepted of them). Both fade, start from one token accepted of two,
    and a tie goes to the matches, which cost no forward."""

    def __init__(self):
        self.accepted = {True: 1.0, False: 1.0}  # by source: matched?
        self.verified = {True: 2.0, False: 2.0}

    def observe(self, matched: bool, verified: int, accepted: int) -> None:
        if verified:
            self.accepted[matched] = LEAD_FADING * self.accepted[matched] + accepted
            self.verified[matched] = LEAD_FADING * self.verified[matched] + verified

    def rate(self, matched: bool) -> float:
        return self.accepted[matched] / self.verified[matched]

    @property
    def matches_lead(self) -> bool:
        return self.rate(True) >= self.rate(False)


class Speculator:
    def __init__(self, engine, sampling: SamplingParams, saguaro: SaguaroSampling | None, capacity: int):
        self.engine, self.sampling, self.saguaro = engine, sampling, saguaro
        self.cache = engine.new_cache(capacity)
        self.cached: list[int] = []
        self.features = DraftFeatures(engine) if engine.info.reads_features else None
        self.lead = LeadChoice()
        self._found: tuple[int, list[int]] | None = None  # this round's match: (context length, its chain)
        # rounds a match drafted, of the rounds one was asked for (fading as `LeadChoice`;
        # from one in two), for the load policy's price of matches (`match_rate`)
        self._matched_rounds, self._asked_rounds = 1.0, 2.0

    def release(self) -> None:
        self.cache.release()

    def observe_features(self, first_position: int, features: torch.Tensor | None) -> None:
        """The target's features of committed positions from `first_position` (its rows)."""
        if self.features is not None and features is not None:
            self.features.observe(first_position, features)

    def _feed(self, tokens: list[int], first_position: int, hidden: torch.Tensor | None = None) -> Forwards[Rows]:
        positions = torch.arange(first_position, first_position + len(tokens))
        rows = yield Step(self.cache, torch.tensor(tokens), positions, hidden=hidden, last_only=True)
        self.cached.extend(tokens)
        return Rows(rows.logits[-1], None if rows.hidden is None else rows.hidden[-1], rows.proposes)

    def _keep(self, length: int) -> None:
        self.cache.truncate(length)
        del self.cached[length:]
        if self.features is not None:
            self.features.exact = min(self.features.exact, length)

    def _sync(self, ids: list[int]) -> Forwards[Rows]:
        """Roll the cache back to what it shares with `ids` (for a feature draft: what was
        fed the target's features), feed the rest, return the rows that follow `ids` (the
        last token is re-fed if it was already cached)."""
        shared = 0
        for cached, wanted in zip(self.cached, ids[:-1]):
            if cached != wanted:
                break
            shared += 1
        if self.features is not None:
            shared = min(shared, self.features.exact)
        self._keep(shared)
        hidden = None if self.features is None else self.features.before(shared, len(ids) - shared)
        rows = yield from self._feed(ids[shared:], shared, hidden)
        if self.features is not None:
            self.features.exact = len(ids)
        return rows

    def lag(self, ids: list[int]) -> int:
        """Committed tokens the cache lacks (at most K + 1 after an ordinary round)."""
        return len(ids) - len(self.cached)

    def catch_up(self, ids: list[int], most: int | None = None) -> Forwards[None]:
        """Feed the committed tokens the cache lacks (the oldest `most` of them when given),
        so that the next draft has only the newest to feed (a sequence that drafted nothing
        for a while)."""
        lag = self.lag(ids)
        if lag > 0:
            yield from self._sync(ids if most is None or most >= lag else ids[:len(ids) - lag + most])

    def match(self, ids: list[int], k: int) -> Draft | None:
        """A round led by n-gram matching (`EngineInfo.ngram_lead`): where the sequence's own
        tokens propose its next one, the chain of such proposals, up to k, with no forward
        of the model (its cache catches up later, as after rounds that drafted nothing);
        None where nothing proposes the first token, and the model drafts."""
        lead = self.engine.info.ngram_lead
        if lead is None or k == 0:
            return None
        tokens = matched_chain(np.asarray(ids), k, *lead)
        self._found = (len(ids), tokens) if tokens else None
        leads = bool(tokens) and self.lead.matches_lead
        self._matched_rounds = LEAD_FADING * self._matched_rounds + leads
        self._asked_rounds = LEAD_FADING * self._asked_rounds + 1
        if not leads:
            return None
        chain = torch.tensor(tokens)
        # q is one-hot: verification accepts a sampled proposal x with probability p(x)
        probs = None
        if not self.sampling.greedy:
            probs = torch.zeros(len(tokens), self.engine.info.vocab_size)
            probs[torch.arange(len(tokens)), chain] = 1.0
        # no logits: only branch keys read a draft's, and no branches grow from a match
        # (a [K, V] tensor of them had cost a round of 4 streams a tenth of a millisecond)
        return Draft(chain, probs, torch.empty(len(tokens), 0), stopped=len(tokens) < k, matched=True)

    @property
    def match_rate(self) -> float:
        """How often a round asked for a match got one (found, and leading)."""
        return self._matched_rounds / self._asked_rounds

    def observe_round(self, ids: list[int], draft: Draft, accepted: int) -> None:
        """After a round that verified `draft` and committed up to `ids`: what each source
        had accepted, for `LeadChoice` (nothing to weigh for a draft without an n-gram lead)."""
        if self.engine.info.ngram_lead is None:
            return
        if not draft.matched:  # per token drafted until the first rejection, as for the matches below
            self.lead.observe(False, min(accepted + 1, len(draft)), accepted)
        if self._found is not None:
            start, chain = self._found
            committed = ids[start:]
            agreed = next((i for i, (a, b) in enumerate(zip(chain, committed)) if a != b), min(len(chain), len(committed)))
            # a token past what the round committed is not known to be right or wrong
            self.lead.observe(True, agreed if agreed == len(committed) else min(agreed + 1, len(chain)), agreed)
            self._found = None

    def draft(self, ids: list[int], k: int) -> Forwards[Draft]:
        """Ordinary drafting: k tokens from `ids`, one forward each (the last not fed); a
        feature draft feeds each token with its own feature of the row before. Fewer where
        the draft stops proposing (`Rows.proposes`), none if it proposes nothing."""
        if k == 0:
            return empty_draft(self.engine.info.vocab_size, self.sampling)
        rows = yield from self._sync(ids)
        tokens, probs, drafted_from = [], [], []
        for step in range(k):
            if not rows.proposes:
                break
            token, q = pick_tokens(rows.logits, self.sampling, self.saguaro, torch.tensor(len(ids) + step))
            tokens.append(int(token))
            probs.append(q)
            drafted_from.append(rows)
            if step < k - 1:
                rows = yield from self._feed([tokens[-1]], len(ids) + step, own_feature(rows))
        stopped = len(tokens) < k
        if not tokens:
            return empty_draft(self.engine.info.vocab_size, self.sampling, stopped)
        # present where read: each q when sampling, each row's hidden from a feature draft
        hidden = None if self.features is None else torch.stack(cast("list[torch.Tensor]", [r.hidden for r in drafted_from]))
        return Draft(torch.tensor(tokens), None if self.sampling.greedy else torch.stack(cast("list[torch.Tensor]", probs)),
                     torch.stack([r.logits for r in drafted_from]), hidden, stopped)

    def prespeculate(self, ids: list[int], draft: Draft, fanout: torch.Tensor) -> Forwards[SpeculationCache]:
        """While the target verifies `draft` (K tokens): draft K tokens for each likely
        outcome (j, t), all branches advancing together in one tree forward per step."""
        k, context_length = len(draft), len(ids)
        self._keep(context_length + k - 1)  # the round may verify fewer drafts than were drafted
        fanout = feasible_fanout(torch.as_tensor(fanout, dtype=torch.int64), self.engine.info.vocab_size)
        glue = yield from self._feed([int(draft.tokens[-1])], context_length + k - 1,
                                     None if draft.hidden is None else draft.hidden[-1:])
        scores = torch.cat((draft.logits, glue.logits.unsqueeze(0)))
        plan = self.engine.plan_branches(scores, draft.tokens, fanout, context_length)
        branches = plan.branches
        # a feature draft's branch (j, t) starts from its own feature of row j (its rows, the glue's too, carry one)
        hidden = None if draft.hidden is None else torch.cat((draft.hidden, cast(torch.Tensor, glue.hidden)[None]))[plan.depth]
        fed, step_probs, step_logits, step_hidden = [plan.token], [], [], []
        for step in range(k):
            mask = step_mask(plan.window_mask, context_length, step, branches, k)
            rows = yield Step(self.cache, fed[-1], plan.positions[step], mask, hidden)
            tokens, q = pick_tokens(rows.logits, self.sampling, self.saguaro, plan.positions[step] + 1)
            fed.append(tokens)
            step_logits.append(rows.logits)
            step_probs.append(q)
            step_hidden.append(hidden := rows.hidden)
        drafted = torch.stack(fed[1:], dim=1)  # [B, K]: e_1..e_K of each branch
        logits = torch.stack(step_logits, dim=1)
        probs = None if self.sampling.greedy else torch.stack(cast("list[torch.Tensor]", step_probs), dim=1)
        hidden = None if draft.hidden is None else torch.stack(cast("list[torch.Tensor]", step_hidden), dim=1)
        drafts = [Draft(drafted[b], None if probs is None else probs[b], logits[b],
                        None if hidden is None else hidden[b]) for b in range(branches)]
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


def own_feature(rows: Rows) -> torch.Tensor | None:
    """A feature draft's prediction for the row's position, as the next token's input."""
    return None if rows.hidden is None else rows.hidden[None]
