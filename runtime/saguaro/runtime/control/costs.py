"""The cost model: what one engine forward costs, measured one way and followed while serving.

- `forward_cost`, `forward_seconds`, `measure_curve`: timed forwards after a warm-up, at
  one context (`CALIBRATION_CONTEXT`): how the benchmark tables, the calibration
  (`control.calibration`: at build time, or at load for engines built without one) and
  the load policy all measure.
- `CostCurve`: seconds of a forward by its size, from a calibration's points, following
  the measured rounds; `LinearCost`: a round's host work by its number of requests.
- `Misprediction`: measured over modelled seconds of what drafting added to a round, by
  batch size: what the load policy's model of such a round leaves out, learnt as it serves.
- `hidden_branches`: the one rule for how many branches hide under a verification. The
  build's calibration applies it at batch 1 (the default fan-out a request gets before any
  round ran); the load policy applies it every round, on the curves it follows.
"""
from __future__ import annotations

import statistics
import time
from bisect import bisect_left
from collections.abc import Mapping
from contextlib import nullcontext
from operator import itemgetter

import torch

CALIBRATION_CONTEXT = 128  # cached tokens behind every calibrated forward (at most half the context)
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96)  # tokens or rows per forward
FADING = 0.98                     # weight of older host-time measurements after each new one
FOLLOWING = 0.1                   # how far one measurement moves a cost curve toward itself
MOST_BRANCHES = 1 << 12           # per request: beyond any engine's built maximum
# how far one measured round moves its batch size's misprediction toward itself: a drafting
# round the model priced a fifth low at 4 streams is corrected within the 8 rounds a batch
# keeps its choice, rather than the dozens a cost curve's `FOLLOWING` would take
MISPREDICTION_FOLLOWING = 0.2
MOST_MISPREDICTION = 4.0  # one round's measured over modelled is taken within this factor either way
# rounds without drafts (nothing measures the misprediction then) in which a factor's
# distance from 1 halves: see `Misprediction.fade`
MISPREDICTION_HALF_LIFE = 64


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


def measure_curve(engine, passes: int, alone: bool = False, sizes=CALIBRATION_SIZES) -> dict[int, float]:
    """Seconds of one forward at each of `sizes` the engine can take (the fastest of
    `passes`: a call a busy neighbour preempted says nothing of the engine), at the
    calibration context; `alone`: on the session the target uses with nothing beside it."""
    context = calibration_context(engine.info.max_context)
    largest = engine.info.max_context - context - 1
    if engine.info.limits is not None:
        largest = min(largest, engine.info.limits.max_cache_entries - context - 1)
    points: dict[int, float] = {}
    with engine.run_alone() if alone else nullcontext():
        for size, seconds in forward_seconds(engine, context, [s for s in sizes if s <= largest], passes):
            points[size] = min(seconds, points.get(size, seconds))
    return points


def hidden_branches(budget_s: float, step_cost, steps: int, requests: int = 1, most: int = MOST_BRANCHES) -> int:
    """The most branches per request, 0..`most`, whose `steps` draft forwards of `requests`
    x B branch rows each last no longer than `budget_s`. `step_cost` never falls as rows
    grow (`CostCurve` follows its rising envelope), so the count is a binary search, and one
    noisy timing cannot skip over a budget that does not fit."""
    fits, beyond = 0, most + 1  # the answer lies in [fits, beyond)
    while beyond - fits > 1:
        middle = (fits + beyond) // 2
        if steps * step_cost(requests * middle) <= budget_s:
            fits = middle
        else:
            beyond = middle
    return fits


