"""The load policy: each round's K from measured costs and shared acceptance. Costs are
set by hand here (as if measured), so each test knows which K pays; then the policy on
real engines with drafts that never agree, or agree once they did not, and the target's
wide session (`run_alone`)."""
import math
from collections import deque
from dataclasses import dataclass, field, replace

import pytest
import torch

from saguaro.runtime.cli import policy_summary
from saguaro.runtime.control.acceptance import Acceptance
from saguaro.runtime.control.costs import (
    FOLLOWING,
    MISPREDICTION_HALF_LIFE,
    MOST_MISPREDICTION,
    CostCurve,
    LinearCost,
    Misprediction,
    factor_in,
    factors_along,
)
from saguaro.runtime.control.load_policy import QUIET_ROUNDS, REPLAN_BACKOFF, REPLAN_ROUNDS, LoadPolicy
from saguaro.runtime.control.probes import PROBE_DRAFTS, PROBE_PERIOD, PROBE_SHARE, probe_period
from saguaro.runtime.control.round_price import TRIAL_FOLLOWING, Candidate, RoundPrice
from saguaro.runtime.control.round_report import Plan, RoundReport, SequenceRound, undrafted_reason, verify_size
from saguaro.runtime.control.sessions import TRIAL_BACKOFF, TRIAL_PERIOD, SessionChoice
from saguaro.runtime.core.contracts import Rows, Step
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.core.stats import GenerationStats
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.pipeline import Pipeline


@dataclass
class FakeSequence:  # what the policy reads of a `decoding.Sequence`
    k: int = 4
    adapts: bool = True
    steered: bool = True
    greedy: bool = True
    prespeculating: bool = False
    room: int = 100
    draft_lag: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)
    plan: Plan = field(default_factory=lambda: Plan(4))  # the last round's
    may_match: bool = False  # its rounds may be drafted by n-gram matches
    match_rate: float = 1.0  # ... in this share of the rounds asked
    matched_acceptance: Acceptance = field(default_factory=Acceptance)


def measured(intercept_s: float, per_token_s: float) -> CostCurve:
    cost = CostCurve()
    for size in (1, 8, 32, 128):
        cost.observe(size, intercept_s + per_token_s * size, lasting=True)
    return cost


def policy_with(verify: LinearCost, step: LinearCost, acceptance: float) -> LoadPolicy:
    policy = LoadPolicy(target=None, draft=None)  # costs given: no calibration forwards
    policy.price.verify_cost, policy.price.draft_cost, policy.price.tree_cost = verify, step, step
    shared = policy.shared[True]  # as if many rounds accepted each depth with `acceptance`
    shared.verified, shared.accepted = [1000.0] * 4, [1000.0 * acceptance] * 4
    return policy


def test_the_cost_curve_interpolates_and_follows_what_it_measures():
    cost = CostCurve({1: 0.004, 5: 0.0045, 64: 0.020})  # flat while weight-bound, then linear
    assert cost(3) == pytest.approx(0.00425) and cost(0) == 0.0
    assert cost(128) == pytest.approx(0.020 + 64 * (0.0155 / 59))  # the last segment, extended
    for _ in range(400):
        cost.observe(4, 0.006)  # rounds of 4 tokens ran slower than calibrated
    assert cost(4) == pytest.approx(0.006, rel=0.02) and cost.factor(5) > 1.2
    # a size no measurement came near keeps its calibrated shape at the nearest measured level
    assert cost(64) == pytest.approx(0.020 * cost.factor(5)) and cost.points == {1: 0.004, 5: 0.0045, 64: 0.020}
    for _ in range(400):
        cost.observe(64, 0.020)  # measured as calibrated there: as calibrated there
    assert cost(64) == pytest.approx(0.020, rel=0.02) and cost(4) == pytest.approx(0.006, rel=0.02)


def test_a_calibration_taken_later_keeps_the_level_rounds_of_one_size_measured():
    """Rounds at one token measured 33 ms before the calibration came (taken at build time,
    in a busier hour: 73 ms there): the calibrated curve keeps its shape at the measured
    level. Rounds of several sizes read through a one-point guess of the shape say nothing
    sure of any one size: the calibration's level then."""
    calibration = {1: 0.073, 2: 0.080, 16: 0.200}
    one_size = CostCurve()
    for _ in range(100):
        one_size.observe(1, 0.033)
    curve = one_size.calibrated(calibration)
    assert curve.points == calibration
    assert curve(1) == pytest.approx(0.033, rel=0.01) and curve(16) == pytest.approx(0.200 * 0.033 / 0.073, rel=0.01)
    mixed = CostCurve()
    for size in (1, 16) * 50:
        mixed.observe(size, 0.033 * size)
    assert mixed.calibrated(calibration)(1) == pytest.approx(0.073)
    assert CostCurve().calibrated(calibration)(16) == pytest.approx(0.200)  # nothing measured before


def test_a_size_the_rising_envelope_holds_up_follows_its_own_measurements():
    """Calibrated dearer at 1 token than at 2 (a noisy calibration), the curve prices 2
    tokens at 1 token's cost (a forward never costs less for more). Measurements at 2
    move its own factor toward what they saw, and no further: compared with the envelope,
    each had pushed it down again, until it priced 2 tokens at half what they took once
    1 token was measured cheaper."""
    cost = CostCurve({1: 0.004, 2: 0.002, 5: 0.003})
    assert cost(2) == pytest.approx(0.004)  # the envelope
    for _ in range(200):
        cost.observe(2, 0.002)  # as calibrated at 2
    assert cost.factor(2) == pytest.approx(1.0, rel=0.01)
    for _ in range(200):
        cost.observe(1, 0.001)  # 1 token measured cheaper than calibrated
    assert cost(1) == pytest.approx(0.001, rel=0.02) and cost(2) == pytest.approx(0.002, rel=0.02)


def test_a_size_measured_bounds_every_smaller_one():
    """A forward never costs less for more tokens: a level left high at 12 tokens (a busy
    spell) held the envelope up at 16 for good while rounds ran at 16 only; the wide
    session was priced at 137 ms where it took 42, and never chosen."""
    cost = CostCurve({1: 0.0078, 12: 0.0257, 16: 0.0324, 32: 0.0612})
    for _ in range(200):
        cost.observe(12, 0.137)
    assert cost(16) > 0.13
    for _ in range(8):
        cost.observe(16, 0.042, following=0.5)
    assert cost(16) == pytest.approx(0.042, rel=0.02) and cost(12) <= cost(16)
    assert cost(32) > cost(16)  # wider sizes keep their own level


def test_the_levels_read_in_one_walk_are_the_factors_read_one_by_one():
    """`factors_along` walks the sorted sizes and the factors once: each size's factor is
    what `factor_in` reads for it alone, before, between, at and past the points that
    measurements moved."""
    factors = [(2.0, 1.5), (5.0, 0.5), (16.0, 2.0)]
    sizes = [1, 2, 3, 4, 5, 6, 12, 16, 32]
    assert factors_along(factors, sizes) == [factor_in(factors, size) for size in sizes]
    assert factors_along([], sizes) == [1.0] * len(sizes)
    cost = CostCurve({size: 0.001 * size for size in sizes})
    for size, seconds in ((4, 0.006), (12, 0.010), (4, 0.005)):
        cost.observe(size, seconds)
    factors = list(cost.factors.items())
    assert [size for size, _ in factors] == sorted(size for size, _ in factors)
    assert cost._levels() == [(size, 0.001 * size * factor_in(factors, size)) for size in sizes]


def test_a_one_point_curve_is_read_the_same_way_by_measurements_and_predictions():
    """Before any calibration a curve holds the first size measured: rounds of 16 tokens
    move it to what they took, neither flat nor 16 times over."""
    cost = CostCurve()
    cost.observe(1, 0.0076)
    for _ in range(200):
        cost.observe(16, 0.040)
    assert cost(16) == pytest.approx(0.040, rel=0.02)


def test_a_verify_measured_slower_than_calibrated_prices_wider_ones_dearer_too():
    """Rounds of 16 sequences verify a third slower than the one-sequence calibration
    (their attention reads 16 caches); at K = 0 only verify(16) is measured. Priced at
    calibration, the wider verify of K = 1 looked cheap and won (324 tok/s against 314);
    with the level measured at 16 it costs a third more too, and K stays 0."""
    calibration = {1: 0.015, 16: 0.033, 32: 0.0587, 48: 0.082}
    policy = policy_with(CostCurve(calibration), CostCurve({1: 0.0022, 16: 0.005, 32: 0.0095}), acceptance=0.45)
    policy.price.alone_cost = CostCurve(calibration)
    policy.price.observe_host(16, 0.008)
    for _ in range(300):
        policy.price.observe_verify(16, 0.043, alone=True)
    assert policy.price.alone_cost(32) == pytest.approx(0.0587 * 0.043 / 0.033, rel=0.01)
    assert [plan.draft_tokens for plan in policy.choose([FakeSequence() for _ in range(16)])] == [0] * 16


def test_calibration_gives_a_curve_its_shape_even_after_autoregressive_rounds_measured_it(tiny_pair):
    """Autoregressive rounds measure verify(1) only; a decoder that served them first still
    calibrates before the first request it steers, or verify(5) would be guessed 5 x verify(1)
    (the one point scaled), and drafting would never look as if it paid."""
    target, draft = TorchEngine(tiny_pair / "target"), TorchEngine(tiny_pair / "draft")
    policy = LoadPolicy(target, draft)
    policy.price.observe_verify(1, 0.004)
    policy.price.observe_verify(1, 0.004, alone=True)
    for _ in range(20):
        policy.price.observe_verify(16, 0.5, alone=True)  # measured against the one point's guess
    policy.calibrate()
    for curve in (policy.price.verify_cost, policy.price.alone_cost, policy.price.draft_cost):
        assert len(curve.points) > 4 and 5 in curve.points
    for curve in (policy.price.alone_cost, policy.price.draft_cost):  # measured at several sizes, or none
        assert curve(16) == pytest.approx(CostCurve(curve.points)(16))  # the calibration's, nothing carried over
    shape = CostCurve(policy.price.verify_cost.points)  # measured at one size: the calibration's shape at that level
    assert policy.price.verify_cost(1) == pytest.approx(0.004)
    assert policy.price.verify_cost(5) == pytest.approx(shape(5) * 0.004 / shape(1))


