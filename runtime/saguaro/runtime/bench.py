"""Benchmark the decoding modes side by side on one pair, in one run, and show where the
time goes. Speed is reported as figures and ratios, never asserted (machines are noisy).

    python scripts/bench.py --target models/bench/target --draft models/bench/draft
    python scripts/bench.py --engines engines/bench -k 4 --budget 8
    python scripts/bench.py --engines engines/smollm2 --chat    # a chat model: questions as chat turns

First the engine-level costs (median ms of one forward: target decode, target verify of
K+1 tokens, draft decode, draft tree step of B branches), then each mode over the same
prompts: tokens/s, speed-up over autoregressive, acceptance, cache hit rate, and the
split of time between verifying, drafting on the critical path and waiting.
"""
from __future__ import annotations

import argparse
import sys
import statistics
import time
from pathlib import Path

import torch

from saguaro.runtime.arguments import DECODE_DEFAULTS, flag_type
from saguaro.runtime.options import DecodeOptions, parse_budget, parse_fanout
from saguaro.runtime.pipeline import Pipeline
from saguaro.runtime.sampling import SamplingParams

PROMPTS = ["The with statement is used to", "A class definition defines a class object",
           "Exceptions are raised by", "The import statement", "If the syntax",
           "Assignment statements are used to", "The for statement is used to iterate",
           "A function definition defines a user-defined function object"]
CHAT_PROMPTS = ["What is the capital of France?", "Explain how a rainbow forms.", "Write a haiku about the sea.",
                "Give me three tips for learning Python.", "Why is the sky blue?", "What is a prime number?",
                "Describe a cat to someone who has never seen one.", "How do vaccines work?"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("models/bench/target"))
    parser.add_argument("--draft", type=Path, default=Path("models/bench/draft"))
    parser.add_argument("--engines", type=Path)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=DECODE_DEFAULTS.num_draft_tokens)
    parser.add_argument("--fanout", type=flag_type(parse_fanout), default=DECODE_DEFAULTS.fanout)
    parser.add_argument("--budget", type=flag_type(parse_budget), help="B, or 'auto'")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, help="how many of the built-in prompts")
    parser.add_argument("--chat", action="store_true", help="chat questions rendered with the model's template")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--saguaro", type=float, metavar="C", help="also run ssd with Saguaro sampling factor C")
    parser.add_argument("--repeats", type=int, default=20, help="forwards per engine-level timing")
    return parser.parse_args(argv)


def median_ms(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def forward_cost(engine, past: int, count: int, repeats: int) -> float:
    """Median ms of one forward of `count` tokens after `past` cached ones."""
    cache = engine.new_cache(past + count + 1)
    engine.forward(cache, torch.ones(past, dtype=torch.int64), torch.arange(past))

    def step():
        engine.forward(cache, torch.ones(count, dtype=torch.int64), torch.arange(past, past + count))
        cache.truncate(past)

    return median_ms(step, repeats)


def engine_costs(pipeline, k: int, branches: int, repeats: int) -> None:
    """Where a round's time goes, and the largest budget whose pre-speculation (one glue
    forward + K tree steps of B branches) still fits under one verify."""
    past = 128
    verify = forward_cost(pipeline.target, past, k + 1, repeats)
    rows = [("target decode (1 token)", forward_cost(pipeline.target, past, 1, repeats)),
            (f"target verify ({k + 1} tokens)", verify),
            ("draft decode (1 token)", forward_cost(pipeline.draft, past, 1, repeats))]
    budgets = sorted({b for b in (1, 2, 4, 8, 16, branches) if b <= max(branches, 1)})
    prespeculation = {}
    for b in budgets:
        tree_step = forward_cost(pipeline.draft, past, b, repeats)
        rows.append((f"draft tree step ({b} branches)", tree_step))
        prespeculation[b] = rows[2][1] + k * tree_step
    print(f"engine-level cost, median ms at {past} cached tokens:")
    for name, ms in rows:
        print(f"  {name:34s} {ms:8.2f}")
    print(f"  a draft decode step costs 1/{rows[0][1] / rows[2][1]:.1f} of a target decode step")
    hidden = [b for b, ms in prespeculation.items() if ms <= verify]
    print(f"  pre-speculation (glue + {k} tree steps) against a {verify:.2f} ms verify: "
          + ", ".join(f"B={b} {ms:.2f} ms" for b, ms in prespeculation.items()))
    print(f"  hidden under verification up to B={max(hidden)}\n" if hidden else
          "  not hidden at any B: SSD saves drafting on hits but the target waits for the rest\n")


def run_mode(pipeline, prompts, options, sampling):
    """`prompts`: token ids of each prompt."""
    totals = {"tokens": 0, "total_s": 0.0, "verify_s": 0.0, "draft_s": 0.0, "wait_s": 0.0,
              "rounds": 0, "accepted": 0, "cache_hits": 0, "cache_misses": 0}
    for prompt in prompts:
        stats = pipeline.generate(prompt, options, sampling).stats
        for key in ("tokens", "total_s", "verify_s", "draft_s", "wait_s", "rounds", "cache_hits", "cache_misses"):
            totals[key] += getattr(stats, key)
        totals["accepted"] += stats.mean_accepted * stats.rounds
    return totals


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engines:
        pipeline = Pipeline.load(engines=args.engines)
    else:
        pipeline = Pipeline.load(target=args.target, draft=args.draft)
    k = args.num_draft_tokens
    branch_options = dict(fanout=args.fanout, budget=args.budget)
    branches = DecodeOptions(num_draft_tokens=k, **branch_options).fanout_policy().max_branches
    engine_costs(pipeline, k, branches, args.repeats)

    sampling = SamplingParams(temperature=args.temperature, seed=0)  # every mode draws the same randomness
    encode = pipeline.encode_chat if args.chat else pipeline.encode
    prompts = [encode(text) for text in (CHAT_PROMPTS if args.chat else PROMPTS)[: args.prompts]]
    modes = [("autoregressive", DecodeOptions(mode="autoregressive", max_tokens=args.max_tokens)),
             (f"speculative K={k}", DecodeOptions(mode="speculative", num_draft_tokens=k, max_tokens=args.max_tokens)),
             (f"ssd K={k} B={branches}", DecodeOptions(mode="ssd", num_draft_tokens=k, max_tokens=args.max_tokens,
                                                     **branch_options))]
    if args.saguaro is not None:
        modes.append((f"ssd saguaro C={args.saguaro}", DecodeOptions(
            mode="ssd", num_draft_tokens=k, max_tokens=args.max_tokens, saguaro_factor=args.saguaro,
            **branch_options)))
    print(f"{'mode':22s} {'tok/s':>7s} {'vs AR':>6s} {'acc/rnd':>7s} {'hit%':>5s} "
          f"{'verify s':>8s} {'draft s':>8s} {'wait s':>7s}")
    baseline = None
    for name, options in modes:
        t = run_mode(pipeline, prompts, options, sampling)
        speed = t["tokens"] / t["total_s"]
        baseline = baseline or speed
        looked_up = t["cache_hits"] + t["cache_misses"]
        hit = f"{100 * t['cache_hits'] / looked_up:5.0f}" if looked_up else "    -"
        print(f"{name:22s} {speed:7.1f} {speed / baseline:6.2f} {t['accepted'] / t['rounds']:7.2f} {hit} "
              f"{t['verify_s']:8.2f} {t['draft_s']:8.2f} {t['wait_s']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
