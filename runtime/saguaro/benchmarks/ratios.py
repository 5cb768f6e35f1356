"""Ratios of two modes measured side by side, repeat by repeat: on a 2-core machine one
repeat's ratio moves by several percent, so a margin of a few percent is read from the
repeats' spread, not from one run."""
from __future__ import annotations

import statistics


def spread(ratios: list[float]) -> str:
    """`mean +- half, min to max` of two or more ratios: the half-width of the mean's 95%
    interval (normal approximation)."""
    half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5
    return f"{statistics.mean(ratios):.3f} +- {half:.3f}, {min(ratios):.3f} to {max(ratios):.3f}"