def test_host_time_fits_a_line_and_older_measurements_fade():
    host = LinearCost()
    for batch in (1, 2, 4):
        host.observe(batch, 0.001 + 0.0002 * batch)
    assert host.coefficients() == pytest.approx((0.001, 0.0002))
    for _ in range(400):
        host.observe(2, 0.002)
    assert host(2) == pytest.approx(0.002, rel=0.05)


def test_a_weight_bound_target_drafts_the_most_and_a_compute_bound_one_none():
    cheap_draft = measured(0.0002, 0.00001)
    weight_bound = policy_with(measured(0.005, 0.00002), cheap_draft, acceptance=0.8)
    compute_bound = policy_with(measured(0.0001, 0.001), measured(0.0008, 0.0005), acceptance=0.3)
    assert [plan.draft_tokens for plan in weight_bound.choose([FakeSequence()])] == [4]
    assert [plan.draft_tokens for plan in compute_bound.choose([FakeSequence()] * 4)] == [0] * 4


def test_each_kind_of_round_pays_its_own_host_work():
    """A round that pre-speculates runs the worker's Python beside its own (bench pair, one
    stream: 0.4-0.6 ms of host work a round against 0.2 drafting without): priced with the
    host work of rounds that drafted without it, pre-speculation that saves less than its
    own host work would still be chosen."""
    def choice(speculating_host_s: float) -> Plan:
        policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.8)
        for drafted, speculated, seconds in ((False, False, 0.0002), (True, False, 0.0002),
                                             (True, True, speculating_host_s)):
            policy.price.observe_host(1, seconds, drafted, speculated)
        return policy.choose([FakeSequence(prespeculating=True)])[0]

    alike, dearer = choice(0.0002), choice(0.003)
    assert alike.draft_tokens and alike.prespeculate  # its hits save more drafting than it costs
    assert dearer.draft_tokens and not dearer.prespeculate  # 2.8 ms more host work than it saves


def test_a_drafting_round_is_never_priced_below_a_plain_round_in_host_work():
    """Each kind's host line is measured where it ran: drafting at one and two streams,
    plain rounds at eight too, slowed there by a server's other threads. Extrapolated, the
    drafting line would price a drafting round of 8 below a plain one, as if drafting
    saved host work."""
    price = RoundPrice(SessionChoice())
    for _ in range(50):
        for requests in (1, 2):
            price.observe_host(requests, 0.0001 * requests)
            price.observe_host(requests, 0.0005 + 0.0001 * requests, drafted=True)
            price.observe_host(requests, 0.0008 + 0.0001 * requests, drafted=True, speculated=True)
        price.observe_host(8, 0.003)
    assert price.drafting_host_cost(8) < price.host_cost(8)  # the lines as measured
    assert price.host_seconds(8, drafting=True) == price.host_seconds(8, drafting=True, speculating=True) \
        == pytest.approx(price.host_cost(8))
    # where drafting rounds were measured, they are priced as measured
    assert price.host_cost(1) < price.drafting_host_cost(1) < price.speculating_host_cost(1)
    assert price.host_seconds(1, drafting=True) == pytest.approx(price.drafting_host_cost(1))
    assert price.host_seconds(1, drafting=True, speculating=True) == pytest.approx(price.speculating_host_cost(1))


