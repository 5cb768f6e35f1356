"""Make the target/draft model pair the runtime, tests and benchmarks use.

    python scripts/make_models.py --size tiny             # models/tiny, about 30 s
    python scripts/make_models.py --size bench            # models/bench, about 25 min
    python scripts/make_models.py --size tiny --out /tmp/pair --seed 1 --force

An existing pair with the same size and seed is kept unless --force is given.
"""

from __future__ import annotations

import argparse
import sys
import json
from pathlib import Path

from saguaro.modelmaker.acceptance import format_acceptance
from saguaro.modelmaker.model_pair import PRESETS, make_pair


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seed must be 0 or more, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make_models.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", required=True, choices=sorted(PRESETS), help="pair preset")
    parser.add_argument("--out", type=Path, help="output folder (default: models/<size>)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="training seed")
    parser.add_argument("--force", action="store_true", help="remake an existing pair")
    args = parser.parse_args(argv)
    args.out = args.out if args.out is not None else Path("models") / args.size
    # The nearest existing path must be a folder; mkdir would otherwise fail mid-way.
    existing = next((p for p in (args.out, *args.out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        parser.error(f"--out {args.out}: {existing} is an existing file, not a folder")
    return args


def existing_report(out_dir: Path, size: str, seed: int) -> dict | None:
    """The pair.json of a complete pair of this size and seed in `out_dir`, else None."""
    report_path = out_dir / "pair.json"
    folders_present = (out_dir / "target").is_dir() and (out_dir / "draft").is_dir()
    if not (report_path.is_file() and folders_present):
        return None
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return report if (report.get("size"), report.get("seed")) == (size, seed) else None


def describe(report: dict) -> str:
    params = report["params"]
    return (
        f"target {params['target']:,} params, draft {params['draft']:,} "
        f"({params['ratio']}x smaller), made in {report['seconds']['total']} s\n"
        + format_acceptance(report["acceptance"])
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = None if args.force else existing_report(args.out, args.size, args.seed)
    if report is not None:
        kept = f"{args.out} already holds the {args.size} pair, seed {args.seed}"
        print(f"{kept} (--force remakes it)")
    else:
        report = make_pair(args.size, args.out, seed=args.seed, progress=True)
        print(f"wrote {args.out}/target, {args.out}/draft and {args.out}/pair.json")
    print(describe(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
