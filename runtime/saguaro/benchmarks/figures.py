"""Saving the benchmarks' plots: one backend, one resolution, one line saying where."""
from __future__ import annotations

from pathlib import Path

PLOT_DPI = 110


def pyplot():
    """matplotlib's pyplot on its file-only backend (no display here), or None with a note
    when matplotlib is not installed (it comes with the `bench` extra)."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install -e '.[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)
    print(f"plot: {path}")