def test_k_follows_load():
    """Verification that grows with the tokens in the batch: one request drafts, sixteen
    do not; when the batch empties again K comes back."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    alone = policy.choose([FakeSequence()])[0].draft_tokens
    crowded = {plan.draft_tokens for plan in policy.choose([FakeSequence() for _ in range(16)])}
    assert alone >= 2 and max(crowded) < alone
    assert policy.choose([FakeSequence()])[0].draft_tokens == alone


def matches_measured(policy: LoadPolicy, acceptance: float) -> None:
    shared = policy.shared_matched[True]  # as if many matched rounds accepted each depth with `acceptance`
    shared.verified, shared.accepted = [1000.0] * 4, [1000.0 * acceptance] * 4


def test_n_gram_matches_are_priced_apart_with_no_draft_forward():
    """A draft model that does not pay at one stream (SmolLM2's head: a round of K = 1
    costs a draft step of a quarter of the target's and accepts a third) leaves its K at 0,
    while the request's n-gram matches, which cost no draft forward and are accepted 8
    times in 10, draft; under a compute-bound load neither does, and a request without
    n-gram matches drafts none."""
    def policy(verify: CostCurve) -> LoadPolicy:
        chosen = policy_with(verify, measured(0.003, 0.0001), acceptance=0.3)
        matches_measured(chosen, 0.8)
        return chosen

    one_stream = policy(measured(0.0088, 0.0003))
    plan = one_stream.choose([FakeSequence(may_match=True)])[0]
    assert plan.draft_tokens == 0 and plan.matched_tokens == 4
    assert one_stream.choose([FakeSequence(may_match=False)])[0].matched_tokens == 0
    pinned = one_stream.choose([FakeSequence(may_match=True, adapts=False, steered=False)])[0]
    assert pinned.draft_tokens == 4 and pinned.matched_tokens == 0  # a pinned K is its own, matched or not
    compute_bound = policy(measured(0.0001, 0.001))
    assert {plan.matched_tokens for plan in compute_bound.choose([FakeSequence(may_match=True)] * 16)} == {0}
    poor_matches = policy(measured(0.0088, 0.0003))
    matches_measured(poor_matches, 0.02)
    assert poor_matches.choose([FakeSequence(may_match=True)])[0].matched_tokens == 0


def test_matched_rounds_are_counted_apart_from_the_models():
    policy = policy_with(measured(0.0088, 0.0003), measured(0.003, 0.0001), acceptance=0.3)
    sequence = FakeSequence(may_match=True)
    report = RoundReport(1, 5, 0.009, True, undrafted=None)
    report.sequences.append(SequenceRound(sequence.matched_acceptance, True, 4, 4, None, 4, matched=True))
    before = list(policy.shared[True].verified)
    policy.observe_round(report)
    assert sequence.matched_acceptance.verified == [1.0] * 4 and sequence.acceptance.verified == []
    assert policy.shared_matched[True].verified == [1.0] * 4 and policy.shared[True].verified == before


def test_a_target_that_pads_rows_prices_a_verification_by_its_widest_row():
    """ONNX Runtime engines pad a batch's rows to the widest (`pack_steps`): in one process
    on the bench engines a round of 16 rows, a few of them verifying 4 n-gram matches,
    took 22-24 ms against 9-10 for 16 rows of one token, where the tokens fed (25 against
    16) had priced it at 1.5 times."""
    assert verify_size([1, 5, 1, 1], padded=True) == 20 and verify_size([1, 5, 1, 1], padded=False) == 8
    model = Candidate(4, True, True, [1.0] * 5, [1.0] * 5, 0.0, False)
    assert RoundPrice(SessionChoice(), padded=True).verify_size([model] * 4, [0, 4, 0, 0]) == 20
    assert RoundPrice(SessionChoice()).verify_size([model] * 4, [0, 4, 0, 0]) == 8
    matches = replace(model, free=True, matching=0.5)  # a match leads half its rounds
    # rows as wide as a match's when any of the four finds one (15 in 16 rounds)
    assert RoundPrice(SessionChoice(), padded=True).verify_size([matches] * 4, [2] * 4) == pytest.approx(4 * 2.875)
    assert RoundPrice(SessionChoice()).verify_size([matches] * 4, [2] * 4) == pytest.approx(4 * 2)


def test_the_clock_weighs_letting_matches_draft_and_its_veto_stops_them():
    """Matches the price lets draft at 4 streams, where each verifies every row as wide as
    the widest (bench pair: 6.98 ms for rounds of 4 rows x 3 against 4.05 for 4 x 1) and
    committed 5.2 tokens a round against 4: the rounds that may draft them count as
    drafting for the clock, and where those measured slower they draft nothing."""
    policy = policy_with(measured(0.0088, 0.0003), measured(0.003, 0.0001), acceptance=0.3)
    matches_measured(policy, 0.8)
    batch = [FakeSequence(may_match=True) for _ in range(4)]
    assert all(plan.matched_tokens for plan in policy.choose(batch))
    for _ in range(20):  # drafting matches measured slower than drafting nothing at 4 requests
        policy.clock.observe(4, True, 5, 0.0077)
        policy.clock.observe(4, False, 4, 0.0042)
    plans = policy.choose(batch)
    assert [plan.matched_tokens for plan in plans] == [0] * 4 and policy.clock.sizes[4].vetoed
    assert [plan.matched_tokens for plan in policy.choose(batch[:1])] != [0]  # one request: not vetoed there


def test_a_request_whose_drafts_are_rejected_drafts_less():
    policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.7)
    poor = FakeSequence()
    for _ in range(100):
        poor.acceptance.record(4, 0)  # its own rounds: the first draft always rejected
    good, bad = policy.choose([FakeSequence(), FakeSequence(), poor])[1:]
    assert bad.draft_tokens < good.draft_tokens


def test_a_draft_that_stops_short_is_priced_for_what_it_proposes():
    """An n-gram draft asked for 4 tokens proposes none in most rounds: the round verifies
    only what was proposed, and counts as accepted only what was proposed and accepted."""
    counts = Acceptance()
    for _ in range(30):
        counts.record(0, 0, asked=4)    # nothing matched
    for _ in range(10):
        counts.record(2, 2, asked=3)    # two proposed and accepted, then nothing matched
    counts.record(4, 1, asked=4)        # a whole draft; the second token rejected
    rates = counts.proposal_rates(4)
    assert rates[0] == pytest.approx((11 + 8) / (41 + 8))  # proposed at depth 1 in 11 rounds of 41
    assert rates[2] == pytest.approx((1 + 8) / (11 + 8))   # at depth 3 in 1 of the 11 that reached it
    assert Acceptance().proposal_rates(2) == [1.0, 1.0]     # a model proposes every token asked

    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    stopping = FakeSequence(acceptance=counts)
    model, ngram = policy._candidate(FakeSequence()), policy._candidate(stopping)
    assert model.verified_tokens(4) == 5
    assert 1 < ngram.verified_tokens(4) < model.verified_tokens(4) / 2
    assert ngram.expected_tokens(4) < model.expected_tokens(4)
    price = policy.price
    assert price.modelled_seconds([ngram], [4]) < price.modelled_seconds([model], [4])
    # the same drafting priced, a verification the expected proposals narrower
    assert price.modelled_seconds([model], [4]) - price.modelled_seconds([ngram], [4]) == pytest.approx(
        (model.verified_tokens(4) - ngram.verified_tokens(4)) * 0.0004, rel=0.05)


def test_a_round_that_drafts_nothing_is_priced_by_its_size_alone():
    """`undrafted_seconds`, asked beside every K weighed, is `modelled_seconds` at K = 0
    for any batch of that size: model drafts, n-gram drafts, pre-speculating or not, rows
    padded or not."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    stopping = Acceptance()
    for _ in range(10):
        stopping.record(0, 0, asked=4)
    batch = [policy._candidate(FakeSequence()), policy._candidate(FakeSequence(acceptance=stopping))]
    batch.append(replace(batch[1], free=True, matching=0.3))
    price = policy.price
    for padded in (False, True):
        price.padded = padded
        for size in (1, 2, 3):
            assert price.undrafted_seconds(size) == price.modelled_seconds(batch[:size], [0] * size)
    assert price.undrafted_seconds(3) > price.undrafted_seconds(1)
    assert price.seconds(batch, [0, 0, 0]) == price.undrafted_seconds(3)


def test_a_draft_that_must_first_feed_a_long_lag_drafts_only_where_the_rounds_left_repay_it():
    """A draft cache that lacks 300 committed tokens (a prompt it never fed, a long stretch
    at K = 0) feeds them before its first draft step, on the round's critical path: paid
    once, so it is weighed against the rounds the request has left."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.0002), acceptance=0.6)
    assert policy.choose([FakeSequence()])[0].draft_tokens > 0
    assert policy.choose([FakeSequence(draft_lag=300, room=4000)])[0].draft_tokens > 0
    assert policy.choose([FakeSequence(draft_lag=300, room=8)])[0].draft_tokens == 0


def test_a_pinned_request_keeps_its_k_and_the_end_of_the_output_bounds_it():
    policy = policy_with(measured(0.0001, 0.001), measured(0.0008, 0.0005), acceptance=0.1)
    plans = policy.choose([FakeSequence(adapts=False, k=3), FakeSequence(k=4, room=2)])
    assert [plan.draft_tokens for plan in plans] == [3, 0]


def test_new_requests_start_from_what_the_others_showed():
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.2)
    before = policy.choose([FakeSequence()])[0].draft_tokens
    for _ in range(1500):
        policy.record_round(Acceptance(), True, 4, 4)  # every draft accepted, by other requests
    after = policy.choose([FakeSequence()])[0].draft_tokens
    assert before < after == 4


def test_branches_fit_under_the_verification():
    verify, step = measured(0.006, 0.0), measured(0.0005, 0.00005)  # verify 6 ms, step 0.5 ms + 0.05/row
    policy = policy_with(verify, step, acceptance=0.8)
    plans = policy.choose([FakeSequence(prespeculating=True) for _ in range(2)])
    k = plans[0].draft_tokens
    branches = plans[0].branches
    verified = verify(sum(p.draft_tokens + 1 for p in plans))
    assert (k + 1) * step(2 * branches) <= verified + 1e-9
    assert (k + 1) * step(2 * (branches + 1)) > verified  # the most that fits


def test_a_pinned_k_with_an_auto_budget_keeps_its_k_and_gets_the_branches_that_fit():
    verify, step = measured(0.006, 0.0), measured(0.0005, 0.00005)
    policy = policy_with(verify, step, acceptance=0.8)
    auto = FakeSequence(k=3, adapts=False, steered=True, prespeculating=True)
    fixed = FakeSequence(k=3, adapts=False, steered=False, prespeculating=True)
    plans = policy.choose([auto, fixed])
    assert [plan.draft_tokens for plan in plans] == [3, 3]
    assert plans[0].branches is not None and plans[0].branches >= 1
    assert plans[1].branches is None  # its own fan-out, as it asked


def test_the_policy_starts_from_a_calibration_taken_on_this_machine_without_measuring(tiny_pair, monkeypatch):
    import saguaro.runtime.control.load_policy as load_policy
    from saguaro.runtime.control.calibration import Calibration, machine_name

    target, draft = TorchEngine(tiny_pair / "target"), TorchEngine(tiny_pair / "draft")
    here = Calibration(32, {1: 0.001, 5: 0.0012}, {1: 0.0002, 8: 0.0004}, {1: 0.0008, 5: 0.001}, machine_name())
    measured_now = []
    monkeypatch.setattr(load_policy, "measure_calibration", lambda *a, **k: measured_now.append(1) or here)
    target.info = replace(target.info, calibration=here)
    policy = LoadPolicy(target, draft)
    policy.calibrate()
    assert not measured_now and policy.price.verify_cost.points == here.verify and policy.price.alone_cost.points == here.alone
    assert policy.price.draft_cost.points == here.draft == policy.price.tree_cost.points
    target.info = replace(target.info, calibration=replace(here, machine="another machine"))
    LoadPolicy(target, draft).calibrate()
    assert measured_now == [1]  # taken elsewhere: measured here, the same way


def test_adaptive_greedy_output_is_the_target_alone(tiny_pair):
    """Whatever K the policy picks round to round, greedy output is the target's."""
    pipeline = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    prompt = pipeline.encode("The with statement")
    reference = pipeline.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=40, eos_token_id=-1),
                                  SamplingParams())
    for mode in ("speculative", "ssd"):
        options = DecodeOptions(mode=mode, num_draft_tokens=4, adapt_k=True, max_tokens=40, eos_token_id=-1)
        assert pipeline.generate(prompt, options, SamplingParams()).output_ids == reference.output_ids
    pipeline.close()


def test_pre_speculation_that_cannot_hide_is_left_out_for_adapting_requests_only():
    slow_tree = policy_with(measured(0.002, 0.0), measured(0.004, 0.001), acceptance=0.6)
    for counts in slow_tree.shared.values():
        counts.hits, counts.lookups = 100.0, 1000.0  # and it rarely hits
    adapting, pinned = slow_tree.choose([FakeSequence(prespeculating=True),
                                         FakeSequence(prespeculating=True, adapts=False, steered=False)])
    assert not adapting.prespeculate and pinned.prespeculate



