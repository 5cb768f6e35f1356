"""The decoding loop: rounds of speculative decoding over a batch of sequences, with the
draft pre-speculating every sequence's likely outcomes while the target verifies.

`Decoder.decode_round` is the whole algorithm (docs/design.md section 1), for every active
sequence at once: the draft worker (a thread of its own, on its own core) pre-speculates
while the target verifies every sequence's `[last, d_1..d_K]` in one batched forward; on
a hit the next draft is ready, the misses are drafted together the ordinary way. A
sequence without pre-speculation is plain speculative decoding; with K = 0 it drafts
nothing and each round is one autoregressive step. Before each round the load policy
chooses every sequence's K for the round (up to its request's) and the branches it may
pre-speculate (`load_policy`). Sequences join and leave between rounds, and nothing a
sequence computes depends on the others in its batch. A round in which no sequence
pre-speculates has nothing of the draft's running beside the verification (its drafts,
if any, were made before it), so the target verifies alone, on the draft's core as well
(`run_alone`).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from typing import Sequence as Seq

from saguaro.runtime.control.acceptance import Acceptance
from saguaro.runtime.control.load_policy import LoadPolicy
from saguaro.runtime.control.round_report import Plan, RoundReport, SequenceRound, undrafted_reason, verify_size
from saguaro.runtime.core.contracts import (
    Draft,
    RequestTarget,
    Rows,
    SpeculationCache,
    VerifyResult,
    VerifyStep,
    draft_cache_capacity,
)
from saguaro.runtime.core.stats import GenerationStats, stopwatch
from saguaro.runtime.decoding.gil import beside_the_target
from saguaro.runtime.decoding.requests import Generation, Output, Request, finish
from saguaro.runtime.decoding.rounds import take_speculation
from saguaro.runtime.decoding.speculator import Speculator, empty_draft, lockstep
from saguaro.runtime.decoding.verifier import Verifier


class Sequence:
    """One request's decoding state between rounds."""

    def __init__(self, request: Request, target, draft):
        options = request.options
        self.request, self.k = request, options.draft_tokens
        self.stats = GenerationStats(options.mode, self.k)
        self.out = Output(request, target.info.max_context)
        self.fanout_policy = options.fanout_policy(draft.info.max_branches)
        self.prespeculating = options.prespeculating
        # K follows the load policy: a request that did not pin it, greedy or sampled. A
        # sampled request's output is distributed as the target's for every K, but K changes
        # which tokens a seed draws: its seed replays exactly when the same K are chosen, as
        # with K pinned (`adapt_k` off: `--fixed-k`, or a request that names its K).
        self.adapts = options.adapts
        # its pre-speculation follows the load policy (on or off, how many branches): a
        # request that lets the policy choose its K, or that asked for an "auto" budget
        self.steered = options.steered
        # (kept, not derived each time: the policy reads them of every request every round)
        self.verifier = Verifier(target, request.sampling, self.k)
        self.speculator: Speculator | None = None
        if self.k > 0:
            branches = self.fanout_policy.max_branches if self.prespeculating else 0
            self.speculator = Speculator(draft, request.sampling, options.saguaro(request.sampling),
                                         draft_cache_capacity(target.info.max_context, branches, self.k))
        self.empty = empty_draft(draft.info.vocab_size, request.sampling)
        self.proposal: Draft | None = None if self.k else self.empty
        self.after_hit = False  # the proposal is a hit's pre-speculated branch
        self.greedy, self.acceptance = request.sampling.greedy, Acceptance()
        self.matched_acceptance = Acceptance()  # of its n-gram matches' rounds (`EngineInfo.ngram_lead`)
        self.plan = Plan(self.k)  # the load policy's, each round
        self.verified = 0               # drafts the last round verified
        self.asked = 0                  # ... and the drafts it asked for that the draft could have proposed
        self.started = time.perf_counter()
        if request.on_start is not None:
            request.on_start(self.stats)

    @property
    def done(self) -> bool:
        return self.out.finish_reason is not None

    def check_cancelled(self) -> None:
        if not self.done and self.request.cancelled():
            self.out.finish_reason = "cancelled"

    @property
    def room(self) -> int:
        return self.out.room

    @property
    def round_draft_tokens(self) -> int:
        """Drafts the coming round verifies: the plan's K, what was drafted, and what fits."""
        assert self.proposal is not None  # asked once the round has its draft (`Decoder.draft_misses`)
        return max(0, min(self.plan.draft_tokens, len(self.proposal), self.out.room - 1))

    @property
    def round_proposal(self) -> Draft:
        assert self.proposal is not None  # as in `round_draft_tokens`
        return self.proposal.prefix(self.round_draft_tokens)

    def prepare(self, plan: Plan) -> None:
        """Take the round's plan. A sequence without a draft yet (the last round drafted
        none, or its speculation missed) takes an n-gram match where one leads
        (`Speculator.match`), of the K the policy priced for matches (`Plan.matched_tokens`)
        or, K pinned, of its own, and the round's plan drafts that; else, if the plan
        drafts, it is left without a proposal, for `Decoder.draft_misses`; else it gets the
        empty draft. Not in a probe, which measures the model."""
        self.plan = plan
        if self.speculator is not None and (self.proposal is None or not len(self.proposal)):
            k = plan.matched_tokens if self.adapts else plan.draft_tokens
            matched = None if plan.probe or not k else self.drafter.match(self.out.ids, k)
            if matched is not None:
                self.plan = replace(plan, draft_tokens=k, undrafted=None)
                self.proposal = matched
            else:
                self.proposal = None if plan.draft_tokens else self.empty

    @property
    def may_match(self) -> bool:
        """Its rounds may be drafted by n-gram matches (`EngineInfo.ngram_lead`)."""
        return self.speculator is not None and self.speculator.engine.info.ngram_lead is not None

    @property
    def match_rate(self) -> float:
        """How often a round asked for a match got one (`Speculator.match_rate`)."""
        return self.speculator.match_rate if self.speculator is not None else 0.0

    @property
    def drafter(self) -> Speculator:
        """The speculator, of a sequence that drafts (K > 0: the ones the rounds draft for)."""
        assert self.speculator is not None
        return self.speculator

    @property
    def draft_lag(self) -> int:
        """Committed tokens its draft cache lacks, to be fed before it drafts again (0
        without a draft, or with a pre-speculated draft ready): a prompt the draft has not
        seen, or the tokens of a stretch of rounds that drafted nothing."""
        if self.speculator is None or (self.proposal is not None and len(self.proposal)):
            return 0
        return max(0, self.speculator.lag(self.out.ids))

    @property
    def matched(self) -> bool:
        """The round's drafts are n-gram matches (read off the proposal: its prefix, the
        round's, is a copy made for the verification)."""
        assert self.proposal is not None  # as in `round_draft_tokens`
        return self.proposal.matched

    @property
    def draft_lags(self) -> bool:
        """Drafts nothing with the model this round (nothing, or an n-gram match) and its
        draft cache lacks committed tokens."""
        return (self.speculator is not None and (not self.plan.draft_tokens or self.matched)
                and self.speculator.lag(self.out.ids) > 0)

    @property
    def speculates(self) -> bool:
        """Pre-speculates this round: an ssd sequence with drafts to verify that the draft
        model drafted (not n-gram matches alone)."""
        return (self.prespeculating and self.plan.prespeculate and self.plan.draft_tokens > 0
                and self.round_draft_tokens > 0 and not self.matched)

    def verification(self) -> VerifyStep:
        self.verified = self.round_draft_tokens
        assert self.proposal is not None  # as in `round_draft_tokens`
        # a draft that stopped short of the round's K proposed nothing at the next depth
        self.asked = self.verified + (self.proposal.stopped and self.verified == len(self.proposal)
                                      and self.verified < min(self.plan.draft_tokens, self.out.room - 1))
        return self.verifier.round(self.out.ids, self.proposal, self.verified, self.request.logprobs is not None)

    def commit(self, outcome: VerifyResult, speculation: SpeculationCache | None) -> bool | None:
        """The round's outcome: keep it, then look it up among the pre-speculated drafts
        (returns whether the lookup hit; None without one)."""
        proposal = self.round_proposal
        drafted = proposal.tokens
        self.verifier.keep(self.out.ids, outcome)
        self.stats.record_round(outcome.accepted, len(drafted), self.plan.probe, speculation is not None,
                                self.after_hit)
        self.observe_features(len(self.out.ids) - 1, outcome.hidden)
        self.out.commit(drafted.tolist()[:outcome.accepted] + [outcome.bonus], outcome.logprobs)
        if self.speculator is not None:
            self.speculator.observe_round(self.out.ids, proposal, outcome.accepted)
        self.proposal = None if self.speculator is not None else self.empty
        self.after_hit = False
        if self.done or speculation is None:
            return None
        self.proposal = take_speculation(self.drafter, self.fanout_policy, self.stats, self.out.ids, drafted,
                                         speculation, outcome)
        self.after_hit = self.proposal is not None
        return self.after_hit

    def take_first_token(self, prompt_rows: Rows) -> None:
        """The prefill's rows: the prompt's features, and the first token its last row scores."""
        self.observe_features(0, prompt_rows.hidden)
        first = self.verifier.first_token(self.out.ids, self.empty, prompt_rows.logits, self.request.logprobs is not None)
        self.out.commit([first.bonus], first.logprobs)

    def observe_features(self, first_position: int, hidden) -> None:
        """The target's hidden states of committed positions, for a feature draft."""
        if self.speculator is not None:
            self.speculator.observe_features(first_position, hidden)

    def finish(self) -> Generation:
        for side in (self.verifier.cache, self.speculator):
            if side is not None:
                side.release()
        return finish(self.out, self.stats, self.started, self.request.sampling.seed)


