"""What one engine forward costs: the median of timed calls, after a warm-up.

One home for the timing that the benchmark tables, the build's branch calibration
(`engines.calibration`) and the load policy's starting costs (`load_policy.calibrate`)
all use, so that their figures are measured the same way and at the same context.
"""
from __future__ import annotations

import statistics
import time

import torch

CALIBRATION_CONTEXT = 128  # cached tokens behind every calibrated forward (at most half the context)


def calibration_context(max_context: int) -> int:
    return min(CALIBRATION_CONTEXT, max_context // 2)


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
    cache = spare_cache(engine, past, count)
    try:
        return median_ms(lambda: forward_in(engine, cache, past, count), repeats, summary)
    finally:
        cache.release()


def forward_seconds(engine, past: int, sizes, passes: int = 1) -> list[tuple[int, float]]:
    """`(size, seconds)` of one forward of each of `sizes` tokens after `past` cached ones,
    in one spare cache, `passes` times over the sizes."""
    cache = spare_cache(engine, past, max(sizes))
    try:
        timed = []
        for size in list(sizes) * passes:
            started = time.perf_counter()
            forward_in(engine, cache, past, size)
            timed.append((size, time.perf_counter() - started))
        return timed
    finally:
        cache.release()


def spare_cache(engine, past: int, largest: int):
    """A cache with `past` entries filled (a prefill), room for `largest` more."""
    cache = engine.new_cache(past + largest + 1)
    if past:
        engine.forward(cache, torch.ones(past, dtype=torch.int64), torch.arange(past))
    return cache


def forward_in(engine, cache, past: int, count: int) -> None:
    """One forward of `count` tokens after `past` cached ones, rolled back after."""
    engine.forward(cache, torch.ones(count, dtype=torch.int64), torch.arange(past, past + count))
    cache.truncate(past)