def test_drafting_before_the_round_is_priced_by_the_chance_that_some_request_misses():
    """A request that finds its drafts pre-speculated 9 times in 10 drafts before the
    round once in 10 rounds, not in every round; in a batch, the step runs when any request
    misses, for the requests that missed."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.002, 0.0005), acceptance=0.8)
    step = policy.price.draft_cost
    assert policy.price.missed_drafting_seconds([0.9], 1) == pytest.approx(0.1 * step(1))
    assert policy.price.missed_drafting_seconds([0.0], 1) == pytest.approx(step(1))  # no pre-speculation
    assert policy.price.missed_drafting_seconds([1.0, 1.0], 1) == 0.0
    some_miss = 1 - 0.9 ** 16
    assert policy.price.missed_drafting_seconds([0.9] * 16, 1) == pytest.approx(some_miss * step(1.6 / some_miss))


def test_a_drafting_rounds_start_is_priced_once_not_with_every_step():
    """A round's first draft forward follows the verification (the draft's weights out of
    the caches) and the drafts' setup: on the bench pair at one stream about 1 ms a round
    beyond 0.6 ms a later step. Priced per step, rounds at K = 1 (1.6 ms a step) priced K =
    4 at four times that where it takes 3.4 ms, and the policy drafted too little."""
    price = RoundPrice(SessionChoice())
    price.draft_cost = measured(0.0006, 0.0)
    for _ in range(50):
        price.observe_drafting(1, 1, 0.0016, 0.0)      # K = 1: the start and one step
        price.observe_drafting(1, 4, 0.0034, 0.0018)   # K = 4: three later steps of 0.6 ms
    assert price.draft_cost(1) == pytest.approx(0.0006, rel=0.05)
    assert price.missed_drafting_seconds([0.0], 1) == pytest.approx(0.0016, rel=0.05)
    assert price.missed_drafting_seconds([0.0], 4) == pytest.approx(0.0034, rel=0.05)


def rounds_of(policy: LoadPolicy, sequence: FakeSequence, rounds: int, accepts, hits: bool | None = None) -> list[Plan]:
    """`rounds` rounds of one request: each verifies what its plan drafts, and `accepts(k)`
    of them are accepted; with `hits` given, a round that pre-speculated finds its
    branches so (else no lookup is counted)."""
    plans = []
    for _ in range(rounds):
        plan = sequence.plan = policy.choose([sequence])[0]
        policy.record_round(sequence.acceptance, sequence.greedy, plan.draft_tokens, accepts(plan.draft_tokens))
        if hits is not None and plan.draft_tokens and plan.prespeculate:
            policy.record_lookup(sequence.acceptance, sequence.greedy, hits)
        plans.append(plan)
    return plans


def test_speculation_that_does_not_pay_turns_off_probes_every_period_and_comes_back():
    """Costs where drafting pays at good acceptance: a draft that is always rejected gets
    K = 0 within a few rounds, then one probe round (PROBE_DRAFTS drafts, not
    pre-speculated) after PROBE_PERIOD rounds, the next after twice as many, and so on up
    to 2^PROBE_BACKOFF periods; once its drafts are accepted, K comes back within a period
    and climbs to the most the request allows."""
    policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.8)
    policy.shared[True].verified, policy.shared[True].accepted = [], []  # nothing measured yet
    sequence = FakeSequence(prespeculating=True)
    # a draft the target never agrees with never guesses its bonus token either
    plans = rounds_of(policy, sequence, 8 + 31 * PROBE_PERIOD, accepts=lambda k: 0, hits=False)
    off = next(i for i, plan in enumerate(plans) if plan.draft_tokens == 0)
    assert off <= 2 * REPLAN_ROUNDS and plans[0].draft_tokens == 4  # within two choices
    drafting = [i for i, plan in enumerate(plans) if i > off and plan.draft_tokens]
    gaps = [b - a for a, b in zip([off - 1] + drafting, drafting)]
    assert gaps == [PROBE_PERIOD, 2 * PROBE_PERIOD, 4 * PROBE_PERIOD, 8 * PROBE_PERIOD, 8 * PROBE_PERIOD]
    assert all(plans[i].probe and plans[i].draft_tokens == PROBE_DRAFTS and not plans[i].prespeculate
               for i in drafting)

    sequence.plan = replace_quiet(sequence.plan, PROBE_PERIOD - 1)  # the next round probes
    better = rounds_of(policy, sequence, 2 * PROBE_PERIOD, accepts=lambda k: k)
    back = next(i for i, plan in enumerate(better) if plan.draft_tokens and not plan.probe)
    assert back < PROBE_PERIOD and better[-1].draft_tokens == 4 and not better[-1].probe


def rounds_weighed(policy: LoadPolicy, acceptance: float, rounds: int) -> list[int]:
    """The rounds in which the policy weighed every K afresh, of `rounds` rounds of one
    request whose drafts are accepted `acceptance` a depth, probes aside."""
    weighed, weigh = [], policy._best

    def counted(*args):
        weighed.append(len(plans))
        return weigh(*args)
    policy._best = counted
    policy.probes.spacing = 1 << 30
    sequence, plans = FakeSequence(prespeculating=True), []
    for _ in range(rounds):
        sequence.plan = policy.choose([sequence])[0]  # a weighing in it counts len(plans)
        plans.append(sequence.plan)
        drafts = sequence.plan.draft_tokens
        policy.record_round(sequence.acceptance, sequence.greedy, drafts, round(acceptance * drafts))
    return sorted(set(weighed))


def test_a_choice_in_which_nothing_drafts_holds_longer_each_time_it_is_made_again():
    """A weight-bound target where drafts the target always rejects do not pay (a probe
    could still show otherwise: not hopeless): the choice of K = 0 holds `REPLAN_ROUNDS`,
    then twice as long each time it is made again, up to 2^REPLAN_BACKOFF times (the
    weighing was half of the policy's Python at one stream). A choice that drafts holds
    `REPLAN_ROUNDS` each time: its acceptance moves round by round."""
    undrafted = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.0)
    holds = [REPLAN_ROUNDS << min(i, REPLAN_BACKOFF) for i in range(6)]
    assert rounds_weighed(undrafted, 0.0, sum(holds)) == [sum(holds[:i]) for i in range(6)]
    assert not undrafted._hopeless and holds[-1] == REPLAN_ROUNDS << REPLAN_BACKOFF
    drafting = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=1.0)
    assert rounds_weighed(drafting, 1.0, 5 * REPLAN_ROUNDS) == [i * REPLAN_ROUNDS for i in range(5)]


def test_a_held_choice_of_k_zero_plans_as_the_whole_choice_would():
    """While the kept choice drafts nothing and holds, a round's plans are made without
    weighing candidates (`_held_undrafted`); they are the plans the whole choice makes,
    probes included, round for round: one request, pre-speculating and not, and two
    requests of which one drafts in its probes and the other's K is pinned at 0."""
    def plans_of(shortcut: bool, batch_of) -> tuple[list[list[Plan]], int]:
        policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.8)
        policy.shared[True].verified, policy.shared[True].accepted = [], []
        held, shortcuts = policy._held_undrafted, []

        def counted(batch):
            shortcuts.append(held(batch) if shortcut else None)
            return shortcuts[-1]
        policy._held_undrafted = counted
        batch, plans = batch_of(), []
        for round_index in range(12 * PROBE_PERIOD):
            chosen = policy.choose(batch)
            for sequence, plan in zip(batch, chosen):
                sequence.plan = plan
                accepted = 1 if plan.probe and round_index > 8 * PROBE_PERIOD else 0  # comes back late
                policy.record_round(sequence.acceptance, sequence.greedy, plan.draft_tokens, accepted)
            # and when it weighs again, and what the clock counts the round as
            plans.append((chosen, policy._kept.rounds_left, policy._undrafted_choices, policy.clock._kind))
        return plans, sum(plan is not None for plan in shortcuts)

    for batch_of in (lambda: [FakeSequence()], lambda: [FakeSequence(prespeculating=True)],
                     lambda: [FakeSequence(prespeculating=True), FakeSequence(k=0, adapts=False)]):
        whole, _ = plans_of(False, batch_of)
        shortcut, used = plans_of(True, batch_of)
        assert shortcut == whole
        assert used > len(whole) // 2  # the shortcut made most rounds' plans
        assert sum(plan.probe for plans, *_ in whole for plan in plans) >= 3


def test_no_probe_while_drafting_could_not_pay_at_this_load_and_one_as_soon_as_it_could():
    """A compute-bound target at 16 requests: even drafts accepted as often as the optimistic
    prior would not pay, so a request due to probe does not (a probe's draft step and
    catch-up were pure loss there); alone in the batch, the same request probes at once."""
    policy = policy_with(measured(0.0001, 0.001), measured(0.0008, 0.0005), acceptance=0.0)
    due = [FakeSequence(plan=Plan(0, quiet=PROBE_PERIOD - 1)) for _ in range(16)]
    crowded = policy.choose(due)
    assert all(not plan.draft_tokens and not plan.probe for plan in crowded)
    assert all(plan.quiet == PROBE_PERIOD for plan in crowded)  # still due: counted on
    weight_bound = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.0)
    alone = weight_bound.choose([FakeSequence(plan=Plan(0, quiet=PROBE_PERIOD))])[0]
    assert alone.probe and alone.draft_tokens == PROBE_DRAFTS


def test_a_request_whose_drafts_pay_only_pre_speculated_keeps_probing():
    """One stream where drafting after the verification never pays (a draft step costs
    nearly a verification) but pre-speculated drafts do, and the draft's other requests
    were accepted 9 times in 10. A request whose own drafts were all rejected gets K = 0;
    its probes go on, since a probe could show it as good as the others and pre-speculation
    would then pay. Asked only of the optimistic prior without pre-speculation, such a
    request was held hopeless with no probe for the rest of its life (the bench pair at
    one stream: K = 0 in most rounds where K = 3 ran 1.15x faster)."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.004, 0.00002), acceptance=0.9)
    policy.price.tree_cost = measured(0.001, 0.00002)  # a pre-speculation step is cheap beside the verification
    sequence = FakeSequence(prespeculating=True)
    for _ in range(30):
        sequence.acceptance.record(4, 0)  # its own drafts: all rejected
    plans = rounds_of(policy, sequence, 3 * PROBE_PERIOD, accepts=lambda k: 0)
    assert plans[0].draft_tokens == 0 and plans[0].undrafted == "priced"
    assert not any(plan.undrafted == "held" for plan in plans)
    probes = [i for i, plan in enumerate(plans) if plan.probe]
    assert probes and probes[0] < PROBE_PERIOD


def test_a_request_that_may_pre_speculate_is_not_held_hopeless_on_the_unseen_hit_rate():
    """One stream, its draft's acceptance measured at build time (0.5, on other text) below
    what its drafts now show (0.76), no pre-speculation measured yet (hits as likely as the
    build-time acceptance): drafting after the verification does not pay, pre-speculated
    drafts do once they hit often. A probe cannot measure the hit rate, so the check that
    holds K = 0 without probes asks with hits as likely as the prior's acceptance: the
    request probes. (The bench pair at one stream, after an autoregressive stretch: held
    with no probe, at AR's speed, where K = 3 ran 1.2x faster.)"""
    policy = policy_with(measured(0.004, 0.0004), measured(0.007, 0.00002), acceptance=0.76)
    policy.price.tree_cost = measured(0.001, 0.00002)  # a pre-speculation step is cheap beside the verification
    policy.measured_acceptance = (0.5, 0.5, 0.5, 0.5)
    sequence = FakeSequence(prespeculating=True)
    plans = rounds_of(policy, sequence, 2 * PROBE_PERIOD, accepts=lambda k: k)
    assert plans[0].draft_tokens == 0 and plans[0].undrafted == "priced"
    assert not any(plan.undrafted == "held" for plan in plans[:PROBE_PERIOD])
    assert any(plan.probe for plan in plans[:PROBE_PERIOD + 1])


def test_a_fresh_policy_prices_pre_speculation_as_its_draft_was_measured_to_agree():
    """Nothing measured yet, the draft's acceptance measured at build time (0.87, as the
    bench pair's): a pre-speculated branch is the outcome about as often as the draft's
    first token is accepted, so the first choice is the one a policy that measured hits
    that often makes. (A probe drafts without pre-speculation and never measures the hit
    rate: priced at a flat 0.5, a fresh server's one stream on the bench pair stayed at
    K = 0 or 1 where pre-speculated K = 4 pays.)"""
    def fresh_policy():
        policy = policy_with(measured(0.005, 0.0004), measured(0.008, 0.00002), acceptance=0.0)
        policy.shared[True].verified, policy.shared[True].accepted = [], []  # nothing measured yet
        policy.price.tree_cost = measured(0.0005, 0.00002)  # pre-speculation hides under the verification
        policy.measured_acceptance = (0.87, 0.87, 0.87, 0.87)
        return policy
    seasoned = fresh_policy()
    for lookup in range(1000):
        seasoned.record_lookup(Acceptance(), True, hit=lookup % 100 < 87)
    first, measured_choice = (policy.choose([FakeSequence(prespeculating=True)])[0]
                              for policy in (fresh_policy(), seasoned))
    assert first.draft_tokens == measured_choice.draft_tokens == 4
    assert first.prespeculate and measured_choice.prespeculate


def test_a_batch_probes_once_a_period_not_once_per_request():
    """Four requests with speculation off, all due to probe: one probes (the estimate it
    measures is shared by its kind), the others wait a period, and the next probe is
    another's; a sampled request keeps a period of its own."""
    policy = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.0)
    policy.shared[False].verified, policy.shared[False].accepted = [1000.0] * 4, [0.0] * 4
    batch = [FakeSequence(plan=Plan(0, quiet=PROBE_PERIOD)) for _ in range(4)] + [
        FakeSequence(greedy=False, plan=Plan(0, quiet=PROBE_PERIOD))]
    probes = []
    for _ in range(2 * PROBE_PERIOD):
        plans = policy.choose(batch)
        for sequence, plan in zip(batch, plans):
            sequence.plan = plan
            policy.record_round(sequence.acceptance, sequence.greedy, plan.draft_tokens, 0)  # rejected
        probes.append([index for index, plan in enumerate(plans) if plan.probe])
    greedy_probes = [(round_, index) for round_, indices in enumerate(probes) for index in indices if index < 4]
    assert [round_ for round_, _ in greedy_probes] == [0, PROBE_PERIOD]  # one a period, not four
    assert len({index for _, index in greedy_probes}) == 2  # a request that waited probes next
    # the sampled request probed beside the greedy one, on its own period (doubled after its
    # rejected probe: alone of its kind, its own back-off is the kind's)
    assert [round_ for round_, indices in enumerate(probes) if 4 in indices] == [0]


