"""What a round costs, as the load policy prices it (`control.load_policy`) from what the
decoder measures as it runs:

    verify(N)   one target verification over N tokens (N = sum of K_r + 1; for a draft that
                may propose fewer than asked, the n-gram draft, its expected proposals + 1;
                for a target that pads rows, rows x the widest: `RoundPrice.verify_size`)
    draft(R)    one step of ordinary drafting for R requests
    start(R)    what a round's ordinary drafting takes beyond its steps (its first, cold
                forward; setting the drafts up): a + b R
    tree(R)     one step of pre-speculation over R branch rows
                (each a `CostCurve`: calibrated at a ladder of sizes, then following the rounds)
    host(n)     the rest of a round of n requests (host work): a + b n

    alone(N)    verify(N) with nothing of the draft's beside it, on both cores (`run_alone`)

    E_r(K)    = 1 + sum_{i=1..K} alpha_1 ... alpha_i      (alpha_j: P(accept depth j | j-1 accepted),
                times P(the draft proposes depth j | it proposed j-1) for a draft that may stop)
    T(K)      = verify(sum K_r + 1) + host(n) + P(miss) * (start + max K_r * draft)(misses | miss)
                + max(0, (max K_r + 1) * tree(branch rows) - verify)
                + tree(L) / L * sum_r L_r / R_r(K_r)
                (P(miss) = 1 - prod_r h_r: some request drafts before the round, finding no
                pre-speculated draft, h_r its hit rate, 0 without pre-speculation; those
                that do, sum_r (1 - h_r) / P(miss) of them on average;
                alone(...) for verify when no request pre-speculates; L_r: the tokens request
                r's draft cache lacks beyond K_r + 1, L their sum, fed in one forward before
                the first draft step: paid once, so spread over R_r(K) = room_r / E_r(K), the
                rounds the request has left)
                and for a round that drafts, what it adds to T(0) times m(n): measured over
                modelled of what the drafting rounds of n requests added (`costs.Misprediction`:
                what no curve holds; fading toward 1 over rounds that draft nothing, which
                measure it not)
                A request whose drafts are n-gram matches (`Candidate.free`) adds its K_r to
                the verification and nothing else: no draft forward runs for it.

Every curve starts from the engines' calibration (`control.calibration`) and follows the
measured rounds after that, old measurements fading.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from saguaro.runtime.control.costs import FOLLOWING, MOST_BRANCHES, CostCurve, LinearCost, Misprediction, hidden_branches
from saguaro.runtime.control.sessions import SessionChoice

# How far a verification on the session tried once a period (`SessionChoice`) moves its
# curve down (up, only as far as any round: `observe_verify`). The curves price the rounds
# (the one-thread session's, every pre-speculating round): measured there once in 32 rounds
# while speculation is off, at the curves' usual following a curve a busy spell had
# inflated took hundreds of rounds to come back, and held speculation off meanwhile.
TRIAL_FOLLOWING = 0.5


class RoundPrice:
    """The cost curves, host work and misprediction factors, and T(K) from them. `sessions`:
    the policy's choice of the session a round without pre-speculation verifies on."""

    def __init__(self, sessions: SessionChoice, padded: bool = False):
        """`padded`: the target pads a batch's rows to the widest (`EngineInfo.pads_rows`)."""
        self.sessions, self.padded = sessions, padded
        self.verify_cost, self.draft_cost, self.tree_cost = CostCurve(), CostCurve(), CostCurve()
        self.alone_cost = CostCurve()  # verify(N) with nothing of the draft's beside it (`run_alone`)
        # what a round's ordinary drafting takes beyond its steps at `draft_cost`: its first
        # forward after the verification (the draft's weights no longer in the caches) and
        # the Python that sets its drafts up (bench pair, one stream: about 1 ms a round,
        # against 0.6 a later step). Priced per step, rounds at K = 1 measured 1.6-2.0 ms a
        # step, and K = 4, which takes 3.4 ms, was priced at 6-8.
        self.draft_start_cost = LinearCost()
        # host work per round, apart for rounds that draft (proposals, features, commits),
        # rounds that also pre-speculate (the worker's Python beside the round's, for the
        # GIL) and rounds that do neither: on a small target it is a large share of a round,
        # and each kind must pay for its own (bench pair, one stream: 0.3-0.5 ms a drafting
        # round, 0.65-0.9 a pre-speculating one)
        self.host_cost, self.drafting_host_cost, self.speculating_host_cost = LinearCost(), LinearCost(), LinearCost()
        # by whether the round pre-speculates: its overrun and hits are errors of their own
        self.misprediction = {speculating: Misprediction() for speculating in (True, False)}

    @property
    def calibrated(self) -> bool:
        return self.verify_cost.shaped and self.draft_cost.shaped

    def calibrate(self, calibration) -> None:
        """The curves take the calibration's shape (`control.calibration.Calibration`), at the
        level the rounds before it measured where they measured one size (`CostCurve.calibrated`)."""
        self.verify_cost, self.alone_cost, self.draft_cost, self.tree_cost = (
            curve.calibrated(points) for curve, points in ((self.verify_cost, calibration.verify),
                                                           (self.alone_cost, calibration.alone),
                                                           (self.draft_cost, calibration.draft),
                                                           (self.tree_cost, calibration.draft)))

    def observe_verify(self, tokens: int, seconds: float, alone: bool = False) -> None:
        """`alone`: the target ran alone (no pre-speculation beside it): its own curve. A
        trial of the other session moves its curve `TRIAL_FOLLOWING` of the way down, but
        only as far as any round up: a busy moment only slows a forward, so one trial that
        measured fast says the session is that fast, while one that measured slow may have
        been preempted."""
        curve = self.alone_cost if alone else self.verify_cost
        faster = curve.known and seconds < curve(tokens)
        curve.observe(tokens, seconds, following=TRIAL_FOLLOWING if self.sessions.trialling and faster else FOLLOWING)

    def observe_drafting(self, requests: int, steps: int, seconds: float, later_s: float) -> None:
        """A round's ordinary drafting: `steps` forwards for `requests` in `seconds`, of which
        the forwards after the first took `later_s`. Those measure a step; what the round
        took beyond `steps` such steps is its start (`draft_start_cost`)."""
        if steps > 1:
            self.draft_cost.observe(requests, later_s / (steps - 1))
        elif steps and not self.draft_cost.known:  # nothing else to go by
            self.draft_cost.observe(requests, seconds)
        if steps and self.draft_cost.known:
            self.draft_start_cost.observe(requests, max(seconds - steps * self.draft_cost(requests), 0.0))

    def observe_prespeculation(self, rows: int, steps: int, seconds: float) -> None:
        """`steps` forwards (glue and tree steps) over `rows` branch rows each."""
        if steps:
            self.tree_cost.observe(rows, seconds / steps)

    def observe_host(self, requests: int, seconds: float, drafted: bool = False, speculated: bool = False) -> None:
        """What a round took beyond its forwards and waits; `drafted`: a round in which some
        request verified drafts; `speculated`: one that pre-speculated too."""
        curve = self.speculating_host_cost if speculated else self.drafting_host_cost if drafted else self.host_cost
        curve.observe(requests, max(seconds, 0.0))

    def observe_drafted(self, speculating: bool, requests: int, added_s: float, modelled_added_s: float) -> None:
        """A drafting round of `requests` added `added_s` to the round without its drafts
        where the curves said `modelled_added_s` (`costs.Misprediction`)."""
        self.misprediction[speculating].observe(requests, added_s, modelled_added_s)

    def fade_misprediction(self) -> None:
        """A round that drafted nothing: what the last drafting rounds showed ages."""
        for correction in self.misprediction.values():
            correction.fade()

    def host_seconds(self, requests: int, drafting: bool, speculating: bool = False) -> float:
        """A round's host work, never below a plainer kind's at the same size: a drafting
        round does all a round without drafts does, while each kind's line is measured at
        the sizes it ran at (through the server, drafting rounds mostly at one and two
        streams, rounds without drafts at eight and sixteen too, where the server's other
        threads slow them), and a line read beyond its sizes could price drafting's host
        work below the plain round's, as if drafting saved some."""
        seconds = self.host_cost(requests)
        if drafting and self.drafting_host_cost.known:
            seconds = max(seconds, self.drafting_host_cost(requests))
        if speculating and self.speculating_host_cost.known:
            seconds = max(seconds, self.speculating_host_cost(requests))
        return seconds

    def seconds(self, candidates, ks) -> float:
        """T(K): the model's seconds; for a drafting round, what drafting adds to the round
        corrected by what it added in such rounds of this many requests, measured against
        the model (never below the round without drafts: it does all that round does)."""
        if not any(ks):
            return self.undrafted_seconds(len(candidates))
        modelled, undrafted = self.modelled_seconds(candidates, ks), self.undrafted_seconds(len(candidates))
        correction = self.misprediction[prespeculates(candidates, ks)](len(candidates))
        return undrafted + correction * max(modelled - undrafted, 0.0)

    def undrafted_seconds(self, requests: int) -> float:
        """`modelled_seconds` of a round of `requests` that drafts nothing: each verifies one
        token, alone, with a plain round's host work. Asked beside every K the policy weighs."""
        return self.verify_seconds(float(requests), alone=True) + self.host_seconds(requests, drafting=False)

    def modelled_seconds(self, candidates, ks) -> float:
        """T(K) from the curves. Without pre-speculation nothing of the draft's overlaps
        the verification, so the target verifies alone, on both cores (`alone_cost`)."""
        drafting = [(c, k) for c, k in zip(candidates, ks) if k]
        speculating = [k for c, k in drafting if c.prespeculating]
        verify = self.verify_seconds(self.verify_size(candidates, ks), alone=not speculating)
        host = self.host_seconds(len(candidates), drafting=bool(drafting), speculating=bool(speculating))
        drafting = [(c, k) for c, k in drafting if not c.free]
        if not drafting:
            return verify + host
        hits = [c.hit if c.prespeculating else 0.0 for c, _ in drafting]
        critical = self.missed_drafting_seconds(hits, max(k for _, k in drafting))
        critical += self.catch_up_seconds(drafting)
        overrun = 0.0
        if speculating:
            rows = len(speculating) * (max(speculating) + 1)  # at least one branch per depth and request
            overrun = max(0.0, (max(speculating) + 1) * self.tree_cost(rows) - verify)
        return verify + host + critical + overrun

    def missed_drafting_seconds(self, hits: list[float], steps: int) -> float:
        """The expected seconds of `steps` steps of ordinary drafting, with their start, in a
        round whose requests find their drafts pre-speculated with probabilities `hits`: the
        drafting runs only when some request misses (probability 1 - prod hits), for the
        requests that missed. Priced as drafting for the expected misses whatever the round's
        luck, a request at one stream with a hit rate of 0.92 paid a whole step per draft in
        every round, and its pre-speculation lost to drafting after the verification on
        price alone."""
        some_miss = 1.0 - math.prod(hits)
        if some_miss <= 1e-9 or not steps:
            return 0.0
        missing = sum(1.0 - hit for hit in hits) / some_miss
        return some_miss * (self.draft_start_cost(missing) + steps * self.draft_cost(missing))

    def catch_up_seconds(self, drafting: list[tuple[Candidate, int]]) -> float:
        """The tokens drafting requests' caches lack beyond a steady round's K + 1 (a prompt
        the draft has not fed, the tokens of a stretch at K = 0), fed in one forward before
        the first draft step, on the round's critical path. Paid once, while the drafts pay
        every round after, so each request's share is spread over the rounds it has left
        at that K. Uncosted, 16 new requests at once each fed a 43-token prompt to the draft
        (1.6 s the first time, 0.2 s after) before rounds of 50 ms, and the policy, which
        then turned speculation off, ran at 0.86x autoregressive."""
        behind = [(c, k, c.lag - (k + 1)) for c, k in drafting if c.lag > k + 1]
        rows = sum(extra for _, _, extra in behind)
        if not rows:
            return 0.0
        per_row = self.tree_cost(rows) / rows
        return per_row * sum(extra / c.rounds_left(k) for c, k, extra in behind)

    def verify_size(self, candidates, ks) -> float:
        """The size a round's verification is expected to cost as (`round_report.verify_size`):
        the tokens it takes (N = sum of K_r + 1 for drafts that propose every token asked), or
        for a target that pads rows, rows x the widest row, which a row of n-gram matches is
        when some request's match drafts (its chance, `Candidate.matching`, against all)."""
        if not self.padded:
            return sum(c.verified_tokens(k) for c, k in zip(candidates, ks))
        width = max((c.widest(k) for c, k in zip(candidates, ks) if not c.free), default=1.0)
        matched = [(c, k) for c, k in zip(candidates, ks) if c.free and k]
        if matched:
            some_match = 1.0 - math.prod(1.0 - c.matching for c, _ in matched)
            width = max(width, 1.0 + some_match * (max(c.widest(k) for c, k in matched) - 1.0))
        return len(candidates) * width

    def verify_seconds(self, tokens: float, alone: bool) -> float:
        """A verification of `tokens`; `alone`: with nothing of the draft's beside it, on
        the session such rounds use (`SessionChoice.wide`)."""
        if alone and self.sessions.wide(tokens) and self.alone_cost.known:
            return self.alone_cost(tokens)
        return self.verify_cost(tokens)

    def hidden_catch_up(self, tokens: int, requests: int) -> int:
        """Tokens each of `requests` lagging draft caches can feed in one draft forward
        while a verification of `tokens` runs (at least one; unbounded before both are measured)."""
        if not (self.verify_cost.known and self.tree_cost.known):
            return MOST_BRANCHES
        return max(1, hidden_branches(self.verify_cost(tokens), self.tree_cost, 1, requests))

    def branch_rows(self, candidates, ks) -> int:
        """Branches per speculating request that keep pre-speculation (the glue step and
        max K tree steps over requests x branches rows, as the tree curve measures a step)
        under this round's verification (`costs.hidden_branches`); at least one."""
        speculating = [k for c, k in zip(candidates, ks) if c.prespeculating and k]
        if not speculating:
            return 0
        verify = self.verify_cost(self.verify_size(candidates, ks))
        return max(1, hidden_branches(verify, self.tree_cost, steps=max(speculating) + 1, requests=len(speculating)))


