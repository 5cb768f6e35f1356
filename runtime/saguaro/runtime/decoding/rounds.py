"""What a round's outcome means for the draft side, and that side driven alone.

`take_speculation` is the step every loop shares once a round's outcome `(accepted,
bonus)` is known: it tells the fan-out policy what the round showed, counts the hit or
the miss, and on a hit commits the pre-speculated branch, whose draft is the next one
(zero draft latency). `decoding.Sequence` calls it for each sequence of a batch.

`DraftRounds` is the draft side of one request for a loop that verifies somewhere else
(the TensorRT-LLM drafter lets TensorRT-LLM's executor verify): the first draft; while
the target verifies, pre-speculation of the round's likely outcomes in the draft worker;
then the next draft, from the speculation cache or drafted the ordinary way. Without
pre-speculation this is plain speculative drafting.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future

from saguaro.runtime.control.budget import bonus_rank
from saguaro.runtime.core.contracts import Draft, SpeculationCache, VerifyResult
from saguaro.runtime.core.stats import GenerationStats, timed
from saguaro.runtime.decoding.gil import beside_the_target
from saguaro.runtime.decoding.speculator import Speculator, lockstep


def take_speculation(speculator: Speculator, fanout_policy, stats: GenerationStats, ids: list[int], drafted,
                     speculation: SpeculationCache, outcome: VerifyResult) -> Draft | None:
    """After `outcome` (with `ids` now committed): the hit branch's draft, or None on a miss."""
    stats.branches_drafted += len(speculation.drafts)
    fanout_policy.observe(outcome.accepted, bonus_rank(speculation.scores, drafted, outcome.accepted, outcome.bonus))
    branch = speculation.lookup(outcome.accepted, outcome.bonus)
    if branch is None:
        stats.cache_misses += 1
        return None
    stats.cache_hits += 1
    return speculator.adopt(list(ids), speculation, branch)


class DraftRounds:
    def __init__(self, speculator: Speculator, k: int, fanout_policy, stats: GenerationStats, worker: Executor,
                 prespeculating: bool):
        self.speculator, self.k, self.fanout_policy, self.stats, self.worker = speculator, k, fanout_policy, stats, worker
        self.prespeculating = prespeculating
        self._pending: Future | None = None
        self._speculation: SpeculationCache | None = None

    def _alone(self, coroutine):
        return lockstep(self.speculator.engine, [coroutine])[0]

    def draft(self, ids) -> Draft:
        """An ordinary draft from `ids`, on the critical path (the first one, and misses)."""
        with timed(self.stats, "draft_s"):
            matched = self.speculator.match(list(ids), self.k)
            return matched or self.worker.submit(self._alone, self.speculator.draft(list(ids), self.k)).result()

    def prespeculate(self, ids, proposal: Draft) -> None:
        """Start pre-speculating the outcomes of verifying `proposal` after `ids` (not of
        n-gram matches, which the draft model's cache has not seen)."""
        if self.prespeculating and not proposal.matched:
            self._pending = self.worker.submit(beside_the_target, self._prespeculate, list(ids), proposal)

    def _prespeculate(self, ids, proposal: Draft) -> SpeculationCache:
        """Runs in the worker, so even choosing the fan-out stays off the critical path."""
        with timed(self.stats, "prespeculate_s") as elapsed:
            speculation = self._alone(self.speculator.prespeculate(ids, proposal, self.fanout_policy.fanout()))
        speculation.seconds = elapsed.seconds
        return speculation

    def collect(self) -> SpeculationCache | None:
        """The round's pre-speculation, waited for (the time the target spent idle)."""
        with timed(self.stats, "wait_s"):
            self._speculation = self._pending.result() if self._pending else None
        self._pending = None
        return self._speculation

    def next_draft(self, ids, proposal: Draft, outcome: VerifyResult) -> Draft:
        """After `outcome` (with `ids` now committed): the cached branch on a hit, else a new draft."""
        self.speculator.observe_round(list(ids), proposal, outcome.accepted)
        speculation, self._speculation = self._speculation, None
        if speculation is not None:
            hit = self.worker.submit(take_speculation, self.speculator, self.fanout_policy, self.stats, ids,
                                     proposal.tokens, speculation, outcome).result()
            if hit is not None:
                return hit
        return self.draft(ids)
