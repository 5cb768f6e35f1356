"""Speculation checked by the clock (`control.clock`): where the rounds that drafted
committed fewer tokens per second of wall time than the rounds that did not, at the same
batch size, the load policy's choice to draft is overruled, and measured again later."""
from test_load_policy import FakeSequence, measured, policy_with

from saguaro.runtime.control.acceptance import Acceptance
from saguaro.runtime.control.clock import RETRY_ROUNDS, UNDRAFTED_EVERY, UNMEASURED_EVERY, VETO_ROUNDS, ClockCheck
from saguaro.runtime.control.load_policy import LoadPolicy
from saguaro.runtime.control.round_report import Plan, RoundReport, SequenceRound, undrafted_reason
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline


def clock_measured(drafting_tokens_per_s: float, undrafted_tokens_per_s: float, requests: int = 4) -> ClockCheck:
    clock = ClockCheck()
    for _ in range(20):
        clock.observe(requests, True, 10, 10 / drafting_tokens_per_s)
        clock.observe(requests, False, 4, 4 / undrafted_tokens_per_s)
    return clock


def allowed(clock: ClockCheck, requests: int, rounds: int) -> list[bool]:
    return [clock.allows(requests) for _ in range(rounds)]


def test_drafting_measured_slower_is_turned_off_at_its_batch_size_then_measured_again():
    clock = clock_measured(drafting_tokens_per_s=300.0, undrafted_tokens_per_s=400.0)
    assert not any(allowed(clock, 4, VETO_ROUNDS))
    assert all(allowed(clock, 4, RETRY_ROUNDS))  # the model's choice runs again, measured
    assert not clock.allows(4)  # nothing new measured: still losing, off again
    assert clock.allows(1)  # another batch size: nothing measured there, the model decides


def test_drafting_measured_faster_runs_and_one_round_in_a_period_measures_speculation_off():
    clock = clock_measured(drafting_tokens_per_s=500.0, undrafted_tokens_per_s=400.0)
    rounds = allowed(clock, 4, 3 * UNDRAFTED_EVERY)
    assert [i for i, allows in enumerate(rounds) if not allows] == [UNDRAFTED_EVERY - 1, 2 * UNDRAFTED_EVERY - 1,
                                                                   3 * UNDRAFTED_EVERY - 1]
    assert all(allowed(ClockCheck(), 4, 2 * UNDRAFTED_EVERY))  # nothing measured: nothing to compare
    drafting_only = ClockCheck()
    for _ in range(20):
        drafting_only.observe(4, True, 10, 0.02)
    fresh = allowed(drafting_only, 4, 2 * UNMEASURED_EVERY)  # speculation off not measured yet: sooner
    assert [i for i, allows in enumerate(fresh) if not allows] == [UNMEASURED_EVERY - 1, 2 * UNMEASURED_EVERY - 1]


def test_the_clock_overrules_the_model_only_once_both_kinds_are_measured():
    clock = ClockCheck()
    for _ in range(20):
        clock.observe(4, True, 1, 1.0)  # drafting very slow ...
    for _ in range(3):
        clock.observe(4, False, 4, 0.01)  # ... but speculation off measured in 3 rounds only
    rounds = allowed(clock, 4, 2 * UNMEASURED_EVERY)
    assert [i for i, allows in enumerate(rounds) if not allows] == [UNMEASURED_EVERY - 1, 2 * UNMEASURED_EVERY - 1]
    for _ in range(10):
        clock.observe(4, False, 4, 0.01)
    assert not clock.allows(4) and clock.sizes[4].vetoed == VETO_ROUNDS - 1  # overruled, not measuring


def test_a_few_drafting_rounds_slower_within_their_noise_are_not_vetoed_and_many_are():
    """A drafting round commits 1 to K + 1 tokens: a fresh process's first drafting rounds
    at one stream (the bench pair's, as measured: three of thirteen accepted 0 or 1 of
    their drafts) put drafting at 340 tok/s against 385 without drafts, where it ran at
    430-530 once measured longer: within its noise, no veto. The same spread of rounds
    kept up at that rate, slower than rounds without drafts beyond any noise, is vetoed."""
    first_rounds = [(2, 9.80), (3, 8.09), (3, 6.79), (3, 6.65), (3, 6.23), (3, 6.97), (3, 6.66),
                    (2, 6.38), (3, 6.12), (1, 11.77), (5, 8.52), (2, 11.0), (2, 7.05)]  # (tokens, ms)
    clock = ClockCheck()
    for tokens, ms in first_rounds:
        clock.observe(1, True, tokens, ms / 1e3)
    for i in range(40):
        clock.observe(1, False, 1, (2.6 + 0.15 * (i % 3 - 1)) / 1e3)
    size = clock.sizes[1]
    assert size.drafting.per_second < 0.9 * size.undrafted.per_second and not size.losing
    assert clock.allows(1)
    for _ in range(8):
        for tokens, ms in first_rounds:
            clock.observe(1, True, tokens, ms / 1e3)
    assert size.losing and not clock.allows(1)