def test_a_round_without_drafts_counts_nothing_and_is_the_requests_last_round():
    """A request that verified no drafts (held at K = 0) fades and counts nothing, its own
    or its kind's, but its last round is now one without drafts: a kept choice replans
    after a round whose drafts were all rejected, and a stale one would replan every round."""
    policy = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.5)
    own, shared = Acceptance(fading=0.9), policy.shared[True]
    policy.record_round(own, True, 2, 0)  # its drafts, all rejected
    assert own.last == (2, 0)
    counted = (list(own.verified), list(own.accepted), list(shared.verified), list(shared.accepted))
    policy.record_round(own, True, 0, 0)
    assert own.last == (0, 0)
    assert (own.verified, own.accepted, shared.verified, shared.accepted) == counted


def test_probes_whose_rounds_cost_more_than_their_share_are_spaced_out():
    """A sampled request at one stream: a probe's round took 25-28 ms against 14-15 for a
    round without one (the draft first caught up the tokens it had missed). Probes are
    spaced so that they take at most PROBE_SHARE of the rounds' time: a request due after
    PROBE_PERIOD quiet rounds waits until the spacing has passed; cheap probes keep the
    period."""
    policy = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.0)
    for _ in range(3):
        policy.probes.observe(0.012, 0.014)
    assert policy.probes.spacing == math.ceil(0.012 / (PROBE_SHARE * 0.014)) > 2 * PROBE_PERIOD
    plans = rounds_of(policy, FakeSequence(plan=Plan(0, quiet=PROBE_PERIOD)), 2 * policy.probes.spacing,
                      accepts=lambda k: 0)
    probes = [i for i, plan in enumerate(plans) if plan.probe]
    assert probes[0] == policy.probes.spacing - PROBE_PERIOD - 1  # not at once: the spacing first
    cheap = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.0)
    cheap.probes.observe(0.0001, 0.014)
    assert cheap.probes.spacing == PROBE_PERIOD
    assert cheap.choose([FakeSequence(plan=Plan(0, quiet=PROBE_PERIOD))])[0].probe


def test_a_probes_round_is_measured_against_its_price_without_the_probe():
    policy = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.0)
    sequence = FakeSequence(plan=Plan(0, quiet=PROBE_PERIOD))
    plan = policy.choose([sequence])[0]
    assert plan.probe and policy._probe_priced is not None
    policy.observe_round(RoundReport(1, 2, verify_s=policy._probe_priced + 0.012, alone=True, undrafted=None))
    assert policy.probes.cost == pytest.approx(0.012)


def test_no_catch_up_while_nothing_could_draft_at_this_load():
    """The draft caches of requests at K = 0 catch up beside a verification only while some
    K could pay: at a load where none could, a catch-up would serve no draft."""
    crowded = policy_with(measured(0.0001, 0.001), measured(0.0008, 0.0005), acceptance=0.0)
    crowded.choose([FakeSequence() for _ in range(16)])
    assert crowded.catch_up_share(16, 16) == 0
    weight_bound = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.0)
    assert [plan.draft_tokens for plan in weight_bound.choose([FakeSequence()])] == [0]  # off, for now
    assert weight_bound.catch_up_share(1, 1) >= 1


def test_a_catch_up_beside_a_verification_takes_what_one_draft_forward_does_in_its_time():
    verify = measured(0.004, 0.0004)                # verify(16) = 10.4 ms
    policy = policy_with(verify, measured(0.0005, 0.0001), acceptance=0.5)  # a row costs 0.1 ms
    share = policy.catch_up_share(16, 16)
    assert 16 * share <= 99 and 16 * (share + 1) > 95  # (10.4 - 0.5) / 0.1 rows in all
    assert policy_with(verify, measured(0.02, 0.001), acceptance=0.5).catch_up_share(16, 16) == 1  # at least one


def replace_quiet(plan: Plan, quiet: int) -> Plan:
    return Plan(plan.draft_tokens, plan.prespeculate, plan.branches, quiet, plan.probe)


def to_a_trial(policy: LoadPolicy, tokens: int = 1) -> bool:
    """Rounds without pre-speculation up to the next on the session tried now and then;
    whether that is the wide session."""
    for _ in range(TRIAL_PERIOD << TRIAL_BACKOFF):
        wide = policy.sessions.runs_alone(tokens)
        if policy.sessions.trialling:
            return wide
        policy.sessions.verified(0.004)
    raise AssertionError("no trial within the longest period")


def test_a_trial_moves_its_curve_half_way_down_and_up_only_as_any_round_does():
    """A trial of the other session that measured fast moves its curve half way down: the
    curves price the rounds, and a curve a busy spell had inflated, measured once a period,
    would take hundreds of rounds to come back. One that fell in a busy moment moves it up
    by the curves' usual following (a forward is only ever slowed by the machine). Rounds
    of the usual session follow as ever."""
    policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.5)
    policy.price.alone_cost = measured(0.002, 0.0003)
    assert to_a_trial(policy) is False  # the wide session is the usual one: the trial is the other's
    level = policy.price.verify_cost(1)
    policy.price.observe_verify(1, 10 * level, alone=False)  # preempted: ten times its level
    assert policy.price.verify_cost(1) == pytest.approx(level * 10 ** FOLLOWING, rel=0.01)
    policy.sessions.verified(10 * level)
    assert not policy.sessions.trialling
    slow = policy.price.verify_cost(1)
    to_a_trial(policy)
    policy.price.observe_verify(1, slow / 4, alone=False)
    assert policy.price.verify_cost(1) == pytest.approx(slow * 0.25 ** TRIAL_FOLLOWING, rel=0.01)
    policy.sessions.verified(slow / 4)
    usual = policy.price.alone_cost(1)
    policy.price.observe_verify(1, usual / 4, alone=True)  # not a trial: the usual following
    assert policy.price.alone_cost(1) == pytest.approx(usual * 0.25 ** FOLLOWING, rel=0.01)


def test_a_round_without_pre_speculation_is_costed_alone():
    """When the target verifies alone on both cores its rounds cost less, so the policy
    compares K = 0 with drafting at that cost: with verification alone twice as fast, the
    acceptance that paid for drafting no longer does."""
    verify, draft = measured(0.004, 0.0003), measured(0.0015, 0.00002)
    shared_cores = policy_with(verify, draft, acceptance=0.5)
    alone = policy_with(verify, draft, acceptance=0.5)
    alone.price.alone_cost = measured(0.002, 0.00015)
    assert shared_cores.choose([FakeSequence()])[0].draft_tokens > 0
    assert alone.choose([FakeSequence()])[0].draft_tokens == 0


def test_a_round_without_pre_speculation_is_priced_on_the_session_its_rounds_use():
    """Rounds without pre-speculation are priced with the wide session's curve while the
    session choice keeps them there, and with the one-thread session's once paired trials
    moved them (`SessionChoice`)."""
    policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.5)
    policy.price.alone_cost = measured(0.002, 0.0003)
    assert policy.price.verify_seconds(1, alone=True) == pytest.approx(0.0023)
    assert policy.price.verify_seconds(1, alone=False) == pytest.approx(0.0043)
    policy.sessions.ratios[1] = deque([-0.2])  # trials said: the one-thread session is faster
    assert policy.price.verify_seconds(1, alone=True) == pytest.approx(0.0043)


