"""The one back-off the control loop uses: a wait that doubles with each time in a row that
waiting less would have taught nothing (trials the usual session won clearly, probes that
accepted nothing, choices of K = 0 made again), up to a bound, and starts over otherwise."""
from __future__ import annotations


def doubled(period: int, times: int, most: int) -> int:
    """`period` doubled `times` times, at most `most` times (none for `times` <= 0)."""
    return period << min(max(times, 0), most)
