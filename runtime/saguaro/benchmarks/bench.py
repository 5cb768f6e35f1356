"""Benchmark a pair on this machine, in one run, and show where the time goes. Speed is
reported as figures and ratios, never asserted (machines are noisy).

    python scripts/bench.py --target models/bench/target --draft models/bench/draft
    python scripts/bench.py --engines engines/bench -k 4 --budget 8 [--assisted]
    python scripts/bench.py --engines engines/bench --engines-only [--threads 1,2] [--json out.json]
    python scripts/bench.py --engines engines/bench --placement
    python scripts/bench.py --engines engines/smollm2 --chat    # a chat model: questions as chat turns

Default: the engine-level costs at one context (target decode, verify of K+1 tokens,
draft decode, tree steps), then every mode over the same prompts, interleaved prompt by
prompt so that the machine's busy spells fall on all of them, each answer ending at the
model's end of generation or after --max-tokens tokens (--ignore-eos: exactly --max-tokens,
on past the answer's end): decode tokens/s (prefill apart), speed-up over
autoregressive, drafts verified per round (K/rnd), acceptance, cache hit rate, the split of time between verifying,
drafting on the critical path and waiting; with checkpoints (or --assisted on engines
whose checkpoints exist) also transformers' greedy and assisted generation.
--engines-only: the engine-level latency suite (`engine_suite`). --placement: thread
placements side by side by SSD speed (`placement`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from saguaro.benchmarks.assisted import transformers_timings
from saguaro.benchmarks.engine_suite import (
    CONTEXTS,
    PREFILL_TOKENS,
    TREE_BRANCHES,
    format_report,
    measure_pair,
    new_report,
    run_suite,
)
from saguaro.benchmarks.placement import PLACEMENTS, placement_pipeline, unpin_this_thread
from saguaro.benchmarks.ratios import spread
from saguaro.runtime.arguments import DECODE_DEFAULTS, add_draft_method_argument, flag_type
from saguaro.runtime.core.options import DecodeOptions, parse_budget, parse_fanout
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.engines.manifest import read_manifest
from saguaro.runtime.models.prompts import CHAT_PROMPTS, PROMPTS
from saguaro.runtime.pipeline import Pipeline, freeze_loaded_heap

ROUND_CONTEXT = 128  # cached tokens of the default run's engine-level costs


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2; got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1; got {text!r}")
    return values


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("models/bench/target"))
    parser.add_argument("--draft", type=Path, default=Path("models/bench/draft"))
    parser.add_argument("--engines", type=Path)
    add_draft_method_argument(parser)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=DECODE_DEFAULTS.num_draft_tokens)
    parser.add_argument("--fanout", type=flag_type(parse_fanout), default=DECODE_DEFAULTS.fanout)
    parser.add_argument("--budget", type=flag_type(parse_budget), help="B, or 'auto'")
    parser.add_argument("--max-tokens", type=int, default=128, help="the most tokens a prompt generates")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every prompt generates exactly --max-tokens tokens, on past its answer's end (what a "
                             "chat model writes there, a new turn it was never asked for, is not what users decode)")
    parser.add_argument("--prompts", type=int, default=4, help="how many of the built-in prompts")
    parser.add_argument("--chat", action="store_true", help="chat questions rendered with the model's template")
    parser.add_argument("--passes", type=int, default=1,
                        help="times over the prompts; with 2 or more, each mode's ratio to autoregressive pass by "
                             "pass (mean, 95%% interval, range) follows the table")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (with --temperature)")
    parser.add_argument("--saguaro", type=float, metavar="C", help="also run ssd with Saguaro sampling factor C")
    parser.add_argument("--repeats", type=int, default=20, help="forwards per engine-level timing")
    parser.add_argument("--assisted", action="store_true",
                        help="with --engines: also transformers' assisted generation on the manifest's checkpoints")
    parser.add_argument("--engines-only", action="store_true", help="the engine-level latency suite alone")
    parser.add_argument("--threads", type=int_list, help="--engines-only: intra-op threads per engine, e.g. 1,2 "
                                                         "(default: the build's)")
    parser.add_argument("--contexts", type=int_list, default=CONTEXTS, help="--engines-only: cached tokens")
    parser.add_argument("--tree-branches", type=int_list, default=TREE_BRANCHES, help="--engines-only: B of tree steps")
    parser.add_argument("--prefill", type=int, default=PREFILL_TOKENS, help="--engines-only: prefill tokens")
    parser.add_argument("--placement", action="store_true", help="thread placements side by side by SSD speed")
    parser.add_argument("--rounds", type=int, default=2, help="--placement: passes over the placements")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error(f"--passes must be >= 1, got {args.passes}")
    if (args.engines_only or args.placement or args.assisted) and args.engines is None:
        parser.error("--engines-only, --placement and --assisted need --engines DIR")
    try:
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        parser.error(f"--temperature / --top-k / --top-p: {error}")
    return args


def write_json(path: Path | None, figures: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=2) + "\n")


# -- the default run: the modes side by side -----------------------------------------------

STAT_KEYS = ("tokens", "total_s", "prefill_s", "verify_s", "draft_s", "wait_s", "rounds", "cache_hits",
             "cache_misses", "drafted_tokens", "probe_rounds", "hit_drafted", "hit_accepted")


def run_mode(pipeline, prompts, options, sampling) -> dict:
    """`prompts`: token ids of each prompt; totals over them."""
    totals = new_totals()
    for prompt in prompts:
        add_generation(totals, pipeline.generate(prompt, options, sampling).stats)
    return finished(totals)


def run_interleaved(pipeline, prompts, modes: list[tuple[str, DecodeOptions]], sampling,
                    passes: int = 1) -> dict[str, dict]:
    """Every mode on each prompt before the next prompt, the order turned by one each
    prompt: a busy spell of a shared machine slows every mode alike instead of whichever
    mode it lands on (run one mode after another, autoregressive moved by 10% between
    runs, more than the policy's margin). Each pass through the turns runs the other way
    round, so that a mode follows each of its neighbours: turned alone, the load policy's
    mode always ran right after SSD with K pinned, whose draft session's threads still
    spun on the other core, and on the tiny engines (rounds of 0.3 ms) its verifications
    took 0.16-0.19 s where autoregressive decoding's took 0.13-0.14. `passes` times over
    the prompts; each mode's totals cover them all, and `by_pass` holds its speed over the
    first mode's (autoregressive) pass by pass: on a 2-core machine one pass's ratio moves
    by several percent, so a margin of 3% is read from the passes' spread, not one run."""
    totals = {name: new_totals() | {"by_pass": []} for name, _ in modes}
    for _ in range(passes):
        this_pass = {name: new_totals() for name, _ in modes}
        for index, prompt in enumerate(prompts):
            turn = index % len(modes)
            order = modes[turn:] + modes[:turn]
            for name, options in order if (index // len(modes)) % 2 == 0 else order[::-1]:
                stats = pipeline.generate(prompt, options, sampling).stats
                add_generation(totals[name], stats)
                add_generation(this_pass[name], stats)
        baseline = finished(this_pass[modes[0][0]])["decode_tokens_per_s"]
        for name, _ in modes:
            totals[name]["by_pass"].append(round(finished(this_pass[name])["decode_tokens_per_s"] / baseline, 4))
    return {name: finished(totals[name]) for name, _ in modes}


def print_passes(modes: dict[str, dict]) -> None:
    """Each mode's speed over autoregressive decoding, pass by pass: mean, 95% interval
    of the mean, range."""
    print(f"vs AR by pass ({len(next(iter(modes.values()))['by_pass'])} passes):")
    for name, totals in list(modes.items())[1:]:
        print(f"  {name:24s} {spread(totals['by_pass'])}")


def new_totals() -> dict:
    return dict.fromkeys(STAT_KEYS, 0) | {"accepted": 0.0}


def add_generation(totals: dict, stats) -> None:
    for key in STAT_KEYS:
        totals[key] += getattr(stats, key)
    totals["accepted"] += stats.mean_accepted * stats.rounds


def finished(totals: dict) -> dict:
    totals["decode_tokens_per_s"] = totals["tokens"] / (totals["total_s"] - totals["prefill_s"])
    return totals


def mode_options(args, k: int, branch_options: dict) -> list[tuple[str, DecodeOptions]]:
    """Every mode stops where the model ends its answer (greedy: the same tokens in every
    mode), or with --ignore-eos generates exactly max_tokens, as transformers' rows do."""
    common = dict(max_tokens=args.max_tokens, eos_token_id=-1 if args.ignore_eos else None)
    branches = DecodeOptions(num_draft_tokens=k, **branch_options).fanout_policy().max_branches
    modes = [("autoregressive", DecodeOptions(mode="autoregressive", **common)),
             (f"speculative K={k}", DecodeOptions(mode="speculative", num_draft_tokens=k, **common)),
             (f"ssd K={k} B={branches}", DecodeOptions(mode="ssd", num_draft_tokens=k, **common, **branch_options)),
             (f"ssd load policy K<={k}", DecodeOptions(mode="ssd", num_draft_tokens=k, adapt_k=True, **common,
                                                      **branch_options))]
    if args.saguaro is not None:
        modes.append((f"ssd saguaro C={args.saguaro}", DecodeOptions(
            mode="ssd", num_draft_tokens=k, saguaro_factor=args.saguaro, **common, **branch_options)))
    return modes


def mode_row(name: str, t: dict, baseline: float, prompts: int) -> str:
    """A mode's figures; `pre/fresh`: accepted per drafted token of pre-speculated drafts
    (a hit's branch) and of the others."""
    looked_up = t["cache_hits"] + t["cache_misses"]
    hit = f"{100 * t['cache_hits'] / looked_up:5.0f}" if looked_up else "    -"
    speed = t["decode_tokens_per_s"]
    fresh = t["drafted_tokens"] - t["hit_drafted"]
    split = (f"{t['hit_accepted'] / t['hit_drafted']:.2f}/"
             f"{(t['accepted'] - t['hit_accepted']) / fresh:.2f}"
             if t["hit_drafted"] and fresh else "-")
    return (f"{name:24s} {speed:7.1f} {speed / baseline:6.2f} {1000 * t['prefill_s'] / prompts:10.1f} "
            f"{t['drafted_tokens'] / t['rounds']:5.2f} {t['accepted'] / t['rounds']:7.2f} {hit} {split:>9s} "
            f"{t['verify_s']:8.2f} {t['draft_s']:8.2f} {t['wait_s']:7.2f}")


def transformers_row(name: str, timing, baseline: float, prompts: int) -> str:
    speed = timing.decode_tokens_per_s
    return (f"{name:24s} {speed:7.1f} {speed / baseline:6.2f} {1000 * timing.prefill_s / prompts:10.1f} "
            f"{'-':>5s} {'-':>7s} {'-':>5s} {'-':>9s} {'-':>8s} {'-':>8s} {'-':>7s}")


def checkpoints_for_assisted(args) -> tuple[Path, Path] | None:
    """Checkpoints for transformers' rows: the given ones, or with --assisted the manifest's."""
    if args.engines is None:
        return args.target, args.draft
    if not args.assisted:
        return None
    models = read_manifest(args.engines)["models"]
    paths = (Path(models["target"]["checkpoint"]), Path(models["draft"]["checkpoint"]))
    missing = [str(p) for p in paths if not p.is_dir()]
    if missing:
        print(f"--assisted: checkpoint {missing[0]} (from the manifest) does not exist; no transformers rows")
        return None
    return paths


def round_costs(args, pipeline, k: int, branches: int) -> dict:
    """The engine-level suite at one context, on the loaded pair (any backend)."""
    precision = read_manifest(args.engines)["precision"] if args.engines else "torch fp32"
    report = new_report(str(args.engines or args.target.parent), k)
    trees = tuple(sorted({b for b in (1, 2, 4, 8, 16, branches) if 1 <= b <= max(branches, 1)}))
    measure_pair(report, pipeline.target, pipeline.draft, precision, 1, (ROUND_CONTEXT,), trees, PREFILL_TOKENS,
                 args.repeats, args.engines)
    print(format_report(report) + "\n")
    return report.as_dict()


def run_modes(args) -> dict:
    pipeline = Pipeline.load(target=args.target, draft=args.draft, engines=args.engines,
                             draft_method=args.draft_method)
    # loaded once and measured, as a server serves: with the loaded heap left to the
    # collector, a full pass (50-120 ms) landed in one mode's phase now and then
    freeze_loaded_heap()
    k = args.num_draft_tokens
    branch_options = dict(fanout=args.fanout, budget=args.budget)
    branches = DecodeOptions(num_draft_tokens=k, **branch_options).fanout_policy().max_branches
    figures = {"engine_costs": round_costs(args, pipeline, k, branches), "modes": {}}

    # every mode draws the same randomness (the load policy's row, choosing K, samples other tokens)
    sampling = bench_sampling(args)
    encode = pipeline.encode_chat if args.chat else pipeline.encode
    prompts = [encode(text) for text in (CHAT_PROMPTS if args.chat else PROMPTS)[: args.prompts]]
    length = f"{args.max_tokens}" if args.ignore_eos else f"up to {args.max_tokens}"
    print(f"{len(prompts)} prompts x {length} tokens, the modes interleaved prompt by prompt; "
          "tok/s counts decoding, prefill is per prompt")
    print(f"{'mode':24s} {'tok/s':>7s} {'vs AR':>6s} {'prefill ms':>10s} {'K/rnd':>5s} {'acc/rnd':>7s} {'hit%':>5s} "
          f"{'pre/fresh':>9s} {'verify s':>8s} {'draft s':>8s} {'wait s':>7s}")
    figures["modes"] = run_interleaved(pipeline, prompts, mode_options(args, k, branch_options), sampling,
                                       args.passes)
    baseline = figures["modes"]["autoregressive"]["decode_tokens_per_s"]
    for name, totals in figures["modes"].items():
        print(mode_row(name, totals, baseline, len(prompts) * args.passes))
    if args.passes > 1:
        print_passes(figures["modes"])
    if not args.ignore_eos:
        print(f"tokens decoded: {figures['modes']['autoregressive']['tokens']} autoregressive "
              f"(of {len(prompts) * args.max_tokens * args.passes} at most; the answers end where the model ends them)")
    checkpoints = checkpoints_for_assisted(args)
    if checkpoints is not None and args.temperature == 0:
        for name, timing in transformers_timings(*checkpoints, prompts, args.max_tokens, args.ignore_eos).items():
            print(transformers_row(name, timing, baseline, len(prompts)))
            figures["modes"][name] = {"tokens": timing.tokens, "total_s": timing.total_s,
                                      "prefill_s": timing.prefill_s,
                                      "decode_tokens_per_s": timing.decode_tokens_per_s}
    pipeline.close()
    return figures


def bench_sampling(args) -> SamplingParams:
    """The sampling every mode runs with: seeded, so each mode draws the same randomness."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0)


# -- --placement ----------------------------------------------------------------------------

def run_placements(args) -> dict:
    """SSD (and autoregressive) decode tokens/s under each placement, `--rounds` passes
    interleaved so that a busy spell of the machine does not land on one option only."""
    k = args.num_draft_tokens
    options = dict(max_tokens=args.max_tokens, eos_token_id=-1)
    modes = {"ssd": DecodeOptions(mode="ssd", num_draft_tokens=k, fanout=args.fanout, budget=args.budget, **options),
             "autoregressive": DecodeOptions(mode="autoregressive", **options)}
    sampling = bench_sampling(args)
    speeds: dict[str, dict[str, list[float]]] = {p.name: {mode: [] for mode in modes} for p in PLACEMENTS}
    for _ in range(args.rounds):
        for placement in PLACEMENTS:
            pipeline = placement_pipeline(args.engines, placement)
            prompts = [pipeline.encode(text) for text in PROMPTS[: args.prompts]]
            try:
                for mode, decode in modes.items():
                    speeds[placement.name][mode].append(
                        run_mode(pipeline, prompts, decode, sampling)["decode_tokens_per_s"])
            finally:
                pipeline.close()  # its scheduler threads and decoders
                unpin_this_thread()
    print_placements(args, speeds)
    return {"placements": speeds}


def print_placements(args, speeds: dict) -> None:
    def mean(values):
        return sum(values) / len(values)

    today = mean(speeds[PLACEMENTS[0].name]["ssd"])
    print(f"thread placement on {args.engines} ({read_manifest(args.engines)['precision']}), "
          f"{args.prompts} prompts x {args.max_tokens} tokens, K={args.num_draft_tokens}, mean of {args.rounds} passes")
    print(f"{'placement':40s} {'ssd tok/s':>9s} {'range':>13s} {'vs default':>10s} {'AR tok/s':>8s} {'ssd/AR':>6s}")
    for name, by_mode in speeds.items():
        ssd, ar = by_mode["ssd"], by_mode["autoregressive"]
        print(f"{name:40s} {mean(ssd):9.1f} {min(ssd):6.1f}-{max(ssd):6.1f} {mean(ssd) / today:10.2f} "
              f"{mean(ar):8.1f} {mean(ssd) / mean(ar):6.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engines_only:
        report = run_suite(args.engines, args.threads or (None,), args.num_draft_tokens, args.contexts,
                           args.tree_branches, args.prefill, args.repeats)
        print(format_report(report))
        write_json(args.json, report.as_dict())
    elif args.placement:
        write_json(args.json, run_placements(args))
    else:
        write_json(args.json, run_modes(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