def test_a_misprediction_follows_what_the_rounds_measured_by_batch_size():
    correction = Misprediction()
    assert correction(4) == 1.0  # nothing measured: the model as it is
    for _ in range(40):
        correction.observe(4, 0.036, 0.030)
        correction.observe(1, 0.0150, 0.0150)
    assert correction(4) == pytest.approx(1.2, rel=0.01) and correction(1) == pytest.approx(1.0, rel=0.001)
    assert correction(2) == pytest.approx(1.0 + 0.2 / 3, rel=0.01)  # between the sizes measured
    assert correction(16) == pytest.approx(1.2, rel=0.01)  # beyond them: the nearest one's
    correction.observe(4, 10.0, 0.030)  # a preempted round moves it no more than a fourfold error would
    assert correction(4) == pytest.approx(1.2 * (4 / 1.2) ** 0.2, rel=0.01)


def rounds_measured_at(policy: LoadPolicy, batch: list[FakeSequence], rounds: int, mispriced: float,
                       caught_up: bool = False) -> list[int]:
    """`rounds` rounds of `batch` in which drafting adds `mispriced` times what the policy's
    model priced it at (rounds without drafts cost what it said), each drafting round's
    drafts first catching up a draft cache if `caught_up`; returns each round's drafts in
    all."""
    drafted = []
    for _ in range(rounds):
        plans = policy.choose(batch)
        for sequence, plan in zip(batch, plans):
            sequence.plan = plan
        modelled, undrafted, _ = policy._modelled or (0.02, 0.02, False)  # the model's prices of the round
        report = RoundReport(len(batch), 0, verify_s=undrafted + mispriced * (modelled - undrafted), alone=False,
                             undrafted=undrafted_reason(plans), caught_up=caught_up and any(plan.draft_tokens for plan in plans))
        policy.observe_round(report)
        drafted.append(sum(plan.draft_tokens for plan in plans))
    return drafted


def test_drafting_rounds_measured_dearer_than_priced_turn_speculation_off_within_a_choice():
    """At 4 streams on SmolLM2 the model priced a round of K = 1 at 30.7 ms and it took
    36.4, against 19.5 for a round without drafts (the draft caches' catch-up paid again
    each time K came back, wider verifies slower than their curve): drafting added half
    again what the model said, and the policy drafted on that price at 0.83x
    autoregressive speed. Such rounds turn drafting off within two choices; rounds
    measured as priced keep it."""
    def policy_and_batch():
        policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.45)
        return policy, [FakeSequence() for _ in range(4)]

    policy, batch = policy_and_batch()
    assert all(rounds_measured_at(policy, batch, 3 * REPLAN_ROUNDS, mispriced=1.0))
    policy, batch = policy_and_batch()
    drafted = rounds_measured_at(policy, batch, 3 * REPLAN_ROUNDS, mispriced=1.5)
    assert drafted[0] > 0 and not any(drafted[2 * REPLAN_ROUNDS:])
    assert policy.price.misprediction[False](4) > 1.2 and policy.price.misprediction[True](4) == 1.0  # pre-speculating apart


def test_rounds_whose_drafts_first_caught_up_a_draft_cache_leave_the_misprediction_alone():
    """A round whose drafts first fed what a draft cache lacked (a new request's prompt, the
    tokens of a stretch at K = 0) pays that forward whole, where the model spreads it over
    the rounds it serves: it says nothing of what steady drafting costs. Counted, such
    rounds at one stream on the bench pair held every drafting price 1.2-1.7x above what
    steady rounds take, and the policy drafted less than SD with K = 4 fixed (0.83 of its
    speed; 0.90 without them)."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.001, 0.00002), acceptance=0.6)
    batch = [FakeSequence()]
    drafted = rounds_measured_at(policy, batch, 2 * REPLAN_ROUNDS, mispriced=3.0, caught_up=True)
    assert all(drafted) and policy.price.misprediction[False](1) == 1.0
    rounds_measured_at(policy, batch, 2 * REPLAN_ROUNDS, mispriced=3.0)  # the same rounds, steady
    assert policy.price.misprediction[False](1) > 1.5


def test_speculation_a_slow_spell_turned_off_comes_back_once_its_misprediction_fades():
    """A few drafting rounds preempted (measured at the fourfold limit of their price) turn
    speculation off at one stream; rounds without drafts measure no misprediction, so the
    factor fades toward 1 and the model's own price, which drafts, rules again: drafting
    comes back within a few half-lives and stays once its rounds measure as priced. Held
    as it was, the factor would keep drafting off for good (on the bench pair at one
    stream the policy then drafted in none of 765 rounds)."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.001, 0.00002), acceptance=0.6)
    batch = [FakeSequence()]
    assert all(rounds_measured_at(policy, batch, REPLAN_ROUNDS, mispriced=1.0))  # drafting pays here
    drafted = rounds_measured_at(policy, batch, 2 * REPLAN_ROUNDS, mispriced=MOST_MISPREDICTION)
    assert not any(drafted[-REPLAN_ROUNDS:])  # the slow spell turned it off
    stuck = policy.price.misprediction[False](1)
    assert stuck > 1.5
    drafted = rounds_measured_at(policy, batch, 8 * MISPREDICTION_HALF_LIFE, mispriced=1.0)
    back = next(i for i, k in enumerate(drafted) if k)
    assert MISPREDICTION_HALF_LIFE // 4 <= back < 6 * MISPREDICTION_HALF_LIFE  # not at once: faded first
    assert all(drafted[-REPLAN_ROUNDS:]) and policy.price.misprediction[False](1) < 1.1


class Disagreeing:
    """A draft engine whose logits always put `token` first (while `disagrees`), a token
    the target's greedy output never holds: every draft is rejected."""

    def __init__(self, engine, token: int):
        self.engine, self.info, self.tokenizer = engine, engine.info, engine.tokenizer
        self.token, self.disagrees = token, True

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward_rows(self, steps) -> list[Rows]:
        rows = self.engine.forward_rows(steps)
        return [Rows(self._disagreeing(r.logits), r.hidden) for r in rows] if self.disagrees else rows

    def forward_batch(self, steps):
        return [rows.logits for rows in self.forward_rows(steps)]

    def _disagreeing(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., self.token] = logits.max() + 100.0
        return logits


def with_costs_by_hand(pipeline: Pipeline) -> Pipeline:
    """The decoder's policy on the costs of the tests above, held (no calibration, no
    following, no correction, no clock, probes at their period), so that its choices depend
    on the acceptance the real rounds show only."""
    policy = pipeline.schedulers[0].decoder.load_policy
    policy.price.verify_cost, policy.price.draft_cost = measured(0.004, 0.0003), measured(0.0003, 0.00002)
    policy.price.tree_cost, policy.price.alone_cost = policy.price.draft_cost, policy.price.verify_cost
    for name in ("observe_verify", "observe_drafting", "observe_prespeculation", "observe_host"):
        setattr(policy.price, name, lambda *args, **kwargs: None)
    policy.observe_period = lambda *args, **kwargs: None
    policy.probes.observe = lambda *args, **kwargs: None
    for correction in policy.price.misprediction.values():
        correction.observe = lambda *args, **kwargs: None
    return pipeline


def plans_of_one_request(pipeline: Pipeline, prompt, options, sampling, on_round=None):
    """The generation, and the plan of each of its rounds."""
    plans = []

    def observe(batch, _):
        plans.append(batch[0].plan)
        if on_round is not None:
            on_round(len(plans))

    pipeline.observe_rounds(observe)
    return pipeline.generate(prompt, options, sampling), plans


@pytest.fixture(scope="module")
def tiny_reference(tiny_pair):
    """The tiny target's greedy output for a prompt, and a token that output never holds."""
    target = TorchEngine(tiny_pair / "target")
    pipeline = Pipeline(target, TorchEngine(tiny_pair / "draft"))
    prompt = pipeline.encode("The with statement")
    expected = pipeline.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=200, eos_token_id=-1),
                                 SamplingParams()).output_ids
    pipeline.close()
    never = next(token for token in range(target.info.vocab_size) if token not in expected)
    return target, prompt, expected, never


def test_a_request_that_drafts_nothing_is_not_steered_even_with_adapt_k(tiny_pair, tiny_reference):
    """The servers turn `adapt_k` on for every request that names no K, autoregressive ones
    too: those leave the policy nothing to choose, so their rounds are "asked" (as a client
    asked), never "held" or "priced", and they bring no calibration."""
    target, prompt, expected, _ = tiny_reference
    assert not DecodeOptions(mode="autoregressive", adapt_k=True).steered
    assert not DecodeOptions(mode="ssd", num_draft_tokens=0, fanout=(0,), adapt_k=True, budget="auto").steered
    assert DecodeOptions(mode="ssd", adapt_k=True).steered and DecodeOptions(mode="ssd", budget="auto").steered
    pipeline = Pipeline(target, TorchEngine(tiny_pair / "draft"))
    options = DecodeOptions(mode="autoregressive", adapt_k=True, max_tokens=40, eos_token_id=-1)
    generation, plans = plans_of_one_request(pipeline, prompt, options, SamplingParams())
    policy = pipeline.schedulers[0].decoder.load_policy
    pipeline.close()
    assert generation.output_ids == expected[:40]
    assert len(plans) == 39 and all(undrafted_reason([plan]) == "asked" for plan in plans)  # the first: prefill's
    assert not policy.price.verify_cost.shaped  # no calibration measured for it


