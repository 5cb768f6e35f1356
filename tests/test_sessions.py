"""Which session verifies a round without pre-speculation: the wide one unless trials,
each judged against the rounds beside it, say the one-thread session is faster."""
import math

from saguaro.runtime.control.sessions import PAIRS_KEPT, TRIAL_PERIOD, SessionChoice


def run(choice: SessionChoice, rounds: int, wide_s, one_thread_s, tokens: int = 4) -> list[bool]:
    """`rounds` rounds of `tokens`, each verifying in what its session costs at that round
    (`wide_s(i)`, `one_thread_s(i)`); the sessions they ran on."""
    sessions = []
    for index in range(rounds):
        wide = choice.runs_alone(tokens)
        choice.verified(wide_s(index) if wide else one_thread_s(index))
        sessions.append(wide)
    return sessions


def test_rounds_use_the_wide_session_and_try_the_other_once_a_period():
    choice = SessionChoice()
    sessions = run(choice, 3 * TRIAL_PERIOD, lambda i: 0.010, lambda i: 0.014)
    assert [i for i, wide in enumerate(sessions) if not wide] == [TRIAL_PERIOD - 1, 2 * TRIAL_PERIOD - 1,
                                                                   3 * TRIAL_PERIOD - 1]
    assert choice.wide(4) and len(choice.ratios[4]) == 2  # the last trial waits for the round after it
    assert choice.ratios[4][0] == math.log(0.014 / 0.010)


def test_a_busy_spell_that_slows_both_sessions_keeps_the_wide_one():
    """The machine's load doubles every forward for a stretch of each 128 rounds: the
    wide session's rounds slow, and so does the trial of the other beside them, so the
    choice stays. (Compared by cost curves, the usual session's following every round and
    the other's moved only at its trials, such spells had moved most of a level to the
    slower session.)"""
    def busy(index: int) -> float:
        return 2.0 if 40 <= index % 128 < 104 else 1.0

    choice = SessionChoice()
    sessions = run(choice, 12 * TRIAL_PERIOD, lambda i: 0.010 * busy(i), lambda i: 0.012 * busy(i))
    assert sum(not wide for wide in sessions) == 12  # the trials only
    assert all(ratio == math.log(1.2) for ratio in choice.ratios[4])


def test_the_one_thread_session_takes_over_where_trials_measure_it_faster_and_gives_back():
    """Where two threads wait for each other the one-thread session wins its trial: the
    rounds move to it, the wide one is tried once a period, and the rounds move back once
    most of the kept pairs say the wide session is the faster again."""
    choice = SessionChoice()
    crowded = run(choice, 4 * TRIAL_PERIOD, lambda i: 0.020, lambda i: 0.014)
    assert crowded[TRIAL_PERIOD - 1] is False and not choice.wide(4)
    assert crowded[TRIAL_PERIOD + 1:] == [(i + 1) % TRIAL_PERIOD == 0 for i in range(TRIAL_PERIOD + 1, 4 * TRIAL_PERIOD)]
    quiet = run(choice, (PAIRS_KEPT + 3) * TRIAL_PERIOD, lambda i: 0.010, lambda i: 0.014)
    assert choice.wide(4) and all(quiet[-TRIAL_PERIOD:-1]) and not quiet[-1]
    assert not all(quiet[:2 * TRIAL_PERIOD])  # not at the first trial the wide session won


def test_a_neighbour_preempted_once_moves_nothing():
    """A round ten times slower than usual (the machine preempted it) beside a trial makes
    one pair of those whose median decides."""
    choice = SessionChoice()
    run(choice, 3 * TRIAL_PERIOD, lambda i: 0.020, lambda i: 0.014)  # one-thread won three trials
    run(choice, TRIAL_PERIOD + 1, lambda i: 0.020, lambda i: 0.2 if i == TRIAL_PERIOD - 2 else 0.014)
    assert len(choice.ratios[4]) == 4 and choice.ratios[4][-1] > 0  # the preempted pair, for the wide session
    assert not choice.wide(4)


def test_a_width_not_tried_takes_the_nearest_width_tried():
    choice = SessionChoice()
    run(choice, 3 * TRIAL_PERIOD, lambda i: 0.020, lambda i: 0.014, tokens=16)
    run(choice, 3 * TRIAL_PERIOD, lambda i: 0.004, lambda i: 0.005, tokens=1)
    assert not choice.wide(12) and choice.wide(2)


def test_a_trial_without_a_neighbour_at_its_width_is_dropped():
    """The batch changed width around the trial: nothing to compare it with."""
    choice = SessionChoice()
    for index in range(TRIAL_PERIOD + 1):
        choice.runs_alone(5 if index == TRIAL_PERIOD - 1 else 4)
        choice.verified(0.020)
    assert choice.ratios == {}


def test_a_round_that_did_not_ask_measures_no_session():
    choice = SessionChoice()
    choice.verified(0.5)  # a pre-speculating round: the decoder asked nothing
    assert choice._usual is None


def test_with_other_decoders_on_the_engines_no_round_runs_alone():
    choice = SessionChoice(enabled=False)
    assert not any(run(choice, 2 * TRIAL_PERIOD, lambda i: 0.010, lambda i: 0.014)) and not choice.wide(4)