class CostCurve:
    """Seconds of one forward by its size (tokens or rows): its shape measured at a ladder
    of sizes (the calibration) and interpolated between them, since a CPU forward is flat
    while the weights' reading dominates and linear once compute does; its level following
    the measured rounds. Each measurement while serving moves the factor (measured over
    calibrated) of the two sizes around it toward what it saw, each by its share of the
    interpolation; a size no measurement came near takes the factor of the nearest one
    that did. The calibration times one sequence; served rounds are batches of many, whose
    attention reads every sequence's cache: at 16 sequences SmolLM2's verifications ran a
    third above the calibration at both 16 and 32 tokens. Had only the size measured moved
    (16, at K = 0), a wider verify (32, at K = 1) would have kept the one-sequence price
    and looked cheap, and the load policy drafted where drafting lost. A forward never
    costs less for more tokens: predictions follow the rising envelope, while each
    measurement moves the levels themselves, and bounds the levels of every smaller size."""

    def __init__(self, points: Mapping[int, float] | Mapping[float, float] | None = None):
        self.points = dict(sorted((points or {}).items()))  # the shape
        self.factors: dict[float, float] = {}  # measured over the shape, at points measurements moved
        # read at every price the load policy weighs (dozens a round): kept until a point moves
        self._level_list: list[tuple[float, float]] | None = None
        self._rising: list[tuple[float, float]] | None = None  # the envelope
        self._sizes_measured: set[float] = set()  # sizes the served rounds measured

    @property
    def known(self) -> bool:
        return bool(self.points)

    @property
    def shaped(self) -> bool:
        """Measured at more than one size: a curve that autoregressive rounds alone have
        measured (at one token) still needs its calibration to say what wider ones cost."""
        return len(self.points) > 1

    def observe(self, size: float, seconds: float, lasting: bool = False, following: float = FOLLOWING) -> None:
        """`lasting`: a calibration point, taken as it is (the fastest of its repeats);
        `following`: how far the measurement moves the curve toward itself."""
        if not lasting:
            self._sizes_measured.add(size)
        if lasting or not self.points:
            self.points[size] = min(seconds, self.points.get(size, seconds))
            self.points = dict(sorted(self.points.items()))
            self._moved()
            return
        # against the curve's own level there, not its rising envelope: where the envelope
        # held a size up (a smaller size priced dearer), every measurement of it had pushed
        # its factor further the same way, unchecked (bench pair: 0.4 at 2 tokens, 1.27 at
        # 5, pricing a verify of 5 tokens at 4.0 ms where it took 3.3)
        if size <= 0 or seconds <= 0:
            return
        predicted = along(self._levels(), size)
        if predicted <= 0:
            return
        correction = seconds / predicted
        moved = {point: self.factor(point) * correction ** (following * share) for point, share in self._shares(size)}
        self._set_factors(moved)
        self._bound_below(size)

    def calibrated(self, points: Mapping[int, float]) -> "CostCurve":
        """A curve of the calibration's shape (`points`), at the level this one measured
        where the served rounds all measured one size: the calibration's own level is that
        of the hour it was taken (a SmolLM2 build's, on a busy machine, put the wide
        session's one-token verification at 73 ms where rounds measured 33, above the
        one-thread session's 71, and a process's first SSD request then verified on one
        thread for about a hundred rounds). Rounds of several sizes measured against a
        one-point guess of the shape carry the guess's errors: the calibration's level then."""
        curve = CostCurve(points)
        if len(self._sizes_measured) == 1 and curve.known:
            size = next(iter(self._sizes_measured))
            shape = along(list(curve.points.items()), size)
            if shape > 0:
                curve.factors[size] = along(self._levels(), size) / shape
                curve._moved()
        return curve

    def _bound_below(self, size: float) -> None:
        """A forward never costs less for more tokens, so the level `size` now has bounds
        every smaller size's. Without that bound a smaller size measured dear once (a busy
        spell, rounds priced on one point before the calibration came) held the rising
        envelope up over `size` for as long as no round ran at the smaller size: the wide
        session's curve priced a verification of 16 tokens (bench pair, w8a8) at 137 ms
        from a level left at 12 tokens, where it took 42, and the target verified on one
        thread (64 ms) in 97% of rounds, its second core idle."""
        levels = self._levels()
        ceiling = along(levels, size)
        lowered = {point: ceiling / self.points[point] for point, level in levels if point < size and level > ceiling}
        if lowered:
            self._set_factors(lowered)

    def factor(self, size: float) -> float:
        """Measured over calibrated near `size`: interpolated between the points
        measurements moved, the nearest one's beyond them, 1 before any measurement."""
        return factor_in(list(self.factors.items()), size)

    def _set_factors(self, moved: dict[float, float]) -> None:
        """Factors at `moved`'s points, kept sorted by size: sorted afresh only when a point
        is new, since the served rounds move the same few points round after round."""
        new = not moved.keys() <= self.factors.keys()
        self.factors.update(moved)
        if new:
            self.factors = dict(sorted(self.factors.items()))
        self._moved()

    def _shares(self, size: float) -> list[tuple[float, float]]:
        """The calibrated sizes around `size` and their interpolation weights."""
        sizes = list(self.points)
        if size <= sizes[0]:
            return [(sizes[0], 1.0)]
        if size >= sizes[-1]:
            return [(sizes[-1], 1.0)]
        above = next(i for i, s in enumerate(sizes) if s >= size)
        low, high = sizes[above - 1], sizes[above]
        toward_high = (size - low) / (high - low)
        return [(low, 1.0 - toward_high), (high, toward_high)]

    def _moved(self) -> None:
        """A point or a factor changed: the levels and their envelope are read afresh."""
        self._level_list = self._rising = None

    def _levels(self) -> list[tuple[float, float]]:
        """Each calibrated size's seconds times its factor (`factor`), kept until a
        measurement moves them: read afresh after every served round's verification, so the
        factors are read along the sizes in one walk (a search per size had been 12 of the
        20 us an observation took on a 14-size calibration, each round, in every mode)."""
        if self._level_list is None:
            sizes = list(self.points)
            self._level_list = [(size, self.points[size] * factor)
                                for size, factor in zip(sizes, factors_along(list(self.factors.items()), sizes))]
        return self._level_list

    def _envelope(self) -> list[tuple[float, float]]:
        if self._rising is None:
            self._rising, highest = [], 0.0
            for size, seconds in self._levels():
                highest = max(highest, seconds)
                self._rising.append((size, highest))
        return self._rising

    def __call__(self, size: float) -> float:
        if size <= 0 or not self.points:
            return 0.0
        return along(self._envelope(), size)


