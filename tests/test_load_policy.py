"""The load policy: each round's K from measured costs and shared acceptance. Costs are
set by hand here (as if measured), so each test knows which K pays."""
from dataclasses import dataclass, field

import pytest

from saguaro.runtime.load_policy import Acceptance, CostCurve, LinearCost, LoadPolicy
from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.pipeline import Pipeline
from saguaro.runtime.sampling import SamplingParams


@dataclass
class FakeSequence:  # what the policy reads of a `decoding.Sequence`
    k: int = 4
    adapts: bool = True
    steered: bool = True
    greedy: bool = True
    prespeculating: bool = False
    room: int = 100
    acceptance: Acceptance = field(default_factory=Acceptance)


def measured(intercept_s: float, per_token_s: float) -> CostCurve:
    cost = CostCurve()
    for size in (1, 8, 32, 128):
        cost.observe(size, intercept_s + per_token_s * size, lasting=True)
    return cost


def policy_with(verify: LinearCost, step: LinearCost, acceptance: float) -> LoadPolicy:
    policy = LoadPolicy(target=None, draft=None)  # costs given: no calibration forwards
    policy.verify_cost, policy.draft_cost, policy.tree_cost = verify, step, step
    shared = policy.shared[True]  # as if many rounds accepted each depth with `acceptance`
    shared.verified, shared.accepted = [1000.0] * 4, [1000.0 * acceptance] * 4
    return policy


def test_the_cost_curve_interpolates_and_follows_what_it_measures():
    cost = CostCurve({1: 0.004, 5: 0.0045, 64: 0.020})  # flat while weight-bound, then linear
    assert cost(3) == pytest.approx(0.00425) and cost(0) == 0.0
    assert cost(128) == pytest.approx(0.020 + 64 * (0.0155 / 59))  # the last segment, extended
    for _ in range(400):
        cost.observe(4, 0.006)  # the machine got slower around 4 tokens
    assert cost(4) == pytest.approx(0.006, rel=0.02) and cost(64) == pytest.approx(0.020)


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


def test_k_follows_load():
    """Verification that grows with the tokens in the batch: one request drafts, sixteen
    do not; when the batch empties again K comes back."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    alone = policy.choose([FakeSequence()])[0].draft_tokens
    crowded = {plan.draft_tokens for plan in policy.choose([FakeSequence() for _ in range(16)])}
    assert alone >= 2 and max(crowded) < alone
    assert policy.choose([FakeSequence()])[0].draft_tokens == alone


def test_a_request_whose_drafts_are_rejected_drafts_less():
    policy = policy_with(measured(0.004, 0.0003), measured(0.0003, 0.00002), acceptance=0.7)
    poor = FakeSequence()
    for _ in range(100):
        poor.acceptance.record(4, 0)  # its own rounds: the first draft always rejected
    good, bad = policy.choose([FakeSequence(), FakeSequence(), poor])[1:]
    assert bad.draft_tokens < good.draft_tokens


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

