"""Two engine folders' forwards timed against each other, interleaved.

    python scripts/compare_engines.py engines/before engines/after [--repeats 80] [--context 128]

One call of each engine in turn, so a busy spell of a shared machine lands on both alike;
the median ms of target decode (1 token), target verify (5), draft decode (1) and a draft
tree step (8 branches) after `--context` cached tokens, one thread per engine, and the
ratio second / first. What a graph change costs, where the engine latency suite's
separate runs differ by more than the change.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from saguaro.runtime.engines import load_engine_pair

FORWARDS = [("target decode(1)", 0, 1), ("target verify(5)", 0, 5), ("draft decode(1)", 1, 1),
            ("draft tree(8)", 1, 8)]


def timed_forward(engine, context: int, tokens: int):
    """A cache holding `context` tokens and a call that times one forward of `tokens` more
    (each call rolls the cache back first; a tree step is `tokens` rows at one depth)."""
    cache = engine.new_cache(context + tokens + 1)
    engine.forward(cache, torch.arange(context) % 100 + 5, torch.arange(context))
    tree = tokens > 5
    positions = torch.full((tokens,), context) if tree else torch.arange(context, context + tokens)
    mask = None
    if tree:
        mask = torch.zeros(tokens, context + tokens, dtype=torch.bool)
        mask[:, :context] = True
        mask[torch.arange(tokens), context + torch.arange(tokens)] = True

    def call() -> float:
        cache.truncate(context)
        started = time.perf_counter()
        engine.forward(cache, torch.arange(tokens) + 7, positions, mask)
        return time.perf_counter() - started

    return cache, call


def compare(folders: list[Path], repeats: int, context: int) -> list[tuple[str, float, float]]:
    pairs = [load_engine_pair(folder, 1, 1) for folder in folders]
    rows = []
    for name, role, tokens in FORWARDS:
        timers = [timed_forward(pair[role], context, tokens) for pair in pairs]
        seconds: list[list[float]] = [[], []]
        for _ in range(repeats):
            for index, (_, call) in enumerate(timers):
                seconds[index].append(call())
        for cache, _ in timers:
            cache.release()
        first, second = (statistics.median(s) * 1e3 for s in seconds)
        rows.append((name, first, second))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="compare_engines.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--repeats", type=int, default=80)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.context < 1:
        parser.error("--repeats and --context must be >= 1")
    torch.set_num_threads(1)
    print(f"median ms of {args.repeats} interleaved calls at {args.context} cached tokens")
    print(f"{'forward':18s} {'first':>9s} {'second':>9s} {'second/first':>12s}")
    for name, first, second in compare([args.first, args.second], args.repeats, args.context):
        print(f"{name:18s} {first:9.3f} {second:9.3f} {second / first:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
