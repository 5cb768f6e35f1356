"""Make the target/draft model pair the runtime, tests and benchmarks use, or a draft for a target.

    python scripts/make_models.py --size tiny             # models/tiny, about 30 s
    python scripts/make_models.py --size bench            # models/bench, about 25 min
    python scripts/make_models.py --size tiny --out /tmp/pair --seed 1 --force
    python scripts/make_models.py --draft-for models/smollm2 --out models/smollm2-head [--preset quick] \
        [--feature-layers 2,15,27]                        # an EAGLE-3 feature head (the default kind)
    python scripts/make_models.py --draft-for models/smollm2 --out models/smollm2-draft --kind pruned

An existing pair with the same size and seed (or draft with the same settings) is kept
unless --force is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from saguaro.modelmaker import draft_for, feature_draft
from saguaro.modelmaker.acceptance import format_acceptance
from saguaro.modelmaker.model_pair import PRESETS, make_pair
from saguaro.runtime.models.checkpoint import DRAFT_REPORT, CheckpointError

KIND_FEATURE = feature_draft.KIND


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seed must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"feature layers are whole numbers separated by commas, "
                                         f"got {text!r}") from None
    if any(layer < 0 for layer in layers):
        raise argparse.ArgumentTypeError(f"feature layers are 0 or more, got {text!r}")
    return layers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make_models.py", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--size", choices=sorted(PRESETS), help="pair preset")
    what.add_argument("--draft-for", type=Path, metavar="TARGET_DIR",
                      help="make a draft for this target checkpoint (pruned and distilled from it)")
    parser.add_argument("--out", type=Path, help="output folder (default: models/<size>)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="training seed")
    parser.add_argument("--force", action="store_true", help="remake an existing pair")
    drafting = parser.add_argument_group("with --draft-for")
    drafting.add_argument("--preset", choices=sorted(draft_for.PRESETS), default="full",
                          help="full: the best draft, in at most 29 minutes; quick: under 3 minutes, weaker")
    drafting.add_argument("--kind", choices=("pruned", KIND_FEATURE), default=KIND_FEATURE,
                          help="feature (the default: it agrees with the target more, at less cost per step): "
                               "an EAGLE-3 head reading the target's hidden states (release format); pruned: a "
                               "few of the target's layers, distilled")
    drafting.add_argument("--feature-layers", type=layer_list, metavar="I,J,K",
                          help="with --kind feature: the hidden states entering these target layers "
                               "(default 2, L/2, L-3)")
    drafting.add_argument("--layers", type=int, help="target layers the draft keeps (default 4)")
    drafting.add_argument("--output-vocab", type=int, help="tokens the draft scores (default 8192)")
    drafting.add_argument("--steps", type=int, help="distillation steps")
    drafting.add_argument("--minutes", type=non_negative_float, metavar="M",
                          help="with --kind feature: the run's time bound; training takes fewer steps where "
                               "they would not fit (default: the preset's, full 29, quick 2.9; 0: no bound)")
    drafting.add_argument("--threads", type=int, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    if args.draft_for is not None and args.out is None:
        parser.error("--draft-for needs --out")
    if args.kind != KIND_FEATURE and args.feature_layers is not None:
        parser.error("--feature-layers goes with --kind feature")
    if args.kind != KIND_FEATURE and args.minutes is not None:
        parser.error("--minutes goes with --kind feature")
    if args.kind == KIND_FEATURE and args.layers is not None:
        parser.error("--layers goes with --kind pruned (a feature head, the default kind, has one layer; "
                     "see --feature-layers)")
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


def draft_settings(args: argparse.Namespace):
    settings: feature_draft.FeatureDraftSettings | draft_for.DraftSettings
    if args.kind == KIND_FEATURE:
        settings = feature_draft.PRESETS[args.preset]
        changes = {"draft_vocab_size": args.output_vocab, "threads": args.threads, "seed": args.seed}
        if args.minutes is not None:
            settings = dataclasses.replace(settings, minutes=args.minutes or None)  # 0: no bound
    else:
        settings = draft_for.PRESETS[args.preset]
        changes = {"num_layers": args.layers, "output_vocab": args.output_vocab, "threads": args.threads,
                   "seed": args.seed}
    settings = dataclasses.replace(settings, **{k: v for k, v in changes.items() if v is not None})
    if args.steps is not None:
        settings = dataclasses.replace(settings, train=dataclasses.replace(settings.train, steps=args.steps))
    return settings


def existing_draft(out_dir: Path, settings, kind: str = "pruned", feature_layers=None) -> dict | None:
    try:
        report = json.loads((out_dir / DRAFT_REPORT).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    layers_differ = feature_layers and report.get("feature_layers") != list(feature_layers)
    if report.get("kind", "pruned") != kind or layers_differ:
        return None
    return report if report.get("settings") == json.loads(json.dumps(dataclasses.asdict(settings))) else None


def describe_draft(report: dict) -> str:
    if report.get("kind") == KIND_FEATURE:
        return describe_feature_draft(report)
    weights = report["decode_weights"]
    return (f"draft: target layers {report['layers']}, {report['output_vocab']} output tokens (covering "
            f"{report['output_coverage']:.3f} of held-out target tokens); decode weights "
            f"{weights['draft'] / 1e6:.1f}M vs the target's {weights['target'] / 1e6:.1f}M "
            f"({weights['target'] / weights['draft']:.1f}x); seconds {report['seconds']}\n"
            f"before distillation: {format_acceptance(report['acceptance_before_distillation'])}\n"
            f"after distillation:  {format_acceptance(report['acceptance'])}")


def describe_feature_draft(report: dict) -> str:
    weights, costs = report["decode_weights"], report["step_seconds"]
    return (f"feature head: target layers {report['feature_layers']} (hidden states entering them), "
            f"{report['output_vocab']} output tokens (covering {report['output_coverage']:.3f} of held-out target "
            f"tokens); weights per step {weights['draft'] / 1e6:.1f}M vs the target's {weights['target'] / 1e6:.1f}M; "
            f"step {costs['draft'] * 1e3:.2f} ms vs the target's {costs['target'] * 1e3:.2f} ms "
            f"({costs['ratio']:.3f}); {report.get('trained_steps', report['settings']['train']['steps'])} training "
            f"steps; seconds {report['seconds']}\n"
            f"before training: {format_acceptance(report['acceptance_before_distillation'])}\n"
            f"after training:  {format_acceptance(report['acceptance'])}")


def make_draft(args: argparse.Namespace) -> int:
    settings = draft_settings(args)
    report = None if args.force else existing_draft(args.out, settings, args.kind, args.feature_layers)
    if report is not None:
        print(f"{args.out} already holds a draft made with these settings (--force remakes it)")
    else:
        try:
            if args.kind == KIND_FEATURE:
                report = feature_draft.make_feature_draft(args.draft_for, args.out, settings, args.feature_layers)
            else:
                report = draft_for.make_draft_for(args.draft_for, args.out, settings)
        except (CheckpointError, ValueError) as error:
            print(f"make_models.py: error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
    print(describe_draft(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.draft_for is not None:
        return make_draft(args)
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