def test_a_draft_that_never_agrees_is_switched_off_and_probed(tiny_pair, tiny_reference):
    """K = 0 after a few rounds, then probe rounds PROBE_PERIOD apart, twice that after a
    rejected probe, and so on (a rejected probe is not followed by another), and the
    output is the target's alone."""
    target, prompt, expected, never = tiny_reference
    pipeline = with_costs_by_hand(Pipeline(target, Disagreeing(TorchEngine(tiny_pair / "draft"), never)))
    options = DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=True, max_tokens=200, eos_token_id=-1)
    generation, plans = plans_of_one_request(pipeline, prompt, options, SamplingParams())
    pipeline.close()
    assert generation.output_ids == expected
    off = next(i for i, plan in enumerate(plans) if plan.draft_tokens == 0)
    probes = [i for i, plan in enumerate(plans) if i > off and plan.draft_tokens]
    assert off <= 3 * REPLAN_ROUNDS and len(probes) >= 2
    assert all(plans[i].probe and plans[i].draft_tokens == PROBE_DRAFTS for i in probes)
    assert [b - a for a, b in zip([off - 1] + probes, probes)] == [probe_period(n) for n in range(len(probes))]
    stats = generation.stats
    assert stats.probe_rounds == len(probes) and stats.rounds_by_k[0] == len(plans) - off - len(probes)
    assert sum(stats.rounds_by_k) == stats.rounds == len(plans)


def test_a_probe_after_a_stretch_on_the_wide_session_measures_a_draft_step(tiny_pair, tiny_reference):
    """Rounds on the wide session leave the draft no core, so a request that drafts
    nothing falls behind: its probe first catches the draft's cache up in a forward of its
    own, and the step after it is measured as a step (fed in the first step, no probe had
    measured one, and the draft step stayed at its calibration)."""
    target, prompt, expected, never = tiny_reference
    pipeline = with_costs_by_hand(Pipeline(target, Disagreeing(TorchEngine(tiny_pair / "draft"), never)))
    probes = []
    pipeline.observe_rounds(lambda batch, report: probes.append((batch[0].plan, report.drafting))
                            if batch[0].plan.probe else None)
    options = DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=True, max_tokens=120, eos_token_id=-1)
    assert pipeline.generate(prompt, options, SamplingParams()).output_ids == expected[:120]
    pipeline.close()
    assert probes and all(drafting is not None and drafting[:2] == (1, plan.draft_tokens) and drafting[2] > 0
                          for plan, drafting in probes)


def test_with_speculation_off_the_draft_catches_up_while_the_target_verifies_on_its_own_core(tiny_pair,
                                                                                            tiny_reference):
    """Rounds that do not run alone leave the draft's core free: a request that drafts
    nothing keeps its draft cache within the last round's token of the output, so a probe
    feeds one or two tokens, not the whole stretch."""
    target, prompt, expected, never = tiny_reference
    pipeline = with_costs_by_hand(Pipeline(target, Disagreeing(TorchEngine(tiny_pair / "draft"), never)))
    decoder = pipeline.schedulers[0].decoder
    decoder.alone = decoder.load_policy.sessions.enabled = False
    lags = []
    pipeline.observe_rounds(lambda batch, _: lags.append((batch[0].plan.draft_tokens,
                                                       batch[0].speculator.lag(batch[0].out.ids))))
    options = DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=True, max_tokens=120, eos_token_id=-1)
    assert pipeline.generate(prompt, options, SamplingParams()).output_ids == expected[:120]
    pipeline.close()
    quiet = [lag for (k, lag), (before, _) in zip(lags[1:], lags) if not k and not before]
    assert len(quiet) > PROBE_PERIOD and max(quiet) <= 2


def test_a_sampled_requests_k_follows_the_policy_too(tiny_pair, tiny_reference):
    """A sampled request that lets the policy choose gets K = 0 for a draft that never
    agrees (most rounds, and probes), where it used to keep its K; one that pins K keeps it."""
    target, prompt, _, never = tiny_reference
    pipeline = with_costs_by_hand(Pipeline(target, Disagreeing(TorchEngine(tiny_pair / "draft"), never)))
    sampling = SamplingParams(temperature=0.7, seed=5)
    common = dict(mode="ssd", num_draft_tokens=4, max_tokens=200, eos_token_id=-1)
    adapting = pipeline.generate(prompt, DecodeOptions(adapt_k=True, **common), sampling).stats
    pinned = pipeline.generate(prompt, DecodeOptions(**common), sampling).stats
    pipeline.close()
    assert adapting.rounds_by_k[0] >= 0.8 * adapting.rounds and adapting.probe_rounds >= 2
    assert pinned.rounds_by_k[4] >= pinned.rounds - 4 and pinned.probe_rounds == 0  # less only at the end


def test_a_draft_that_starts_agreeing_turns_speculation_back_on(tiny_pair, tiny_reference):
    """A draft that disagrees for the first 60 rounds and then is the target itself: the
    policy turns speculation off, probes, and once the probes are accepted drafts again,
    up to the request's K."""
    target, prompt, expected, never = tiny_reference
    draft = Disagreeing(TorchEngine(tiny_pair / "target"), never)  # the target's weights: it agrees

    def agree_after_60(rounds: int) -> None:
        draft.disagrees = rounds < 60

    pipeline = with_costs_by_hand(Pipeline(target, draft))
    options = DecodeOptions(mode="speculative", num_draft_tokens=4, adapt_k=True, max_tokens=200, eos_token_id=-1)
    generation, plans = plans_of_one_request(pipeline, prompt, options, SamplingParams(), agree_after_60)
    pipeline.close()
    assert generation.output_ids == expected
    assert any(plan.draft_tokens == 0 for plan in plans[:60])
    back = next(i for i, plan in enumerate(plans) if i >= 60 and plan.draft_tokens and not plan.probe)
    assert back < 60 + 2 * PROBE_PERIOD
    assert max(plan.draft_tokens for plan in plans[back:]) == 4


def test_the_wide_session_gives_the_same_logits_and_tokens(tiny_engines):
    """The target run alone (a second session of its graph, two threads) computes the same
    logits, bit for bit, and greedy decoding gives the same tokens with it and without."""
    target, _ = load_engine_pair(tiny_engines)
    cache = target.new_cache(64)
    target.forward_batch([Step(cache, torch.arange(3, 20), torch.arange(17))])
    step = lambda: Step(cache, torch.tensor([5, 9, 11, 2, 7]), torch.arange(17, 22))  # noqa: E731
    shared = target.forward_batch([step()])[0]
    cache.truncate(17)
    with target.run_alone():
        alone = target.forward_batch([step()])[0]
    assert target._alone_session is not None and torch.equal(shared, alone)
    cache.release()
    # its worker spins within a forward only (the other core is idle by definition then);
    # the engine's own one-thread session never spins
    wide = target._alone_session.get_session_options()
    assert wide.intra_op_num_threads == 2
    assert wide.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert wide.get_session_config_entry("session.force_spinning_stop") == "1"
    own = target.sessions["model"].get_session_options()
    assert own.get_session_config_entry("session.intra_op.allow_spinning") == "0"

    outputs = {}
    for alone in (True, False):
        # one decoder on the engines opens the wide session at load (not in its first
        # request's time); decoders that share the engines never open it
        pipeline = (Pipeline.load(engines=tiny_engines) if alone
                    else Pipeline.load(engines=tiny_engines, batching="per-request", max_concurrency=2))
        assert (pipeline.target._alone_session is not None) == alone
        prefills = prefills_on_the_wide_session(pipeline.target)
        prompt = pipeline.encode("The with statement")
        outputs[alone] = [pipeline.generate(prompt, DecodeOptions(mode=mode, num_draft_tokens=4, adapt_k=adapt,
                                                                  max_tokens=40, eos_token_id=-1),
                                            SamplingParams()).output_ids
                          for mode, adapt in (("autoregressive", False), ("speculative", True), ("ssd", True))]
        used = pipeline.target._alone_session is not None
        pipeline.close()
        assert used == alone
        # a prompt's prefill runs on the wide session where the decoder may run alone
        # (nothing of the draft's runs between rounds), on the engine's own one else
        assert prefills == [alone] * 3
    assert outputs[True] == outputs[False]


def prefills_on_the_wide_session(target) -> list[bool]:
    """For each prefill (a forward of a whole prompt) the target runs from now on,
    whether it ran on the wide session."""
    seen, forward_rows = [], target.forward_rows

    def recorded(steps):
        if any(step.last_only for step in steps):  # a prompt's (verify rounds read every row)
            seen.append(getattr(target._running, "alone", False))
        return forward_rows(steps)

    target.forward_rows = recorded
    return seen


def test_generate_says_what_the_policy_chose():
    """The summary line of `generate.py`, from the generation's rounds: speculation off
    (with its probes and the acceptance that did not pay), or the K it mostly chose."""
    off = GenerationStats("ssd", 4)
    for accepted, drafted, probe in [(0, 4, False), (1, 2, False)] + [(0, 0, False)] * 60 + [(0, 1, True)] * 2:
        off.record_round(accepted, drafted, probe)
    assert policy_summary(off.as_dict()) == ("load policy: K per round 0 in 94% of rounds (speculation off: "
                                             "acceptance 0.12 does not pay for drafting at these costs); K > 0 in 4 "
                                             f"rounds, probes at least {PROBE_PERIOD} rounds apart (2 probed)")
    never = GenerationStats("ssd", 4)
    for _ in range(8):
        never.record_round(0, 0, False)
    assert policy_summary(never.as_dict()) == ("load policy: K per round 0 in 100% of rounds (speculation off: the "
                                               "draft's acceptance as measured when it was made does not pay for "
                                               "drafting at these costs); K > 0 in 0 rounds, no probe")
    on = GenerationStats("ssd", 4)
    for accepted, drafted, prespeculated in [(3, 4, True)] * 9 + [(0, 2, False)]:
        on.record_round(accepted, drafted, prespeculated=prespeculated)
    assert policy_summary(on.as_dict()) == ("load policy: K=4 in 90% of rounds (mean K per round 3.80), with "
                                            "pre-speculation in 90% of rounds; acceptance 0.71 per draft; no probe")


