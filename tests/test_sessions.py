"""Which session verifies a round without pre-speculation: the wide one unless trials,
each judged against the rounds beside it, say the one-thread session is faster."""
import math

import pytest

from saguaro.runtime.control.sessions import PAIRS_KEPT, TRIAL_BACKOFF, TRIAL_MARGIN, TRIAL_PERIOD, SessionChoice


def run(choice: SessionChoice, rounds: int, wide_s, one_thread_s, tokens: int = 4) -> list[bool]:
    """`rounds` rounds of `tokens`, each verifying in what its session costs at that round
    (`wide_s(i)`, `one_thread_s(i)`); the sessions they ran on."""
    sessions = []
    for index in range(rounds):
        wide = choice.runs_alone(tokens)
        choice.verified(wide_s(index) if wide else one_thread_s(index))
        sessions.append(wide)
    return sessions


def trials_won_in_a_row(rounds: int) -> list[int]:
    """The rounds of the trials (each the second of its two on the other session) among the
    first `rounds` while the usual session wins every trial clearly: one period, then each
    twice the last, up to 2^TRIAL_BACKOFF periods, counted from the trial before."""
    trials, at, won = [], -1, 0
    while True:
        at += (TRIAL_PERIOD << min(won, TRIAL_BACKOFF)) + 1
        if at >= rounds:
            return trials
        trials.append(at)
        won += 1


def on_the_other_session(trials: list[int]) -> list[int]:
    """Each trial's round and the round before it, which warms the session up."""
    return [round_ for trial in trials for round_ in (trial - 1, trial)]


def test_rounds_use_the_wide_session_and_try_the_other_less_often_while_it_loses():
    """Once a period at first, then twice as long after each trial the wide session won:
    on an idle machine every trial is lost, and one in 32 rounds on one thread cost every
    mode 1% of its decoding."""
    choice = SessionChoice()
    rounds = (TRIAL_PERIOD << TRIAL_BACKOFF) * 4
    sessions = run(choice, rounds, lambda i: 0.010, lambda i: 0.014)
    trials = trials_won_in_a_row(rounds)
    assert [i for i, wide in enumerate(sessions) if not wide] == on_the_other_session(trials)
    assert trials[:3] == [TRIAL_PERIOD, 3 * TRIAL_PERIOD + 1, 7 * TRIAL_PERIOD + 2]
    assert trials[-1] - trials[-2] == (TRIAL_PERIOD << TRIAL_BACKOFF) + 1  # the longest period
    assert choice.wide(4) and choice.ratios[4][0] == math.log(0.014 / 0.010)


def test_a_trial_measures_its_session_from_its_second_round():
    """The first round on a session after a stretch of the other's is slow whichever it is
    (tiny engines, one stream: 0.33 ms on one thread, then 0.13): a trial warms its session
    up for a round and measures the next, so the faster session wins its trial."""
    choice = SessionChoice()
    last = {"wide": True}

    def cold_first(steady: float, wide: bool) -> float:
        first, last["wide"] = last["wide"] != wide, wide
        return 2.5 * steady if first else steady

    for _ in range(TRIAL_PERIOD + 3):  # the trial's warm-up and trial, then the usual session's two back
        wide = choice.runs_alone(4)
        choice.verified(cold_first(0.024 if wide else 0.013, wide))
    assert choice.ratios[4][0] == pytest.approx(math.log(0.013 / 0.024)) and not choice.wide(4)


def test_a_trial_the_other_session_wins_brings_the_period_back():
    """Trials spaced out by wins of the wide session; a spell in which two threads wait for
    each other: the trial in it wins for the one-thread session, and the next comes a
    period later, not eight."""
    choice = SessionChoice()
    run(choice, 3 * TRIAL_PERIOD + 4, lambda i: 0.010, lambda i: 0.014)  # trials at P and 3P + 1, each paired 2 later
    assert choice.trial_period == 4 * TRIAL_PERIOD  # two trials won
    crowded = run(choice, choice.trial_period - choice._since_trial + 3, lambda i: 0.020, lambda i: 0.014)
    # the warm-up and the trial on one thread, then the wide session's two rounds back
    assert crowded.count(False) == 2 and crowded[-4:] == [False, False, True, True]
    assert choice.trial_period == TRIAL_PERIOD


