"""The draft side of SSD rounds, for any loop that verifies somewhere else.

`DraftRounds` drives the speculator in the draft worker thread: the first draft; while
the target verifies a draft, pre-speculation of the round's likely outcomes; and once
the outcome `(accepted, bonus)` is known, the next draft: a hit in the speculation cache
commits the pre-speculated branch (zero draft latency), a miss drafts the ordinary way.
It tells the fan-out policy what each round showed and keeps the round's figures.

`decoding.speculative_decode` verifies with its own `Verifier` between `prespeculate`
and `next_draft`; the TensorRT-LLM drafter lets TensorRT-LLM's executor verify there.
Without pre-speculation this is plain speculative drafting.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future

from saguaro.runtime.budget import bonus_rank
from saguaro.runtime.contracts import Draft, SpeculationCache, VerifyResult
from saguaro.runtime.speculator import Speculator
from saguaro.runtime.stats import GenerationStats, timed


class DraftRounds:
    def __init__(self, speculator: Speculator, policy, stats: GenerationStats, worker: Executor,
                 prespeculating: bool):
        self.speculator, self.policy, self.stats, self.worker = speculator, policy, stats, worker
        self.prespeculating = prespeculating
        self._pending: Future | None = None
        self._speculation: SpeculationCache | None = None

    def draft(self, ids) -> Draft:
        """An ordinary draft from `ids`, on the critical path (the first one, and misses)."""
        with timed(self.stats, "draft_s"):
            return self.worker.submit(self.speculator.draft, tuple(ids)).result()

    def prespeculate(self, ids, proposal: Draft) -> None:
        """Start pre-speculating the outcomes of verifying `proposal` after `ids`."""
        if self.prespeculating:
            self._pending = self.worker.submit(self._prespeculate, tuple(ids), proposal)

    def _prespeculate(self, ids, proposal: Draft) -> SpeculationCache:
        """Runs in the worker, so even choosing the fan-out stays off the critical path."""
        with timed(self.stats, "prespeculate_s") as elapsed:
            speculation = self.speculator.prespeculate(ids, proposal, self.policy.fanout())
        speculation.seconds = elapsed.seconds
        return speculation

    def collect(self) -> SpeculationCache | None:
        """The round's pre-speculation, waited for (the time the target spent idle)."""
        with timed(self.stats, "wait_s"):
            self._speculation = self._pending.result() if self._pending else None
        self._pending = None
        return self._speculation

    def next_draft(self, ids, proposal: Draft, outcome: VerifyResult, verify_seconds: float) -> Draft:
        """After `outcome` (with `ids` now committed): the cached branch on a hit, else a new draft."""
        speculation, self._speculation = self._speculation, None
        hit = speculation.lookup(outcome.accepted, outcome.bonus) if speculation else None
        if speculation:
            self.stats.branches_drafted += len(speculation.drafts)
            self.policy.observe(outcome.accepted, bonus_rank(speculation.scores, proposal.tokens,
                                                             outcome.accepted, outcome.bonus))
            self.policy.observe_timing(verify_seconds, speculation.seconds)
        if hit is not None:
            self.stats.cache_hits += 1
            return self.worker.submit(self.speculator.adopt, tuple(ids), speculation, hit).result()
        self.stats.cache_misses += speculation is not None
        return self.draft(ids)
