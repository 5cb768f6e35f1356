"""Speed-up against acceptance: where speculation pays, measured and predicted.

Reads `bench.py --json` files (one per pair and precision) and plots each speculative
mode's decode speed over autoregressive decoding's in the same run, against its
acceptance per drafted token, beside the curves the pair's measured engine costs predict
for K drafts accepted independently with probability alpha each:

    E(alpha)      = (1 - alpha^(K+1)) / (1 - alpha)           tokens a round commits
    SD            = E * decode_t / (verify_t + K * decode_d)  every draft step on the critical path
    SSD, all hits = E * decode_t / verify_t                   the next draft ready at every verify

(decode_t, verify_t: the target's one-token and K+1-token forwards; decode_d: a draft
step; at the bench's round context). A point below its SD curve loses time outside the
forwards (host work, misses); the gap to the SSD curve is what misses and pre-speculation
cost. `python scripts/plot_speedup.py A.json B.json ... --out docs/figures/speedup.png`.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from saguaro.benchmarks.figures import pyplot, save

AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class Point:
    label: str
    acceptance: float  # accepted per drafted token
    speedup: float     # decode tokens/s over autoregressive decoding's, same run


@dataclass(frozen=True)
class Costs:
    """Median ms of one forward at the bench's round context."""

    k: int
    target_decode: float
    target_verify: float
    draft_decode: float


def measured_points(figures: dict, pair: str) -> list[Point]:
    """Every mode of one bench run that verified drafts."""
    modes = figures["modes"]
    baseline = modes[AUTOREGRESSIVE]["decode_tokens_per_s"]
    return [Point(f"{pair}: {name}", mode["accepted"] / mode["drafted_tokens"],
                  mode["decode_tokens_per_s"] / baseline)
            for name, mode in modes.items() if mode.get("drafted_tokens")]


def pair_costs(figures: dict) -> Costs:
    """The target's and the draft's forward costs from the run's engine suite."""
    report = figures["engine_costs"]
    first = {engine["role"]: engine["contexts"][0] for engine in report["engines"]}
    return Costs(report["k"], first["target"]["decode_ms"], first["target"]["verify_ms"], first["draft"]["decode_ms"])


def committed_per_round(alpha: float, k: int) -> float:
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, costs: Costs, every_draft_hidden: bool) -> float:
    """SD's (`every_draft_hidden` False) or SSD's with every draft ready (True)."""
    drafting = 0.0 if every_draft_hidden else costs.k * costs.draft_decode
    return committed_per_round(alpha, costs.k) * costs.target_decode / (costs.target_verify + drafting)


def plot(runs: dict[str, dict], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    alphas = [i / 50 for i in range(51)]
    fig, axis = plt.subplots(figsize=(8, 5))
    for index, (pair, figures) in enumerate(runs.items()):
        color = f"C{index}"
        costs = pair_costs(figures)
        axis.plot(alphas, [predicted_speedup(a, costs, False) for a in alphas], color=color, alpha=0.5,
                  label=f"{pair}: SD predicted (K={costs.k})")
        axis.plot(alphas, [predicted_speedup(a, costs, True) for a in alphas], color=color, alpha=0.5,
                  linestyle="--", label=f"{pair}: SSD, every draft hidden")
        for marker, point in zip("osD^v<>", measured_points(figures, pair)):
            axis.scatter(point.acceptance, point.speedup, color=color, marker=marker, label=point.label)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("acceptance per drafted token")
    axis.set_ylabel("decode speed / autoregressive")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    save(fig, out)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plot_speedup.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="bench.py --json files; each file's stem names its pair")
    parser.add_argument("--out", type=Path, default=Path("speedup.png"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = {}
    for path in args.runs:
        if not path.is_file():
            raise SystemExit(f"{path}: no such bench figures file (write one with bench.py --json FILE)")
        runs[path.stem] = json.loads(path.read_text())
    for pair, figures in runs.items():
        for point in measured_points(figures, pair):
            print(f"{point.label:50s} acceptance {point.acceptance:.3f}  speed-up {point.speedup:.2f}x")
    plot(runs, args.out)
    return 0