def prespeculates(candidates: list[Candidate], ks: list[int]) -> bool:
    """Some request drafts and pre-speculates its outcomes this round."""
    return any(c.prespeculating and k for c, k in zip(candidates, ks))


@dataclass
class Candidate:
    """A request as the load policy weighs it this round: what the round's price reads of it."""

    most: int            # the most drafts it may verify this round
    adapts: bool         # False: K is pinned (to `most`)
    steered: bool        # its pre-speculation (on or off, branches) follows the policy
    reach: list[float]   # reach[i]: P(first i drafts accepted)
    hopeful: list[float]  # what a probe could show at best: `reach` for a draft as good as its
                          # kind's drafts or the optimistic prior, whichever is better
    hit: float           # P(its next draft comes from the speculation cache), pre-speculating
                         # (0: it may not); read only while `prespeculating`
    prespeculating: bool
    lag: int = 0         # committed tokens its draft cache lacks (`Sequence.draft_lag`)
    room: int = 1 << 30  # output tokens it may still make
    # proposing[i]: P(the draft proposes at least i tokens); empty: every token asked (a model)
    proposing: list[float] = field(default_factory=list)
    # its drafts are n-gram matches (`EngineInfo.ngram_lead`): no forward of the draft, so
    # no draft steps, catch-up or pre-speculation to price, only the wider verification,
    # in the rounds where a match is found and leads (`matching` of them; the others verify
    # its last token alone)
    free: bool = False
    matching: float = 1.0

    def expected_tokens(self, k: int) -> float:
        return 1 + self.matching * (sum(self.reach[:k + 1]) - 1)

    def verified_tokens(self, k: int) -> float:
        """Tokens a verification takes for it at K = `k`: its last token and the drafts
        it is expected to propose."""
        return 1 + self.matching * (self.widest(k) - 1)

    def widest(self, k: int) -> float:
        """... in a round where it drafts (for n-gram matches: where one is found)."""
        return 1 + (sum(self.proposing[1:k + 1]) if self.proposing else k)

    def rounds_left(self, k: int) -> float:
        """Rounds until its output is full, drafting `k` tokens a round."""
        return max(1.0, self.room / self.expected_tokens(k))

    def fitted(self, k: int) -> int:
        """`k` within what it may draft this round; a pinned K stays its own."""
        return min(k, self.most) if self.adapts else self.most

    def with_output_ahead(self) -> "Candidate":
        """The request with all its K (`hopeful` spans depths 0..K) and its whole output
        ahead of it: what it could draft at this load, whatever room it has left."""
        return replace(self, most=len(self.hopeful) - 1, room=Candidate.room)