def prespeculation_measured(batch: list[Sequence], speculations: list[SpeculationCache]):
    """`(branch rows, steps, seconds)` of a round's pre-speculation, None without any."""
    if not batch:
        return None
    rows = sum(len(speculation.drafts) for speculation in speculations)
    return rows, max(s.round_draft_tokens for s in batch) + 1, speculations[0].seconds


class Decoder:
    """The target, the draft and the draft's worker thread; runs rounds over batches."""

    def __init__(self, target, draft, alone: bool = True):
        """`alone` False: other decoders share the engines, so the target never runs alone."""
        self.target, self.draft, self.alone = target, draft, alone
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="draft")
        self.load_policy = LoadPolicy(target, draft, alone)
        self._round_started: float | None = None  # the last round's start, unless requests joined since
        if alone and not isinstance(target, RequestTarget):  # a request target decodes on its own
            # the target's wide session opened at load (SmolLM2 int8: 0.24 s), not in the
            # first request's time to first token
            with target.run_alone():
                pass

    def close(self) -> None:
        self.worker.shutdown(wait=True)

    def start(self, requests: Seq[Request]) -> list[Sequence]:
        """New sequences: the target prefills their prompts (one batched forward, on both
        cores where it may run alone: nothing of the draft's runs between rounds); the
        draft drafts their first proposals in their first round, as the policy plans it."""
        if any(request.options.steered for request in requests):
            self.load_policy.calibrate()
        sequences = [Sequence(request, self.target, self.draft) for request in requests]
        self._round_started = None  # the period until the next round holds this prefill: no round's own
        with stopwatch() as prefilling, self.target.run_alone() if self.alone else nullcontext():
            rows = self.target.forward_rows([s.verifier.prefill(s.request.prompt_ids) for s in sequences])
        for sequence, prompt_rows in zip(sequences, rows):
            sequence.stats.prefill_s += prefilling.seconds
            sequence.take_first_token(prompt_rows)
        return sequences

    def decode_round(self, batch: list[Sequence]) -> RoundReport:
        """One round for every sequence of the batch (docs/design.md section 1), timed: what
        the forwards and waits leave over is the round's host work. The load policy gets
        the round's report, and the last round's period (from its start to this one's)."""
        started = time.perf_counter()
        if self._round_started is not None:
            self.load_policy.observe_period(started - self._round_started)
        self._round_started = started
        with stopwatch() as whole:
            report = self._round(batch)
        report.host_s = whole.seconds - report.verify_s - report.wait_s - report.draft_s
        self.load_policy.observe_round(report)
        return report

    def _round(self, batch: list[Sequence]) -> RoundReport:
        """The round itself: plan, draft what is missing, verify while the worker
        pre-speculates, commit."""
        for sequence, plan in zip(batch, self.load_policy.choose(batch)):
            sequence.prepare(plan)
        drafting_s, drafting, caught_up = self.draft_misses(batch)
        speculating = [s for s in batch if s.speculates]
        steps = [s.verification() for s in batch]  # before the worker starts: it competes for the GIL
        tokens = verify_size([len(step.step.tokens) for step in steps], self.target.info.pads_rows)
        alone = self.alone and not speculating and self.load_policy.sessions.runs_alone(tokens)
        # no hand-off to the worker for nothing: waking it costs a tiny engine's round a tenth
        pending = speculating and self.worker.submit(beside_the_target, self.prespeculate, speculating)
        # the draft's core is free while a round without pre-speculation verifies on its own
        # core: sequences that draft nothing bring their draft caches up to date meanwhile,
        # so that a probe, or speculation coming back, has only the newest tokens to feed
        lagging = [] if alone or speculating or not self.load_policy.catches_up else [s for s in batch if s.draft_lags]
        share = lagging and self.load_policy.catch_up_share(tokens, len(lagging))
        catching = share and self.worker.submit(beside_the_target, lockstep, self.draft,
                                                [s.drafter.catch_up(s.out.ids, share) for s in lagging])
        with stopwatch() as verifying, self.target.run_alone() if alone else nullcontext():
            outcomes = self.target.verify_batch(steps)
        with stopwatch() as waiting:
            speculations = dict(zip(map(id, speculating), pending.result())) if pending else {}
            if catching:
                catching.result()
        report = RoundReport(len(batch), tokens, verifying.seconds, alone, waiting.seconds, drafting_s, drafting,
                             prespeculation_measured(speculating, list(speculations.values())),
                             undrafted=undrafted_reason([sequence.plan for sequence in batch]), caught_up=caught_up)
        for sequence, outcome in zip(batch, outcomes):
            sequence.stats.verify_s += verifying.seconds
            sequence.stats.wait_s += waiting.seconds
            verified, matched = sequence.verified, sequence.verified > 0 and sequence.matched
            hit = sequence.commit(outcome, speculations.get(id(sequence)))
            report.sequences.append(SequenceRound(sequence.matched_acceptance if matched else sequence.acceptance,
                                                  sequence.greedy, verified, outcome.accepted, hit, sequence.asked,
                                                  matched))
        return report

    def prespeculate(self, batch: list[Sequence]) -> list[SpeculationCache]:
        """In the worker: every sequence's likely outcomes, all drafted in lockstep."""
        with stopwatch() as elapsed:
            speculations = lockstep(self.draft, [
                s.drafter.prespeculate(s.out.ids, s.round_proposal,
                                       s.fanout_policy.fanout(s.round_draft_tokens + 1, s.plan.branches))
                for s in batch])
        for sequence, speculation in zip(batch, speculations):
            speculation.seconds = elapsed.seconds
            sequence.stats.prespeculate_s += elapsed.seconds
        return speculations

    def _run_draft(self, function, *args):
        """Ordinary drafting's forwards: in the draft's worker thread (on the draft's core),
        or here for a draft of host Python (`EngineInfo.on_host`)."""
        if self.draft.info.on_host:
            return function(*args)
        return self.worker.submit(function, *args).result()

    def draft_misses(self, batch: list[Sequence]) -> tuple[float, tuple[int, int, float, float] | None, bool]:
        """Ordinary drafts, in the worker (here, for a draft of host Python), before the
        round's verification, for the sequences that draft this round and have no draft.
        Returns the time it took, for
        the load policy `(requests, steps, seconds, seconds of the steps after the first)`
        of the draft steps, and whether some draft cache was first caught up. A draft cache
        that lacks more than the round's own tokens (a prompt, or the tokens of a stretch
        at K = 0) is first caught up in a forward of its own, so that the steps after it
        measure a step: fed in the first step, no probe measured one while speculation was
        off on the wide session, and the draft step stayed at its calibration (bench pair:
        2.46 ms where steps take 1.5), pricing every K below autoregressive decoding."""
        needing = [s for s in batch if s.proposal is None]
        if not needing:
            return 0.0, None, False
        behind = [s for s in needing if s.drafter.lag(s.out.ids) > s.plan.draft_tokens + 1]
        forwards: list[float] = []
        run = self._run_draft
        with stopwatch() as drafting:
            if behind:
                run(lockstep, self.draft, [s.drafter.catch_up(s.out.ids[:-1]) for s in behind])  # all but the newest
            with stopwatch() as stepping:
                drafts = run(lockstep, self.draft, [s.drafter.draft(s.out.ids, s.plan.draft_tokens) for s in needing],
                             forwards)
        for sequence, draft in zip(needing, drafts):
            sequence.proposal = draft
            sequence.stats.draft_s += drafting.seconds
        measured = (len(needing), len(forwards), stepping.seconds, sum(forwards[1:]))
        return drafting.seconds, measured, bool(behind)