def test_the_gil_switch_interval_is_short_only_while_the_draft_worker_runs_beside_the_target(tiny_pair,
                                                                                             monkeypatch):
    """The draft worker's Python must not hold the target's thread for CPython's default 5 ms
    each time it comes back from an engine call; but a short interval all the time hands
    the GIL between every thread of a server (the scheduler's host work waited on the
    response senders): outside pre-speculation the process keeps its own."""
    import sys

    from saguaro.runtime.decoding.decoder import Decoder
    from saguaro.runtime.decoding.gil import GIL_SWITCH_SECONDS

    seen: dict[str, list[float]] = {"prespeculating": [], "verifying": []}
    prespeculate = Decoder.prespeculate

    def recorded_prespeculation(self, batch):
        seen["prespeculating"].append(sys.getswitchinterval())
        return prespeculate(self, batch)

    monkeypatch.setattr(Decoder, "prespeculate", recorded_prespeculation)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        pipeline = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
        verify_batch = pipeline.target.verify_batch

        def recorded_verification(steps):
            seen["verifying"].append(sys.getswitchinterval())
            return verify_batch(steps)

        monkeypatch.setattr(pipeline.target, "verify_batch", recorded_verification)
        prompt = [1, 2, 3, 4, 5]
        pipeline.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=8, eos_token_id=-1),
                          SamplingParams())
        assert seen["verifying"] and set(seen["verifying"]) == {0.005}
        assert sys.getswitchinterval() == 0.005
        pipeline.generate(prompt, DecodeOptions(mode="ssd", num_draft_tokens=3, max_tokens=8, eos_token_id=-1),
                          SamplingParams())
        pipeline.close()
        assert seen["prespeculating"] and max(seen["prespeculating"]) <= GIL_SWITCH_SECONDS < 0.005
        assert sys.getswitchinterval() == 0.005
    finally:
        sys.setswitchinterval(previous)


def test_the_switch_interval_stays_short_until_the_last_worker_beside_a_target_is_done():
    """Decoders sharing a process (per-request batching) each shorten it: counted."""
    import sys

    from saguaro.runtime.decoding.gil import SwitchInterval

    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    interval = SwitchInterval(0.0003)
    try:
        first, second = interval.shortened(), interval.shortened()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert sys.getswitchinterval() == 0.0003  # the second worker still runs
        second.__exit__(None, None, None)
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(previous)


def test_a_fresh_policy_starts_from_the_acceptance_the_draft_was_measured_at():
    """No round seen yet: a draft whose report measured poor acceptance drafts nothing from
    the first round; one without a report starts from the optimistic default."""
    costs = dict(verify=measured(0.004, 0.0008), step=measured(0.0006, 0.00002))

    def fresh(acceptance: tuple[float, ...]) -> LoadPolicy:
        draft = type("Draft", (), {"info": type("Info", (), {"acceptance": acceptance})()})()
        policy = LoadPolicy(target=None, draft=draft)
        policy.price.verify_cost, policy.price.draft_cost, policy.price.tree_cost = costs["verify"], costs["step"], costs["step"]
        return policy

    assert fresh(()).choose([FakeSequence()])[0].draft_tokens > 0
    assert fresh((0.1, 0.1)).choose([FakeSequence()])[0].draft_tokens == 0
    assert fresh((0.9, 0.9, 0.9, 0.9)).choose([FakeSequence()])[0].draft_tokens > 0


def test_measured_acceptance_is_read_from_a_draft_report(tmp_path):
    from saguaro.runtime.models.checkpoint import DRAFT_REPORT, acceptance_by_depth, measured_acceptance

    # rounds accepting 0..4 drafts: 50% none, 25% one, 25% all four
    assert acceptance_by_depth([0.5, 0.25, 0.0, 0.0, 0.25]) == pytest.approx((0.5, 0.5, 1.0, 1.0))
    assert measured_acceptance(tmp_path) == ()  # no report
    (tmp_path / DRAFT_REPORT).write_text('{"acceptance": {"accepted_histogram": [0.8, 0.2, 0.0]}}')
    assert measured_acceptance(tmp_path) == pytest.approx((0.2, 0.0))


def test_a_batchs_choice_holds_for_a_few_rounds_and_is_made_again_when_the_batch_changes():
    """Weighing every K is done once per REPLAN_ROUNDS rounds of the same batch; a batch
    that changed, or a round whose drafts were all rejected, is weighed at once."""
    policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.8)
    weighed = []
    best = policy._best
    policy._best = lambda candidates, speculating: weighed.append(1) or best(candidates, speculating)
    batch = [FakeSequence(), FakeSequence()]

    def rounds(count: int, accepted: int = 2) -> list[list[int]]:
        chosen = []
        for _ in range(count):
            plans = policy.choose(batch)
            for sequence, plan in zip(batch, plans):
                sequence.plan = plan
                policy.record_round(sequence.acceptance, True, plan.draft_tokens, min(accepted, plan.draft_tokens))
            chosen.append([plan.draft_tokens for plan in plans])
        return chosen

    assert rounds(REPLAN_ROUNDS) == [[4, 4]] * REPLAN_ROUNDS and len(weighed) == 1
    rounds(1)
    assert len(weighed) == 2  # the choice had run its rounds
    batch[1:] = [FakeSequence()]
    rounds(1)
    assert len(weighed) == 3  # a new request in the batch
    rounds(1, accepted=0)
    rounds(1)
    assert len(weighed) == 4  # all its drafts rejected: weighed again the round after
    batch[0].room = 3
    assert rounds(1)[0][0] == 2  # a kept K is cut to what the request may still draft


def test_speculation_off_at_a_load_no_k_could_beat_holds_while_requests_join_and_leave():
    """A compute-bound target at 16 requests, where no K could pay: the choice is not
    weighed again as requests are replaced, join or leave (it was, each time, and weighing
    every K for every request cost more than a round of the tiny engines) until
    QUIET_ROUNDS rounds are up, twice as many for the next such choice; a smaller batch where
    some K could pay is weighed at once."""
    policy = policy_with(measured(0.0001, 0.001), measured(0.0008, 0.0005), acceptance=0.0)
    weighed = []
    best = policy._best
    policy._best = lambda candidates, speculating: weighed.append(1) or best(candidates, speculating)
    batch = [FakeSequence(plan=Plan(0)) for _ in range(16)]

    def rounds(count: int) -> None:
        for _ in range(count):
            plans = policy.choose(batch)
            assert not any(plan.draft_tokens or plan.probe for plan in plans)
            for sequence, plan in zip(batch, plans):
                sequence.plan = plan

    rounds(1)
    assert undrafted_reason([sequence.plan for sequence in batch]) == "priced"  # the model's choice
    chosen_once = len(weighed)
    batch[3] = FakeSequence(plan=Plan(0))  # one request left, another took its place
    batch.append(FakeSequence(plan=Plan(0)))  # and one more joined
    rounds(QUIET_ROUNDS - 1)
    assert len(weighed) == chosen_once
    assert undrafted_reason([sequence.plan for sequence in batch]) == "held"  # the choice, held
    assert batch[0].plan.quiet == QUIET_ROUNDS  # counted on, for the probes once it could pay
    rounds(1)
    assert len(weighed) == 2 * chosen_once  # the choice had run its rounds
    del batch[12:]
    rounds(1)
    assert len(weighed) == 2 * chosen_once  # fewer requests, and still no K could pay
    rounds(2 * QUIET_ROUNDS - 2)
    assert len(weighed) == 2 * chosen_once  # the second such choice in a row holds twice as long
    rounds(1)
    assert len(weighed) == 3 * chosen_once
    policy.price.verify_cost = measured(0.005, 0.00002)  # weight-bound now: drafting could pay ...
    del batch[1:]
    policy.choose(batch)
    assert len(weighed) == 4 * chosen_once  # ... so the smaller batch is weighed again


def test_a_requests_last_round_does_not_hold_the_next_request_at_k_0():
    """At one stream, a request's last round (no room to draft) chooses K = 0 and says
    nothing of the load: the request that takes its place is weighed at once and drafts
    where drafting pays, instead of being held quiet as if no K could (it had been, for
    half of each request's rounds)."""
    policy = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.9)  # drafting pays
    ending = FakeSequence(room=1)
    assert policy.choose([ending])[0].draft_tokens == 0
    assert not policy._hopeless
    fresh = FakeSequence()
    assert policy.choose([fresh])[0].draft_tokens == 4


def test_a_load_is_judged_hopeless_with_each_requests_whole_k_not_the_room_it_has_left():
    """Rounds that start drafting cost a fixed 4 ms: K = 1 cannot pay, K = 4 can. A request
    with room for one draft chooses K = 0, and the policy does not take the load as
    hopeless: the hold that would follow outlasts requests, and the next request, with
    its output ahead of it, drafts at once."""
    policy = policy_with(measured(0.005, 0.00002), measured(0.0002, 0.00001), acceptance=0.8)
    policy.price.draft_start_cost.observe(1, 0.004)
    ending = FakeSequence(room=2)
    assert policy.choose([ending])[0].draft_tokens == 0
    assert not policy._hopeless
    assert policy.choose([FakeSequence()])[0].draft_tokens == 4


def test_a_round_that_drafted_nothing_names_the_most_telling_reason():
    drafts = Plan(2)
    assert undrafted_reason([drafts, Plan(0, undrafted="clock")]) is None  # it drafted
    assert undrafted_reason([Plan(0, undrafted="priced"), Plan(0, undrafted="clock"), Plan(0)]) == "clock"
    assert undrafted_reason([Plan(0, undrafted="priced"), Plan(0, undrafted="held")]) == "held"
    assert undrafted_reason([Plan(0), Plan(0)]) == "asked"  # pinned K = 0: nobody's choice but the request's