def test_a_close_trial_after_clear_ones_halves_the_period_once():
    """Trials the wide session won clearly spaced them out to 2^TRIAL_BACKOFF periods; a
    trial it wins by less than TRIAL_MARGIN halves the period, one that the one-thread
    session wins brings it back: SmolLM2 int8 at one stream lost 6 of 15 trials closely,
    and each had brought the period back to 32 rounds."""
    choice = SessionChoice()
    run(choice, (TRIAL_PERIOD << TRIAL_BACKOFF) * 3, lambda i: 0.010, lambda i: 0.014)
    assert choice.trial_period == TRIAL_PERIOD << TRIAL_BACKOFF
    close = 1 + (TRIAL_MARGIN - 1) / 2
    run(choice, choice.trial_period - choice._since_trial + 3, lambda i: 0.010, lambda i: 0.010 * close)
    assert choice.trial_period == TRIAL_PERIOD << (TRIAL_BACKOFF - 1)
    run(choice, choice.trial_period - choice._since_trial + 3, lambda i: 0.010, lambda i: 0.014)
    assert choice.trial_period == TRIAL_PERIOD << TRIAL_BACKOFF  # won clearly again: doubled back
    run(choice, choice.trial_period - choice._since_trial + 3, lambda i: 0.010, lambda i: 0.009)
    assert choice.trial_period == TRIAL_PERIOD  # the one-thread session won


def test_where_the_sessions_run_close_the_trials_stay_once_a_period():
    """The usual session wins every trial, each by less than TRIAL_MARGIN: a shared
    machine, whose load moves the choice, keeps its trials once a period."""
    choice = SessionChoice()
    close = 1 + (TRIAL_MARGIN - 1) / 2
    sessions = run(choice, 8 * TRIAL_PERIOD, lambda i: 0.010, lambda i: 0.010 * close)
    trials = [n * TRIAL_PERIOD + n - 1 for n in range(1, 8)]  # a period after the trial before
    assert [i for i, wide in enumerate(sessions) if not wide] == on_the_other_session(trials)
    assert choice.wide(4) and choice.trial_period == TRIAL_PERIOD


def test_a_busy_spell_that_slows_both_sessions_keeps_the_wide_one():
    """The machine's load doubles every forward for a stretch of each 128 rounds: the
    wide session's rounds slow, and so does the trial of the other beside them, so the
    choice stays. (Compared by cost curves, the usual session's following every round and
    the other's moved only at its trials, such spells had moved most of a level to the
    slower session.)"""
    def busy(index: int) -> float:
        return 2.0 if 40 <= index % 128 < 104 else 1.0

    choice = SessionChoice()
    sessions = run(choice, 12 * TRIAL_PERIOD, lambda i: 0.010 * busy(i), lambda i: 0.013 * busy(i))
    trials = trials_won_in_a_row(12 * TRIAL_PERIOD)
    assert [i for i, wide in enumerate(sessions) if not wide] == on_the_other_session(trials)
    assert any(busy(trial) > 1 for trial in trials)  # a trial inside a busy spell
    assert all(ratio == pytest.approx(math.log(1.3)) for ratio in choice.ratios[4])


def test_the_one_thread_session_takes_over_where_trials_measure_it_faster_and_gives_back():
    """Where two threads wait for each other the one-thread session wins its trial: the
    rounds move to it, the wide one is tried (less often while it loses), and the rounds move back once
    most of the kept pairs say the wide session is the faster again."""
    p = TRIAL_PERIOD
    choice = SessionChoice()
    crowded = run(choice, 4 * p, lambda i: 0.020, lambda i: 0.014)
    assert crowded[p - 1:p + 3] == [False, False, True, True] and not choice.wide(4)  # paired at P + 2
    # the one-thread session's rounds from then on, the wide one tried once a period (no
    # trial of it is spaced out)
    assert [i for i in range(p + 3, 4 * p) if crowded[i]] == [2 * p, 2 * p + 1, 3 * p + 1, 3 * p + 2]
    # the wide session wins its trials, once a period, until three of the five pairs kept
    # say it is the faster; then the other's trials, which it loses: a period, two, four
    quiet = run(choice, (PAIRS_KEPT + 5) * p, lambda i: 0.010, lambda i: 0.014)
    assert [i for i, wide in enumerate(quiet) if wide][:6] == [2, 3, p + 3, p + 4, 2 * p + 4, 2 * p + 5]
    assert all(quiet[2 * p + 8:3 * p + 5])  # the third pair, at 2P + 7, moved the rounds back
    assert choice.wide(4) and [i for i in range(2 * p + 8, 10 * p) if not quiet[i]] == on_the_other_session(
        [3 * p + 6, 5 * p + 7, 9 * p + 8])


def test_a_neighbour_preempted_once_moves_nothing():
    """A round ten times slower than usual (the machine preempted it) beside a trial makes
    one pair of those whose median decides."""
    choice = SessionChoice()
    run(choice, 2 * TRIAL_PERIOD + 4, lambda i: 0.020, lambda i: 0.014)  # one-thread won two trials
    trial = choice.trial_period - choice._since_trial  # the next trial's round in the next run
    run(choice, trial + 3, lambda i: 0.020, lambda i: 0.2 if i == trial - 2 else 0.014)  # before its warm-up
    assert len(choice.ratios[4]) == 3 and choice.ratios[4][-1] > 0  # the preempted pair, for the wide session
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
