"""When a request whose speculation is off drafts again to measure it: the probes' schedule.

With speculation off (K = 0 chosen for a request that may draft), a request's acceptance
is measured by a probe: one round in `PROBE_PERIOD` drafts `PROBE_DRAFTS` token(s), not
pre-speculated (a draft step on the critical path and a verify one token wider, amortised
over the period). The period doubles with each probe in a row that accepted nothing, up to
2^`PROBE_BACKOFF` periods, and is never so short that the probes' measured cost passes
`PROBE_SHARE` of the rounds' time; a probe whose drafts were all accepted is followed by
another, so that a draft that got better is measured in a few rounds rather than a few
periods. The period is the batch's too: the acceptance a probe measures is shared by every
request of its kind (greedy or sampled), so a request probes only if no request of its kind
probed within it (each of 4 requests probing on its own period had a draft forward in one
round of eight, 0.88-0.92x autoregressive speed at 4 streams). Whether a due probe is made
is the load policy's (`LoadPolicy._probed`: not while no acceptance could make drafting pay).
"""
from __future__ import annotations

import math

from saguaro.runtime.control.backoff import doubled
from saguaro.runtime.control.round_report import Plan

PROBE_PERIOD = 32   # rounds: with speculation off, a request drafts in one round of this many ...
PROBE_DRAFTS = 1    # ... this many drafts, not pre-speculated, so that its acceptance stays measured
PROBE_BACKOFF = 3   # the period doubles with each probe in a row whose drafts were all rejected, up to 2^this
# Probes may take at most this share of the rounds' time: a probe whose round costs more
# than the period's share of it (a draft that first catches up the tokens of the rounds it
# missed: 25-28 ms against 14-15 for a sampled round at one stream) is spaced out further.
PROBE_SHARE = 0.01
PROBE_COST_FADING = 0.7  # weight of the earlier probes' measured cost after each new one


class ProbeSchedule:
    """Rounds since a request of each kind last probed, and the probes' measured cost."""

    def __init__(self):
        self.since = {greedy: 1 << 30 for greedy in (True, False)}  # rounds since each kind probed
        self.cost: float | None = None  # what a probe added to its round, measured (fading)
        self.spacing = PROBE_PERIOD     # rounds between probes that keeps them within PROBE_SHARE

    def tick(self) -> None:
        """A round went by."""
        for greedy in self.since:
            self.since[greedy] += 1

    def due(self, last: Plan, last_round: tuple[int, int], greedy: bool) -> tuple[bool, int]:
        """Whether a request of kind `greedy`, whose last round had plan `last` and verified
        and accepted `last_round`, is due to probe this round; and its probes in a row that
        accepted nothing."""
        verified, accepted = last_round
        confirmed = last.probe and verified and accepted == verified
        rejected = rejected_probes(last, verified, accepted)
        period = max(probe_period(rejected), self.spacing)
        return bool(confirmed or (last.quiet + 1 >= period and self.since[greedy] >= period)), rejected

    def probed(self, greedy: bool) -> None:
        """A request of kind `greedy` probes this round: its kind's period starts again."""
        self.since[greedy] = 0

    def observe(self, added_s: float, round_s: float) -> None:
        """A probe added `added_s` to a round the model priced at `round_s` without it:
        probes are spaced so that they take at most `PROBE_SHARE` of the rounds' time."""
        added_s = max(added_s, 0.0)
        cost = self.cost
        self.cost = added_s if cost is None else PROBE_COST_FADING * cost + (1 - PROBE_COST_FADING) * added_s
        self.spacing = max(PROBE_PERIOD, math.ceil(self.cost / (PROBE_SHARE * max(round_s, 1e-9))))


def rejected_probes(last: Plan, verified: int, accepted: int) -> int:
    """Probes in a row that accepted nothing, after the round of plan `last` verified
    `verified` drafts and accepted `accepted`."""
    if not (last.probe and verified):
        return last.rejected_probes
    return 0 if accepted else last.rejected_probes + 1


def probe_period(rejected: int) -> int:
    """Rounds between probes after `rejected` probes in a row accepted nothing: a
    draft that keeps failing is asked less often (each probe's draft step, its cache's
    catch-up and a wider verify had cost the policy a tenth of autoregressive speed at 2-4
    streams through the server), and one accepted draft brings the period back."""
    return doubled(PROBE_PERIOD, rejected, PROBE_BACKOFF)
