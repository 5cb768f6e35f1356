"""What one engine forward costs: the median of timed calls, after a warm-up.

One home for the timing that the benchmark tables and the build's branch calibration
(`engines.calibration`) both report, so that their figures are measured the same way.
"""
from __future__ import annotations

import statistics
import time

import torch


def median_ms(run, repeats: int, summary=statistics.median) -> float:
    """The `summary` (median; `min` ignores calls a busy neighbour preempted) of `repeats`
    timed calls, in ms."""
    run()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * summary(times)


def forward_cost(engine, past: int, count: int, repeats: int, summary=statistics.median) -> float:
    """Median (or `summary`) ms of one forward of `count` tokens after `past` cached ones
    (a decode step for 1, a verify for K+1, a tree step for B: the cost of a forward
    depends on how many tokens it feeds, not on the mask they attend with). `past=0` is
    a prefill."""
    cache = engine.new_cache(past + count + 1)
    if past:
        engine.forward(cache, torch.ones(past, dtype=torch.int64), torch.arange(past))

    def step():
        engine.forward(cache, torch.ones(count, dtype=torch.int64), torch.arange(past, past + count))
        cache.truncate(past)

    try:
        return median_ms(step, repeats, summary)
    finally:
        cache.release()
