"""Which of the target's two sessions verifies a round that has nothing of the draft's
beside it: the wide one (both threads, `run_alone`) or the engine's own one-thread
session, judged by trials paired with their neighbours.

On a busy machine two threads can wait for each other, so the session the rounds use is
tried against the other once in `TRIAL_PERIOD` rounds. A forward is only ever slowed by
the machine, and a busy spell slows whichever session runs in it: compared by their cost
curves (the usual session's following every round, the other's moved by a trial once a
period), a busy spell of one was set against a quiet moment of the other. Through the
server at 4 streams (bench pair) that chose the one-thread session for 6-64% of a level's
rounds, where in every level those rounds measured slower than the wide session's
(14-17 ms against 12.5-14, the same width). So a trial is judged against its neighbours:
the usual session's rounds just before and just after it (below), at the same width, which the
machine's load of that moment slowed alike. The rounds use the wide session unless the
median of the last `PAIRS_KEPT` pairs at that width (the nearest width measured, before
any at that one) says the other is faster.

A trial takes two rounds on the other session and measures the second, and its neighbour
after it is the usual session's second round back: the first round on a session after a
stretch of the other's is slow whichever it is (its threads idle, its buffers out of the
caches). On the tiny engines at one stream, in one process, a round's
verification took 0.33 ms as the first on the one-thread session, 0.13-0.14 from its
second on, 0.26-0.30 as the first on the wide one and 0.24 in a stretch of them: trials of
one round measured the one-thread session at its first round, lost, and kept the rounds on
the wide session (99.5% of them), the slower one there.

A trial of the one-thread session that the wide one wins by `TRIAL_MARGIN` or more doubles
the period, up to 2^`TRIAL_BACKOFF` periods; a trial the session tried wins brings the
period back, and a close one halves it (`backed_off`). On
an idle machine every trial lost by a wide margin (SmolLM2 int8 at one stream: 12.1 ms on
one thread against 9.1 on both), and a trial once in 32 rounds cost every mode 1% of its
decoding, autoregressive included. Trials of the wide session stay once a period: its
threads, idle since its last round, start slower, and spaced out (trials of either
session, won by any margin), the server's rounds at one stream on the tiny engines settled
on the one-thread session and ran AR 0.8x as fast; nor are trials spaced where the
sessions run close (the server at 4-16 streams, its processes sharing the cores), whose
choice follows the machine's load.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from saguaro.runtime.control.backoff import doubled

TRIAL_PERIOD = 32  # rounds without pre-speculation: the other session verifies one in this many ...
TRIAL_BACKOFF = 3  # ... times 2 for each trial the wide session won clearly (halved by a close one), up to 2^this
TRIAL_MARGIN = 1.2  # clearly: the trial took this many times the usual session's time or more
PAIRS_KEPT = 5     # trials per width whose median decides (one preempted trial moves nothing)


class SessionChoice:
    """`runs_alone(tokens)` for each round without pre-speculation, then `verified(seconds)`
    with what its verification took. `enabled` False: other decoders share the engines, so
    the target never runs alone."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.ratios: dict[int, deque[float]] = {}  # width -> log(one-thread / wide seconds), by pair
        self._since_trial = 0    # rounds since the last trial
        self._warming = False    # the round asked last is a trial's first, measured nothing
        self._rewarming = False  # the next usual round is the first after a trial: no neighbour
        self._trials_won = 0     # the period's doublings, 0..TRIAL_BACKOFF (`backed_off`)
        self._asked: tuple[int, bool, bool] | None = None  # this round: tokens, wide, a trial
        self._usual: tuple[int, float] | None = None       # the last usual round: tokens, seconds
        self._trial: tuple[int, float, bool, float | None] | None = None  # tokens, seconds, wide, before

    def wide(self, tokens: float) -> bool:
        """Whether the rounds of `tokens` use the wide session: unless paired trials at the
        nearest width measured say the one-thread session is faster."""
        if not self.enabled:
            return False
        if not self.ratios:
            return True
        nearest = min(self.ratios, key=lambda width: (abs(width - tokens), width))
        return statistics.median(self.ratios[nearest]) >= 0.0

    @property
    def trial_period(self) -> int:
        """Rounds from one trial to the next: longer while the wide session keeps winning clearly."""
        return doubled(TRIAL_PERIOD, self._trials_won, TRIAL_BACKOFF)

    @property
    def trialling(self) -> bool:
        """This round verifies on the session tried once a period (until `verified`)."""
        return self._asked is not None and self._asked[2]

    def runs_alone(self, tokens: int) -> bool:
        """This round's session (True: the wide one); once a period, the other one for two
        rounds, the first to warm it up."""
        if not self.enabled:
            return False
        self._since_trial += 1
        trial = self._since_trial >= self.trial_period
        if trial:
            # the warm-up leaves the count at the period, so that the trial follows it
            self._warming = not self._warming
            self._since_trial = self._since_trial - 1 if self._warming else 0
        wide = self.wide(tokens) != trial
        self._asked = (tokens, wide, trial)
        return wide

    def verified(self, seconds: float) -> None:
        """The round asked of `runs_alone` verified in `seconds`; a round that did not ask
        (it pre-speculated) measures neither session."""
        if self._asked is None:
            return
        (tokens, wide, trial), self._asked = self._asked, None
        if trial and self._warming:
            return
        if trial:
            before = self._usual[1] if self._usual is not None and self._usual[0] == tokens else None
            self._trial = (tokens, seconds, wide, before)
            self._rewarming = True
            return
        self._usual = (tokens, seconds)
        if self._rewarming:
            self._rewarming = False
        elif self._trial is not None:
            self._pair(tokens, seconds)

    def _pair(self, tokens: int, after: float) -> None:
        """The trial waiting for its neighbour after, against the mean of its neighbours."""
        trial, self._trial = self._trial, None
        assert trial is not None  # `verified` pairs a trial only
        width, tried, wide, before = trial
        neighbours = [seconds for seconds in (before, after if tokens == width else None) if seconds]
        if not neighbours or tried <= 0:
            return
        usual = sum(neighbours) / len(neighbours)
        self._trials_won = backed_off(self._trials_won, wide, tried, usual)
        one_thread, both = (usual, tried) if wide else (tried, usual)
        self.ratios.setdefault(width, deque(maxlen=PAIRS_KEPT)).append(math.log(one_thread / both))


def backed_off(trials_won: int, wide: bool, tried: float, usual: float) -> int:
    """`SessionChoice._trials_won` after a trial of the wide session (`wide`) or the
    one-thread one that took `tried` seconds against its neighbours' `usual`: one more,
    up to `TRIAL_BACKOFF`, where the one-thread session lost by `TRIAL_MARGIN` or more; 0
    where the session tried won (the rounds may move: trials once a period again); one
    fewer for a close trial. Brought back to 0 by a close one too, SmolLM2 int8 at one
    stream (autoregressive requests, 1,540 rounds) tried the one-thread session for 30
    rounds in one run, where 6 of its 15 trials were close (0.99-1.10x the wide session's
    time, the others 1.51-1.80x), and for 16 in runs whose trials were all clear."""
    if usual > tried:
        return 0
    if not wide and tried >= TRIAL_MARGIN * usual:
        return min(trials_won + 1, TRIAL_BACKOFF)
    return max(trials_won - 1, 0)

