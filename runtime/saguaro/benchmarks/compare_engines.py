"""Two engine folders' forwards timed against each other, interleaved.

    python scripts/compare_engines.py engines/before engines/after [--repeats 80] [--context 128]
    python scripts/compare_engines.py engines/fp32 engines/w8a8 --agreement [--max-tokens 96]

One call of each engine in turn, so a busy spell of a shared machine lands on both alike;
the median ms of target decode (1 token), target verify (5), draft decode (1) and a draft
tree step (8 branches) after `--context` cached tokens, one thread per engine, and the
ratio second / first. What a graph change costs, where the engine latency suite's
separate runs differ by more than the change.

`--agreement`: how far the second target is from the first (a quantised build from fp32):
the first answers the benchmark's prompts greedily (chat questions through the chat
template where the tokenizer has one, else plain prompts), then both read those answers
in one forward each; per answer position, whether their argmax agrees, and the mean
KL(first || second) of their next-token distributions.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.models.prompts import CHAT_PROMPTS, PROMPTS, has_chat_template
from saguaro.runtime.pipeline import Pipeline

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


def read_logits(engine, ids: list[int]) -> torch.Tensor:
    """Every position's logits for `ids`, one forward."""
    cache = engine.new_cache(len(ids) + 1)
    logits = engine.forward(cache, torch.tensor(ids), torch.arange(len(ids))).float()
    cache.release()
    return logits


def agreement(folders: list[Path], tokens: int) -> tuple[float, float, int]:
    """(top-1 agreement, mean KL(first || second), positions) over the first target's
    greedy answers to the benchmark prompts."""
    pipeline = Pipeline.load(engines=folders[0])
    second = load_engine_pair(folders[1], 1, 1)[0]
    chat = has_chat_template(pipeline.tokenizer)
    answering = DecodeOptions(mode="autoregressive", max_tokens=tokens, eos_token_id=-1)  # every answer `tokens` long
    agreeing, divergence, positions = 0, 0.0, 0
    for text in CHAT_PROMPTS if chat else PROMPTS:
        prompt = pipeline.encode_chat(text) if chat else pipeline.encode(text)
        ids = prompt + pipeline.generate(prompt, answering, SamplingParams()).output_ids
        # the positions that predict the answer's tokens
        reference, other = (read_logits(engine, ids)[len(prompt) - 1:-1] for engine in (pipeline.target, second))
        agreeing += int((reference.argmax(-1) == other.argmax(-1)).sum())
        p, q = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
        divergence += float((p.exp() * (p - q)).sum())
        positions += len(reference)
    pipeline.close()
    return agreeing / positions, divergence / positions, positions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="compare_engines.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--repeats", type=int, default=80)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--agreement", action="store_true",
                        help="the second target's greedy agreement and KL against the first, not times")
    parser.add_argument("--max-tokens", type=int, default=96, help="with --agreement: answer tokens per prompt")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.context < 1 or args.max_tokens < 1:
        parser.error("--repeats, --context and --max-tokens must be >= 1")
    torch.set_num_threads(1)
    if args.agreement:
        share, divergence, positions = agreement([args.first, args.second], args.max_tokens)
        print(f"{args.second} against {args.first}: greedy agreement {share:.4f} over {positions} answer "
              f"positions, mean KL {divergence:.5f}")
        return 0
    print(f"median ms of {args.repeats} interleaved calls at {args.context} cached tokens")
    print(f"{'forward':18s} {'first':>9s} {'second':>9s} {'second/first':>12s}")
    for name, first, second in compare([args.first, args.second], args.repeats, args.context):
        print(f"{name:18s} {first:9.3f} {second:9.3f} {second / first:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