def along(points: list[tuple[float, float]], size: float) -> float:
    """The curve through the sorted `(size, seconds)` points at `size`: interpolated, the
    last segment extended; one point alone scaled by size above it (a curve measured at one
    size only, before any calibration). Predictions and the measurements that move the
    levels read the curve the same way: a one-point curve read flat by the measurements
    and scaled by the predictions had its factor pushed to 5.3 by rounds of 16 tokens
    measured against a point at 1, and priced them at 16 times what they took."""
    if len(points) == 1:
        return points[0][1] * max(size / points[0][0], 1.0)
    return interpolated(points, size, extend=True)


def factor_in(factors: list[tuple[float, float]], size: float) -> float:
    """`CostCurve.factor` from its `(size, factor)` list, read once by callers that ask at every point."""
    return interpolated(factors, size, extend=False) if factors else 1.0


def factors_along(factors: list[tuple[float, float]], sizes: list[float]) -> list[float]:
    """`factor_in` at each of the sorted `sizes`, walking both lists once."""
    if not factors:
        return [1.0] * len(sizes)
    (first, first_factor), (last, last_factor) = factors[0], factors[-1]
    found, segment = [], 1  # factors[segment] is the first factor at or above the size
    for size in sizes:
        if size <= first:
            found.append(first_factor)
        elif size >= last:
            found.append(last_factor)
        else:
            while factors[segment][0] < size:
                segment += 1
            found.append(on_line(factors[segment - 1], factors[segment], size))
    return found


def interpolated(points: list[tuple[float, float]], size: float, extend: bool) -> float:
    """Linear between the sorted `(size, value)` points around `size`; the first value
    below them; past them the last segment's line when `extend`, else the last value."""
    if size <= points[0][0]:
        return points[0][1]
    if size >= points[-1][0] and not (extend and len(points) > 1):
        return points[-1][1]
    segment = min(bisect_left(points, size, key=itemgetter(0)), len(points) - 1)  # the first at or above
    return on_line(points[segment - 1], points[segment], size)