def rounds_by_the_clock(policy: LoadPolicy, batch: list[FakeSequence], rounds: int, drafting_s: float,
                        undrafted_s: float, accepted: int = 1, caught_up: bool = False) -> list[list[int]]:
    """`rounds` rounds of `batch`: each drafting request accepts `accepted` drafts; a round
    in which some request that adapts drafted lasts `drafting_s` from its start to the next one's,
    else `undrafted_s`, and its drafts first caught up a draft cache if `caught_up`.
    Returns each round's K per request."""
    chosen = []
    for _ in range(rounds):
        plans = policy.choose(batch)
        for sequence, plan in zip(batch, plans):
            sequence.plan = plan
        adapting_drafted = any(plan.draft_tokens for plan, s in zip(plans, batch) if s.adapts)
        report = RoundReport(len(batch), 0, verify_s=0.001, alone=False, undrafted=undrafted_reason(plans),
                             sequences=[SequenceRound(Acceptance(), True, plan.draft_tokens,
                                                      min(accepted, plan.draft_tokens)) for plan in plans],
                             caught_up=caught_up and adapting_drafted)
        policy.observe_round(report)
        policy.observe_period(drafting_s if adapting_drafted else undrafted_s)
        chosen.append([plan.draft_tokens for plan in plans])
    return chosen


def test_the_policy_drafts_nothing_where_the_clock_measured_drafting_slower_and_a_pinned_k_stays():
    """The model says drafting pays (a weight-bound target, acceptance 0.6); the rounds say
    otherwise: a round that drafts commits 2 tokens per request in 30 ms, one that does not
    1 in 10 ms. Within a few periods the requests that adapt draft nothing; the one that
    pinned its K keeps it."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    batch = [FakeSequence(), FakeSequence(), FakeSequence(adapts=False, k=2, plan=Plan(2))]
    chosen = rounds_by_the_clock(policy, batch, 4 * UNDRAFTED_EVERY, drafting_s=0.030, undrafted_s=0.010)
    assert any(ks[0] for ks in chosen[:UNDRAFTED_EVERY])  # the model's choice, at first
    late = chosen[-UNDRAFTED_EVERY:]
    assert all(ks[:2] == [0, 0] or ks[0] == 1 for ks in late)  # nothing, or a probe's one draft
    assert all(ks[2] == 2 for ks in chosen)


def test_rounds_whose_drafts_first_caught_up_a_draft_cache_are_not_the_clocks_to_judge():
    """The same rounds as above, each drafting one first feeding what its draft cache
    lacked (at one stream, after a stretch without drafts): the clock judges none of them,
    and the model's choice stands."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    batch = [FakeSequence(), FakeSequence()]
    chosen = rounds_by_the_clock(policy, batch, 4 * UNDRAFTED_EVERY, drafting_s=0.030, undrafted_s=0.010,
                                 caught_up=True)
    assert all(ks[0] for ks in chosen[-UNDRAFTED_EVERY:])
    assert not policy.clock.sizes[2].drafting.rounds


def test_a_round_the_clock_kept_from_drafting_says_so():
    """The rounds the clock overruled are told from those the model priced out (the
    server counts them apart: `ssd_undrafted_rounds_total`)."""
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    batch = [FakeSequence(), FakeSequence()]
    rounds_by_the_clock(policy, batch, 4 * UNDRAFTED_EVERY, drafting_s=0.030, undrafted_s=0.010)
    reasons = []
    for _ in range(UNDRAFTED_EVERY):
        plans = policy.choose(batch)
        for sequence, plan in zip(batch, plans):
            sequence.plan = plan
        reasons.append(undrafted_reason(plans))
    assert set(reasons) <= {"clock", None}  # a probe's round drafts
    assert reasons.count("clock") >= UNDRAFTED_EVERY - 2


def test_the_policy_keeps_drafting_where_the_clock_measured_it_faster():
    policy = policy_with(measured(0.004, 0.0004), measured(0.0003, 0.00002), acceptance=0.6)
    batch = [FakeSequence(), FakeSequence()]
    chosen = rounds_by_the_clock(policy, batch, 4 * UNDRAFTED_EVERY, drafting_s=0.012, undrafted_s=0.010, accepted=2)
    late = chosen[-2 * UNDRAFTED_EVERY:]  # once speculation off is measured: one round a period drafts nothing
    assert sum(not any(ks) for ks in late) == 2


def test_a_period_in_which_requests_joined_is_not_a_rounds_own(tiny_pair, monkeypatch):
    """The decoder hands the policy each round's period, start to start, except across a
    join: its prefill belongs to neither kind of round."""
    pipeline = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    decoder = pipeline.schedulers[0].decoder
    periods = []
    monkeypatch.setattr(decoder.load_policy, "observe_period", periods.append)
    options = DecodeOptions(mode="ssd", max_tokens=8, adapt_k=True)
    prompt = pipeline.encode("The with statement")
    first = decoder.start([pipeline.request(prompt, options, SamplingParams())])
    decoder.decode_round(first)
    decoder.decode_round(first)
    assert len(periods) == 1 and periods[0] > 0
    second = decoder.start([pipeline.request(prompt, options, SamplingParams())])
    decoder.decode_round(first + second)
    assert len(periods) == 1  # the join's period is left out
    decoder.decode_round(first + second)
    assert len(periods) == 2
    for sequence in first + second:
        sequence.finish()
    pipeline.close()
