"""How many tokens each request drafts this round, and how many branches it may
pre-speculate: chosen from measured costs and acceptance, so that speculation follows load.

Speculation trades target compute for draft work: a round verifies `K + 1` tokens per
request to commit `E(K)` of them. At batch 1 the target is weight-bound and verifying
five tokens costs little more than one, so drafting pays; in a full batch every verified
token costs compute, and drafts that are rejected are paid for by every other request.
The policy prices a round from what the decoder measures as it runs (`control.round_price`:
the verification, the draft's steps, pre-speculation's overrun, host work, each as a
cost curve) and picks the K of every request that maximises the batch's tokens per second,
`sum E_r(K_r) / T(K)`: the best K shared by all first, then one pass that moves each
request's K by one where that pays (a request whose drafts are rejected more often drafts
less), with and without pre-speculation (it pays when its hits save more drafting than
its overrun costs). K = 0 is autoregressive decoding. Nothing is a hand-set threshold:
every figure is measured here, on this machine, while serving: the steps are timed whole,
host work included, since on a small model the host's share is most of a step.

Speculation never loses: a round without pre-speculation verifies alone, so K = 0 costs
what autoregressive decoding costs on both cores, and when acceptance and costs say no K
pays, every request that may draft gets K = 0. Its acceptance is then measured by a
probe now and then (`control.probes`), and speculation comes back as soon as the estimate
says it pays. Rounds that verify no drafts fade no counts, so the estimate stays
what the last drafts showed rather than drifting back to the optimistic prior. And the
model's choice is checked by the clock (`control.clock`): where the rounds that drafted
committed fewer tokens per second of wall time, start to start, than the rounds that did
not at the same batch size, the requests that adapt draft nothing there for a while,
whatever the model says (it cannot see the time between rounds).

With n-gram matches leading a draft model (`EngineInfo.ngram_lead`), a round whose next
token a match proposes is drafted by matching alone, with no forward of the draft: such
rounds are priced apart (`Candidate.free`: only the wider verification), with the
matches' own acceptance, and get a K of their own (`Plan.matched_tokens`, chosen with the
model's and held as long), so that matches draft where they pay even while the model's
drafts do not, and not where verifying them would not.

Acceptance by depth and the cache-hit rate are shared by every request of the same kind
(greedy or sampled), so a new request starts from what the others showed, and are
blended with the request's own counts as they come in. Costs start from the engines'
calibration (`control.calibration`: forwards timed at a ladder of sizes, at build time or
at load) and follow the measured rounds after that, with old measurements fading. The
pre-speculation budget is the number of branch rows a tree step can take while staying
under the verification (`costs.hidden_branches`, the rule the build's calibration uses).

Greedy output does not depend on K: on ONNX Runtime engines a token's logits are bit-
identical at every verify width (`tests/test_row_independence.py`) and on either
session, on torch engines they may differ in the last bits, which flipped no token of
1000 prompts x 64 (see docs/exactness.md). A sampled request's K follows the policy
too: its output is distributed exactly as the target's for every K, but K changes which
tokens a seed draws, so a seed replays exactly when the same K are chosen round by
round, which the policy does not promise (they follow measured costs and the company).
A request that pins its K (`adapt_k` off: `--fixed-k`, or a server request that names
`num_draft_tokens`) keeps it, and its seed replays whatever the load.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

from saguaro.runtime.control.acceptance import UNSEEN_ACCEPTANCE, Acceptance
from saguaro.runtime.control.backoff import doubled
from saguaro.runtime.control.calibration import measure_calibration
from saguaro.runtime.control.clock import ClockCheck
from saguaro.runtime.control.probes import PROBE_DRAFTS, PROBE_PERIOD, ProbeSchedule
from saguaro.runtime.control.round_price import Candidate, RoundPrice, prespeculates
from saguaro.runtime.control.round_report import Plan, RoundReport
from saguaro.runtime.control.sessions import SessionChoice

SHARED_FADING = 0.995             # of the acceptance counts shared by all requests (per round with drafts)
# Rounds a batch keeps its chosen K while it stays the same batch: choosing weighs every K
# for every request (about 0.15 ms of Python a round at one request, which on the tiny
# engines was a tenth of a round), and the estimates it weighs move by a few percent a round.
REPLAN_ROUNDS = 8
# ... twice as long for each choice in a row in which nothing drafts, up to 2^this times:
# with speculation off the estimates it weighs do not move (rounds without drafts count no
# acceptance; a probe's outcome, which might turn speculation on, is weighed at once), and
# the weighing (0.35-0.4 ms at one stream on SmolLM2) every 8 rounds of 9 ms was half of
# the policy's Python (`REPLAN_ROUNDS` is its first hold).
REPLAN_BACKOFF = 3
# ... and a choice of K = 0 for all that no K could beat at this load (`_hopeless`), this
# many, through requests joining and leaving (`_quiet_holds`): weighing every K for 16
# requests takes 1.5-2 ms of Python, longer than a whole round on the tiny engines.
QUIET_ROUNDS = PROBE_PERIOD
# Each such choice in a row holds twice as long, up to 2^this times: the weighing it
# repeats (1.5-2 ms every 32 rounds at 16 streams) is a share of a busy server's rounds,
# while a batch that shrinks is still asked at once whether some K could pay.
QUIET_BACKOFF = 3


class LoadPolicy:
    """One per decoder: the shared estimates and the choice of every round's K. `alone`:
    the decoder verifies a round without pre-speculation alone (`Decoder.alone`)."""

    def __init__(self, target, draft, alone: bool = True):
        self.sessions = SessionChoice(alone)  # which session verifies a round without pre-speculation
        # T(K): the cost curves, host work, misprediction
        self.price = RoundPrice(self.sessions, padded=target is not None and target.info.pads_rows)
        self._kept: _KeptChoice | None = None  # the last choice, while its batch runs on
        self._hopeless = False  # the last choice: K = 0 for all, and no K could pay at this load
        self._hopeless_choices = 0  # such choices in a row
        self._undrafted_choices = 0  # choices in a row in which no request drafts, matches included
        self.probes = ProbeSchedule()
        # the round chosen to draft: the model's seconds for it and for the same batch drafting
        # nothing, and whether it pre-speculates
        self._modelled: tuple[float, float, bool] | None = None
        self._probe_priced: float | None = None  # the model's price of this round without its probe
        self.shared = {greedy: Acceptance(fading=SHARED_FADING) for greedy in (True, False)}
        # ... of n-gram matches leading a draft model (`EngineInfo.ngram_lead`), apart: they
        # cost no draft forward and are accepted at rates of their own
        self.shared_matched = {greedy: Acceptance(fading=SHARED_FADING) for greedy in (True, False)}
        # committed tokens per second of wall time, drafting or not (`control.clock`), which
        # overrules the model where drafting measured slower
        self.clock = ClockCheck()
        self._engines = (target, draft)
        self.measured_acceptance = draft.info.acceptance if draft is not None else ()

    def observe_round(self, report: RoundReport) -> None:
        """Everything a round measured: forward costs, host work, acceptance, lookups."""
        price = self.price
        price.observe_verify(report.verified_tokens, report.verify_s, report.alone)
        self.sessions.verified(report.verify_s)
        if report.drafting is not None:
            price.observe_drafting(*report.drafting)
        if report.prespeculation is not None:
            price.observe_prespeculation(*report.prespeculation)
        for sequence in report.sequences:
            self.record_round(sequence.acceptance, sequence.greedy, sequence.verified, sequence.accepted,
                              sequence.asked, sequence.matched)
            if sequence.hit is not None:
                self.record_lookup(sequence.acceptance, sequence.greedy, sequence.hit)
        price.observe_host(report.requests, report.host_s, report.drafted, report.prespeculation is not None)
        if report.caught_up:  # the first round of drafting after a stretch without: the clock's not to judge
            self.clock.counts(None)
        self.clock.committed(report.requests, sum(sequence.accepted + 1 for sequence in report.sequences))
        whole = report.verify_s + report.wait_s + report.draft_s + report.host_s
        # checked against its price; not a round whose drafts first caught up a draft cache:
        # the model spreads that forward over the rounds it serves (`RoundPrice.catch_up_seconds`),
        # the round pays it whole, and at one stream (a prompt per request, stretches at
        # K = 0) such rounds held every drafting price 1.2-1.7x above what steady rounds take
        matched = report.matched
        if self._modelled is not None and report.drafted and not (report.caught_up or matched):
            modelled, undrafted, speculating = self._modelled
            price.observe_drafted(speculating, report.requests, whole - undrafted, modelled - undrafted)
        elif not report.drafted:  # nothing measured it: what the last drafting rounds showed ages
            price.fade_misprediction()
        if self._probe_priced is not None and not matched:
            self.probes.observe(whole - self._probe_priced, self._probe_priced)

    def observe_period(self, seconds: float) -> None:
        """The last round's period, from its start to the next round's (`Decoder`), for the
        clock; not called for a period in which requests joined."""
        self.clock.observe_period(seconds)

    def record_round(self, own: Acceptance, greedy: bool, verified: int, accepted: int,
                     asked: int | None = None, matched: bool = False) -> None:
        if not (verified or asked):  # nothing to count; the request's last round is read by its probes
            own.last = (0, 0)
            return
        for counts in (own, (self.shared_matched if matched else self.shared)[greedy]):
            counts.record(verified, accepted, asked)

    def record_lookup(self, own: Acceptance, greedy: bool, hit: bool) -> None:
        for counts in (own, self.shared[greedy]):
            counts.record_lookup(hit)

    def calibrate(self) -> None:
        """Costs to start from: the engines' calibration where it was taken on this machine
        (at build time), else one measured now the same way (`control.calibration`). The
        decoder calls it before the first requests the policy steers take their KV slots
        (measuring needs one of each engine's)."""
        if self.price.calibrated:
            return
        target, draft = self._engines
        stored = target.info.calibration
        self.price.calibrate(stored if stored is not None and stored.measured_here
                             else measure_calibration(target, draft, alone=self.sessions.enabled))

    def choose(self, batch) -> list[Plan]:
        """The plan of each `batch` entry (a `decoding.Sequence`: its `k`, `adapts`,
        `steered`, `acceptance`, `greedy`, `prespeculating`, `room`, `draft_lag`, last `plan`,
        and for n-gram matches `may_match`, `match_rate` and `matched_acceptance`)."""
        self._modelled = self._probe_priced = None
        self.clock.counts(None)
        if not any(sequence.adapts or sequence.steered for sequence in batch):
            return [Plan(most_drafts(s), s.prespeculating) for s in batch]  # as each asked
        self.probes.tick()
        if self._quiet_holds(batch):  # K = 0 held; matches as the clock lets them
            matches = self._matching(batch) and self.clock.allows(len(batch))
            self.clock.counts(matches)
            return self._quiet_plans(batch, self._matched_tokens(matches))
        held = self._held_undrafted(batch)
        if held is not None:
            return held
        candidates, ks = self._chosen(batch, [self._candidate(sequence) for sequence in batch])
        ks, overruled, matches = self._clocked(candidates, ks, self._matching(batch))
        matched_tokens = self._matched_tokens(matches)
        if any(ks):  # the choice drafts (a probe's round is priced apart): its price is checked
            self._modelled = (self.price.modelled_seconds(candidates, ks),
                              self.price.undrafted_seconds(len(ks)), prespeculates(candidates, ks))
        branches = self.price.branch_rows(candidates, ks)
        plans = [Plan(k, c.prespeculating, branches if c.steered and c.prespeculating and k else None,
                      undrafted=("clock" if clock else "priced") if c.adapts and c.most and not k else None,
                      matched_tokens=matched_tokens)
                 for c, k, clock in zip(candidates, ks, overruled)]
        plans = [self._probed(plan, sequence, candidates, ks, index)
                 for index, (plan, sequence) in enumerate(zip(plans, batch))]
        if any(plan.probe for plan in plans):
            self._probe_priced = self.price.seconds(candidates, ks)
        return plans

    def _matching(self, batch) -> bool:
        """The kept choice lets n-gram matches draft for some request that adapts."""
        kept = self._kept
        return kept is not None and kept.matched_k > 0 and any(s.adapts and s.may_match for s in batch)

    def _matched_tokens(self, matches: bool) -> int:
        """`Plan.matched_tokens` of the round: the kept choice's K for matches, where they may
        draft (a request that may not, pins its K, or probes ignores it: `Sequence.prepare`)."""
        return self._kept.matched_k if matches and self._kept is not None else 0

    def _clocked(self, candidates: list[Candidate], ks: list[int],
                 matching: bool = False) -> tuple[list[int], list[bool], bool]:
        """The model's choice, unless the clock says drafting at this batch size commits
        fewer tokens per second than drafting nothing, or this round measures drafting
        nothing (`ClockCheck.allows`): then the requests that adapt draft nothing (their
        probes aside, which belong to speculation off), n-gram matches included
        (`matching`: the choice lets them draft; a round that may draft them counts as
        drafting, found or not, so the clock weighs the choice as a whole). With the K of
        each request, whether the clock overruled it, and whether matches may draft."""
        adapting = [c.adapts and k > 0 for c, k in zip(candidates, ks)]
        asks = any(adapting) or matching
        drafts = asks and self.clock.allows(len(ks))
        self.clock.counts(drafts)
        if asks and not drafts:
            return [0 if adapts else k for adapts, k in zip(adapting, ks)], adapting, False
        return ks, [False] * len(ks), matching

    def _quiet_holds(self, batch) -> bool:
        """Speculation was turned off for every request and no K could pay at that load
        (`_hopeless`): then requests joining and leaving do not make it weigh every K again
        until the choice's rounds are up (`quiet_rounds`, longer for each such choice in a
        row). At 16 streams through the server a request joins or leaves every few rounds;
        weighing every K for every request each time (1.5-2 ms of Python) had cost SSD with
        the policy a fifth of autoregressive speed on the tiny engines, whose rounds take
        1.4 ms. A batch that lost requests, which might pay, is asked only whether some K
        could (`_nothing_could_pay`: a few K for one request)."""
        kept = self._kept
        if not (self._hopeless and kept is not None and kept.rounds_left > 0
                and all(sequence.adapts for sequence in batch)):
            return False
        if len(batch) < kept.size:  # a smaller batch might pay: asked again, at a glance
            if not self._nothing_could_pay([self._candidate(sequence) for sequence in batch], [0] * len(batch)):
                return False
            kept.follow(batch)
        return True

    def _quiet_plans(self, batch, matched_tokens: int) -> list[Plan]:
        """K = 0 for every request, and no probe (none could turn speculation on)."""
        assert self._kept is not None  # `_quiet_holds`
        self._kept.rounds_left -= 1
        return [held_plan(sequence.plan, sequence.prespeculating, matched_tokens) for sequence in batch]

    def _held_undrafted(self, batch) -> list[Plan] | None:
        """The plans of a round in which the kept choice drafts nothing (K = 0 for every
        request, no n-gram matches) and holds for this batch (`_KeptChoice.holds_for`), while
        no request is due to probe: what the whole choice would give (each request one quiet
        round more), without weighing candidates that the round does not read. None
        otherwise. At one stream on SmolLM2 with a head that does not pay (K = 0 in 97% of
        rounds), building every request's candidate and plan afresh had been most of the
        policy's Python in such a round, about 1% of the round."""
        kept = self._kept
        if kept is None or any(kept.ks) or self._matching(batch) or not kept.holds_for(batch):
            return None
        plans = []
        for sequence in batch:
            prespeculate = sequence.prespeculating and (kept.speculating or not sequence.steered)
            if not most_drafts(sequence):
                plans.append(Plan(0, prespeculate))
                continue
            if not sequence.adapts:
                return None  # a pinned K drafts
            due, rejected = self.probes.due(sequence.plan, sequence.acceptance.last, sequence.greedy)
            if due:
                return None  # the whole choice asks whether its probe could pay
            plans.append(quiet_round(Plan(0, prespeculate, undrafted="priced"), sequence.plan, rejected))
        kept.rounds_left -= 1
        self.clock.counts(False)
        return plans

    def _probed(self, plan: Plan, sequence, candidates: list[Candidate], ks: list[int], index: int) -> Plan:
        """With speculation off (K = 0 chosen for a request that may draft), the plan of a
        probe where one is due (`ProbeSchedule.due`): `PROBE_DRAFTS` drafts, not
        pre-speculated, so that the request's acceptance is measured again and speculation
        comes back once it pays. A probe is skipped while drafting could not pay at this load
        whatever it measured (`_could_pay`; once per choice while no request drafts,
        `_nothing_could_pay`: asked of every due request every round it had been a fifth of
        the decode loop's Python at 8 streams), and made as soon as it could."""
        candidate = candidates[index]
        if plan.draft_tokens or not (candidate.adapts and candidate.most):
            return plan
        due, rejected = self.probes.due(sequence.plan, sequence.acceptance.last, sequence.greedy)
        if due and not self._hopeless and self._could_pay(candidates, ks, index):
            self.probes.probed(sequence.greedy)
            return Plan(min(PROBE_DRAFTS, candidate.most), prespeculate=False, probe=True, rejected_probes=rejected)
        return quiet_round(plan, sequence.plan, rejected)

    def _could_pay(self, candidates: list[Candidate], ks: list[int], index: int) -> bool:
        """Whether some K > 0 of request `index`, with a draft as good as its kind's drafts
        measured or the optimistic prior, whichever is better at each depth (`hopeful`),
        with pre-speculation where the request may pre-speculate and without, would beat
        the batch's chosen rate. If not, no acceptance a probe could measure would turn
        speculation back on, and its cost is saved: in a full batch on a compute-bound
        target, probes (a draft step, the draft's cache caught up on every token it missed,
        a wider verify) had cost the load policy a fifth of batched autoregressive speed.
        Asked with the prior alone and without pre-speculation, the bench pair at one stream
        (drafts accepted 0.83-0.93 a depth, and paying only pre-speculated) was found
        hopeless in most rounds, probed nothing, and ran at autoregressive speed where
        K = 3 ran 1.15x faster."""
        candidate = candidates[index]
        chosen = self._rate(candidates, ks)
        for hopeful in hopeful_variants(candidate):
            trial = candidates[:index] + [hopeful] + candidates[index + 1:]
            if any(self._rate(trial, ks[:index] + [k] + ks[index + 1:]) > chosen for k in range(1, candidate.most + 1)):
                return True
        return False

    @staticmethod
    def _speculation_choices(candidates) -> list[bool]:
        """Pre-speculate or not this round (adapting requests): it pays when its hits
        save more drafting than it costs in waiting."""
        return [True, False] if any(c.steered and c.prespeculating for c in candidates) else [True]

    def _chosen(self, batch, candidates: list[Candidate]) -> tuple[list[Candidate], list[int]]:
        """The K of every request and whether pre-speculation runs: chosen afresh when the
        batch changed, after a probe (its outcome may turn speculation back on), after a
        round in which some request's drafts were all rejected (it may turn speculation
        off) and every `REPLAN_ROUNDS` rounds; in between the last choice holds, each K
        within what its request may draft this round."""
        kept = self._kept
        if kept is not None and kept.holds_for(batch):
            kept.rounds_left -= 1
            candidates = candidates if kept.speculating else without_prespeculation(candidates)
            return candidates, [c.fitted(k) for k, c in zip(kept.ks, candidates)]
        choices = [(speculating, *self._best(candidates, speculating))
                   for speculating in self._speculation_choices(candidates)]
        speculating, candidates, ks = max(choices, key=lambda choice: self._rate(choice[1], choice[2]))
        self._hopeless = self._nothing_could_pay(candidates, ks)
        self._hopeless_choices = self._hopeless_choices + 1 if self._hopeless else 0
        matched_k = self._matched_k(batch, candidates, ks)
        self._undrafted_choices = 0 if any(ks) or matched_k else self._undrafted_choices + 1
        held = quiet_rounds(self._hopeless_choices) if self._hopeless else replan_rounds(self._undrafted_choices)
        self._kept = _KeptChoice(speculating, ks, held - 1, matched_k)
        self._kept.follow(batch)
        return candidates, ks

    def _matched_k(self, batch, candidates: list[Candidate], ks: list[int]) -> int:
        """The K of a round that n-gram matches lead, for the requests that adapt and may
        draft matches (`Sequence.may_match`): the best for the batch with each of them
        drafting matches at it and the others as chosen, priced with no draft forward and
        the matches' own acceptance. Chosen with the model's K (and held as long), since a
        match is found round by round: held to the model's K, matches drafted nothing
        where the model did not pay (SmolLM2 chat at one stream: 96% of rounds at K = 0);
        drafting the request's whole K there, 16 streams ran at 0.46x batched AR."""
        leading = {index for index, sequence in enumerate(batch) if sequence.adapts and sequence.may_match}
        if not leading:
            return 0
        trial = list(candidates)
        for index in leading:
            trial[index] = self._matched_candidate(batch[index], candidates[index])

        def matching(k: int) -> list[int]:
            return [trial[i].fitted(k) if i in leading else ks[i] for i in range(len(ks))]
        return max(range(max(trial[i].most for i in leading) + 1), key=lambda k: self._rate(trial, matching(k)))

    def _matched_candidate(self, sequence, candidate: Candidate) -> Candidate:
        """The request drafting n-gram matches in the rounds where one leads (`match_rate`):
        their acceptance (its own blended with its kind's, from the optimistic prior), no
        draft forward, no pre-speculation."""
        shared = self.shared_matched[sequence.greedy]
        own = sequence.matched_acceptance
        proposal = own.proposal_rates(sequence.k, shared.proposal_rates(sequence.k))
        reach = reach_of([rate * made for rate, made in zip(own.rates(sequence.k, shared.rates(sequence.k)), proposal)])
        return replace(candidate, reach=reach, hopeful=reach, hit=0.0, prespeculating=False, lag=0,
                       proposing=reach_of(proposal), free=True, matching=sequence.match_rate)

    def _nothing_could_pay(self, candidates: list[Candidate], ks: list[int]) -> bool:
        """No request drafts, and none could pay at this load with a draft as good as the
        optimistic prior (`_could_pay`, asked of the first request that may draft: at a
        glance, as the others ask the same of the same costs), with all its K and its output
        ahead of it: how much room a request has left says nothing of the load. Judged with
        the room left, a request's last rounds at one stream (K = 1 and a lagging draft
        cache's catch-up spread over one round) were hopeless, and the hold, which outlasts
        requests, kept the next ones at K = 0 for quiet rounds each longer than the last
        (bench pair: 31 of each request's 64 rounds, where drafting ran 1.2x faster). A batch
        in which no request may draft this round says nothing of the load either."""
        if any(ks):
            return False
        hopeful = next((i for i, c in enumerate(candidates) if c.adapts and c.most), None)
        if hopeful is None:
            return False
        ahead = candidates[:hopeful] + [candidates[hopeful].with_output_ahead()] + candidates[hopeful + 1:]
        return not self._could_pay(ahead, ks, hopeful)

    def _best(self, candidates, speculating: bool):
        if not speculating:
            candidates = without_prespeculation(candidates)
        ks = self._refined(candidates, self._best_shared_k(candidates))
        return candidates, ks

    def _candidate(self, sequence) -> Candidate:
        shared = self.shared[sequence.greedy]
        shared_rates = shared.rates(sequence.k, self._measured_prior(sequence.k))
        # a draft that may propose fewer than asked (n-gram): a depth counts where proposed
        proposal = sequence.acceptance.proposal_rates(sequence.k, shared.proposal_rates(sequence.k))
        reach = reach_of([rate * made for rate, made in zip(sequence.acceptance.rates(sequence.k, shared_rates), proposal)])
        hopeful = reach_of([max(rate, UNSEEN_ACCEPTANCE) * made for rate, made in zip(shared_rates, proposal)])
        most = most_drafts(sequence)
        hit = sequence.acceptance.hit_rate(shared.hit_rate(self._unseen_hit_rate())) if sequence.prespeculating else 0.0
        return Candidate(most, sequence.adapts, sequence.steered, reach, hopeful, hit, sequence.prespeculating,
                          sequence.draft_lag, sequence.room, reach_of(proposal))

    def _unseen_hit_rate(self) -> float:
        """Where a kind's hit rate starts: a pre-speculated branch is the outcome when the
        target's next token was among those the draft guessed, about as often as the draft's
        first token is accepted (the bench pair: 0.87 accepted, 0.83-0.93 hits; the SmolLM2
        head: 0.44 and 0.29). Probes draft without pre-speculation and never measure it: at
        a flat 0.5 a fresh server held the bench pair at K = 0 at one stream."""
        measured = self.measured_acceptance
        return measured[0] if measured else UNSEEN_ACCEPTANCE

    def _measured_prior(self, depths: int) -> list[float] | None:
        """Where the shared estimate starts: the draft's acceptance by depth as measured when
        it was made (`EngineInfo.acceptance`; deeper depths take the deepest measured), so
        that a weak draft's first rounds do not draft as if it agreed 8 times in 10; None
        (the optimistic `UNSEEN_ACCEPTANCE`) for a draft without a report."""
        measured = self.measured_acceptance
        if not measured:
            return None
        return [measured[min(depth, len(measured) - 1)] for depth in range(depths)]

    @property
    def catches_up(self) -> bool:
        """Lagging draft caches may catch up beside a verification: not while nothing could
        draft at this load (`_nothing_could_pay`), where a catch-up would serve no draft
        (at 16 streams its waits, a forward of a shape ONNX Runtime had not run yet costing
        several times a steady one, were 5-8% of a run), and the decoder need not look for
        the lagging caches."""
        return not self._hopeless

    def catch_up_share(self, tokens: int, requests: int) -> int:
        """Tokens each of `requests` lagging draft caches may catch up on while a
        verification of `tokens` runs beside it: what one draft forward takes in that time
        (at least one each), so that the target does not wait for it. Unbounded, the draft
        of 16 sequences that had drafted nothing for 32 rounds took longer than the
        verification, and the load policy fell a fifth behind autoregressive decoding.
        None unless caches may catch up (`catches_up`)."""
        if not self.catches_up:
            return 0
        return self.price.hidden_catch_up(tokens, requests)

    def _rate(self, candidates, ks) -> float:
        tokens = sum(c.expected_tokens(k) for c, k in zip(candidates, ks))
        return tokens / max(self.price.seconds(candidates, ks), 1e-9)

    def _best_shared_k(self, candidates) -> list[int]:
        deepest = max((c.most for c in candidates), default=0)
        options = [[c.fitted(k) for c in candidates] for k in range(deepest + 1)]
        return max(options, key=lambda ks: self._rate(candidates, ks))

    def _refined(self, candidates, ks) -> list[int]:
        """One pass: each adapting request's K one up or down, kept where the batch gains."""
        ks, best = list(ks), self._rate(candidates, ks)
        for index, candidate in enumerate(candidates):
            if not candidate.adapts:
                continue
            for move in (-1, 1):
                trial = list(ks)
                trial[index] = ks[index] + move
                if 0 <= trial[index] <= candidate.most:
                    rate = self._rate(candidates, trial)
                    if rate > best:
                        ks, best = trial, rate
        return ks



def quiet_round(plan: Plan, last: Plan, rejected_probes: int) -> Plan:
    """`plan`, drafting nothing for a request that may draft, as one quiet round more after
    the request's plan `last`, with its probes in a row that accepted nothing."""
    return replace(plan, quiet=last.quiet + 1, rejected_probes=rejected_probes)


def held_plan(last: Plan, prespeculating: bool, matched_tokens: int) -> Plan:
    """The plan of a round held at K = 0 (`LoadPolicy._quiet_plans`), after the request's
    plan `last`: one quiet round more. A plan held the round before is advanced in place
    (nothing but its request keeps a plan past its round): at 16 streams, a new plan per
    request per round was about a third of the policy's Python in a held round, the
    difference between such a round and an autoregressive one."""
    if last.undrafted == "held":
        last.quiet += 1
        last.matched_tokens = matched_tokens
        return last
    return Plan(0, prespeculating, quiet=last.quiet + 1, rejected_probes=last.rejected_probes, undrafted="held",
                matched_tokens=matched_tokens)


def replan_rounds(undrafted_choices: int) -> int:
    """Rounds a choice holds that is the `undrafted_choices`-th in a row in which nothing
    drafts (0: it drafts)."""
    return doubled(REPLAN_ROUNDS, undrafted_choices - 1, REPLAN_BACKOFF)


def quiet_rounds(hopeless_choices: int) -> int:
    """Rounds the `hopeless_choices`-th choice in a row of K = 0 that no K could beat holds."""
    return doubled(QUIET_ROUNDS, hopeless_choices - 1, QUIET_BACKOFF)


def without_prespeculation(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates with the pre-speculation the policy steers turned off."""
    return [replace(c, prespeculating=False) if c.steered else c for c in candidates]


def hopeful_variants(candidate: Candidate) -> list[Candidate]:
    """The request with the `hopeful` draft: without pre-speculation, and with it where
    it may pre-speculate, finding its drafts pre-speculated as often as the prior
    accepts a draft (`UNSEEN_ACCEPTANCE`) or its kind measured, whichever is more. A
    probe drafts without pre-speculation and measures no hit rate: asked at a flat
    0.5, the bench pair at one stream (hits 0.83-0.92 once measured) was held
    hopeless after an autoregressive stretch, with no probe, at AR's speed where
    K = 3 ran 1.2x faster."""
    plain = replace(candidate, reach=candidate.hopeful, prespeculating=False)
    if not candidate.hit:  # it may not pre-speculate
        return [plain]
    return [plain, replace(plain, prespeculating=True, hit=max(candidate.hit, UNSEEN_ACCEPTANCE))]


def reach_of(rates: list[float]) -> list[float]:
    """reach[i]: P(the first i drafts all accepted), from the acceptance at each depth."""
    reach = [1.0]
    for rate in rates:
        reach.append(reach[-1] * rate)
    return reach


def most_drafts(sequence) -> int:
    """The most drafts a sequence may verify this round: its K, less near the end of its output."""
    return max(min(sequence.k, sequence.room - 1), 0)


@dataclass
class _KeptChoice:
    speculating: bool    # pre-speculation chosen on
    ks: list[int]
    rounds_left: int     # rounds it still holds while the batch stays the same
    matched_k: int       # K of a round that n-gram matches lead (`LoadPolicy._matched_k`)
    # the sequences it holds for, in order, weakly: a finished request's sequence must not
    # outlive it here (through its callbacks it holds the Triton response sender, and a
    # sender never released kept the model from unloading at shutdown)
    batch: list[weakref.ref] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.batch)

    def follow(self, batch) -> None:
        self.batch = [weakref.ref(sequence) for sequence in batch]

    def holds_for(self, batch) -> bool:
        """The same sequences, rounds left, and nothing in the last round that may change
        the choice: a probe, or a request whose drafts were all rejected."""
        return (self.rounds_left > 0 and len(self.batch) == len(batch)
                and all(kept() is sequence for kept, sequence in zip(self.batch, batch))
                and not any(s.plan.probe or all_rejected(s.acceptance.last) for s in batch))


def all_rejected(last_round: tuple[int, int]) -> bool:
    """A round's (verified, accepted): drafts verified and none accepted."""
    verified, accepted = last_round
    return bool(verified) and not accepted