def on_line(low: tuple[float, float], high: tuple[float, float], size: float) -> float:
    """The line through two `(size, value)` points, at `size`."""
    (low_size, low_value), (high_size, high_value) = low, high
    return low_value + (high_value - low_value) / (high_size - low_size) * (size - low_size)


class LinearCost:
    """Seconds of host work per round as `a + b * requests`, by weighted least squares,
    older measurements fading."""

    def __init__(self):
        self._sums = [0.0] * 5   # weight, sum x, sum y, sum xx, sum xy

    def observe(self, size: float, seconds: float) -> None:
        point = (1.0, size, seconds, size * size, size * seconds)
        self._sums = [FADING * total + value for total, value in zip(self._sums, point)]

    @property
    def known(self) -> bool:
        return self._sums[0] > 0

    def coefficients(self) -> tuple[float, float]:
        weight, x, y, xx, xy = self._sums
        mean_x, mean_y = x / weight, y / weight
        spread = xx / weight - mean_x ** 2
        slope = max((xy / weight - mean_x * mean_y) / spread, 0.0) if spread > 1e-9 else 0.0
        return max(mean_y - slope * mean_x, 0.0), slope

    def __call__(self, size: float) -> float:
        if size <= 0 or not self.known:
            return 0.0
        intercept, slope = self.coefficients()
        return intercept + slope * size


class Misprediction:
    """Measured over modelled seconds of what drafting added to the rounds a load policy
    chose to draft in (the round's time less the model's price of the same batch drafting
    nothing), by the number of requests in the round: its geometric mean, older rounds
    fading, one round's ratio taken within `MOST_MISPREDICTION` either way (beyond that a
    round was preempted, which says nothing of the model); a size not measured takes the
    factor interpolated between the sizes measured, the nearest one's beyond them, 1
    before any. The model prices each part of a drafting round from its own curve, and
    what no curve holds shows here: at 4 streams on SmolLM2 (int8) rounds of K = 1 took
    36.4 ms where the model said 30.7, against 19.5 for a round without drafts (the draft
    caches' catch-up paid again each time K came back after rounds at K = 0,
    verifications a batch made wider slower than their curve), and the policy, drafting on
    that price, ran at 0.83-0.93x autoregressive speed; at one stream the model was right
    within 2%.

    Only a drafting round measures a factor, and a factor well above 1 can turn drafting
    off, so a factor that a busy spell pushed up could hold speculation off for good: on
    the bench pair at one stream (w8a8, a 2-core machine) a few slow rounds left the factor
    at 1.3, and the policy then drafted in none of 765 rounds where K = 3 ran 1.15x faster
    than autoregressive decoding. So rounds without drafts fade every factor toward 1
    (`fade`, halving its distance in `MISPREDICTION_HALF_LIFE` rounds in the log): the
    model's own price then rules again and the next drafting rounds measure it afresh, as
    the clock (`control.clock`) retries a batch size it vetoed."""

    def __init__(self) -> None:
        self.factors: dict[int, float] = {}

    def fade(self) -> None:
        """One round that measured no drafting: every factor a step back toward 1."""
        kept = 0.5 ** (1 / MISPREDICTION_HALF_LIFE)
        self.factors = {requests: factor ** kept for requests, factor in self.factors.items()}

    def observe(self, requests: int, measured_s: float, modelled_s: float) -> None:
        if modelled_s <= 0:
            return
        ratio = min(max(measured_s / modelled_s, 1 / MOST_MISPREDICTION), MOST_MISPREDICTION)
        factor = self(requests)
        self.factors[requests] = factor * (ratio / factor) ** MISPREDICTION_FOLLOWING
        self.factors = dict(sorted(self.factors.items()))

    def __call__(self, requests: int) -> float:
        if not self.factors:
            return 1.0
        return interpolated(list(self.factors.items()), requests, extend=False)
