"""How exact speculation is, measured: greedy output against autoregressive decoding of the
same engines, over many prompts, with the load policy on and requests batched.

    python scripts/flip_rate.py --engines engines/tiny --prompts 1000 --max-tokens 64
    python scripts/flip_rate.py --target models/tiny/target --draft models/tiny/draft
    python scripts/flip_rate.py --engines engines/smollm2 --chat      # bench.py --chat's questions
    python scripts/flip_rate.py --engines engines/tiny --sampled 200  # seeded samples too

Greedy speculative decoding commits the target's argmax at every position, so it equals
autoregressive decoding exactly when the target scores a token the same way whatever
else shares its forward (the verify's other K tokens, the other requests of the batch,
their padding). This runs each prompt alone with K = 0 (the reference), then every
prompt again with SSD under the load policy (K chosen per round, up to `-k`; fan-out 3),
and with K pinned per prompt (1 to the engines' most, so every verify width shares a
batch with every other), `--batch` requests at a time, and counts the generations whose
tokens differ: a flip is
the first position where the target's argmax moved. The rounds' K are counted, so the
figure shows the policy did vary K. `--chat` instead runs each of `bench.py --chat`'s
questions as a chat turn alone, autoregressive, speculative (K fixed) and SSD (fixed K,
fan-out), and reports whether the ids are equal.

`--sampled N` adds N seeded sampled prompts (temperature 0.8): speculative decoding with
K fixed, alone, against SSD with the same K pinned (fan-out 3) in batches: a seed replays
exactly only when the same K are chosen, which the load policy does not promise. These
are equal when the draft's distributions do not depend on the batch; a pre-speculated
branch's q comes from a tree-masked forward, whose sums run over another layout of the
cache, so it can differ in the last bits from the q of an ordinary draft, and this counts
how often that changed a sample.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.models.prompts import CHAT_PROMPTS
from saguaro.runtime.pipeline import Pipeline

SAMPLED = 0.8  # temperature of --sampled


def prompt_texts(count: int, words: int = 12) -> list[str]:
    """`count` distinct prompts: the opening words of the paragraphs of Python's own pydoc
    topics (text every Python ships), in a fixed order."""
    from pydoc_data.topics import topics

    seen, texts = set(), []
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            text = " ".join(paragraph.split()[:words])
            if len(text) > 20 and text not in seen:
                seen.add(text)
                texts.append(text)
    if len(texts) < count:
        raise ValueError(f"--prompts {count}: the pydoc topics give only {len(texts)} distinct prompts")
    return texts[:count]


@dataclass
class Comparison:
    """Generations under test against their references, token by token."""

    name: str
    prompts: int = 0
    tokens_compared: int = 0
    differing: int = 0
    first_flips: list[tuple[int, int]] = field(default_factory=list)  # (prompt index, position)
    draft_tokens_per_round: dict[int, int] = field(default_factory=dict)  # K -> rounds
    seconds: float = 0.0

    def add(self, index: int, expected: list[int], got: list[int]) -> None:
        self.prompts += 1
        same = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        self.tokens_compared += same
        if expected != got:
            self.differing += 1
            self.first_flips.append((index, same))

    def row(self) -> str:
        ks = ", ".join(f"K={k}: {n}" for k, n in sorted(self.draft_tokens_per_round.items()))
        return (f"{self.name:44s} {self.prompts:7d} {self.tokens_compared:9d} {self.differing:9d} "
                f"{self.differing / max(self.prompts, 1):8.2%}  {ks}")


def decode_all(pipeline: Pipeline, prompts, options: DecodeOptions | list[DecodeOptions], sampling, batch: int,
               seeds: list[int] | None = None) -> tuple[list[list[int]], Counter]:
    """Every prompt decoded (with its own options when given a list), `batch` requests
    submitted together; the K of every round."""
    rounds: Counter[int] = Counter()
    pipeline.observe_rounds(lambda sequences, _: rounds.update(s.verified for s in sequences))
    outputs = []
    for start in range(0, len(prompts), batch):
        chunk = range(start, min(start + batch, len(prompts)))
        requests = [pipeline.request(prompts[i], options[i] if isinstance(options, list) else options,
                                     sampling if seeds is None else SamplingParams(sampling.temperature, seed=seeds[i]))
                    for i in chunk]
        outputs += [generation.output_ids for generation in pipeline.generate_batch(requests)]
    pipeline.observe_rounds(None)
    return outputs, rounds


def compare(name: str, expected: list[list[int]], got: list[list[int]], rounds: Counter, seconds: float):
    result = Comparison(name, draft_tokens_per_round=dict(rounds), seconds=seconds)
    for index, (a, b) in enumerate(zip(expected, got)):
        result.add(index, a, b)
    return result


def timed(function, *args):
    started = time.perf_counter()
    value = function(*args)
    return value, time.perf_counter() - started


def greedy_flips(pipeline: Pipeline, prompts, args) -> list[Comparison]:
    """SSD under the load policy, and SSD with K pinned per prompt (1 up to the engines'
    most, so every verify width meets every other in a batch), against autoregressive."""
    common = dict(max_tokens=args.max_tokens, eos_token_id=-1)
    reference = DecodeOptions(mode="autoregressive", **common)
    policy = DecodeOptions(mode="ssd", num_draft_tokens=args.num_draft_tokens, fanout=(3,), adapt_k=True, **common)
    target, draft = cast(Any, pipeline.target), cast(Any, pipeline.draft)  # Engines (Pipeline types them object)
    most, branches = target.info.max_draft_tokens or 8, draft.info.max_branches or 32
    ks = [1 + index % most for index in range(len(prompts))]
    pinned = [DecodeOptions(mode="ssd", num_draft_tokens=k, fanout=(max(1, min(3, branches // (k + 1))),), **common)
              for k in ks]
    (expected, _), _ = timed(decode_all, pipeline, prompts, reference, SamplingParams(), 1)
    (got, rounds), seconds = timed(decode_all, pipeline, prompts, policy, SamplingParams(), args.batch)
    results = [compare(f"greedy: ssd, load policy, batches of {args.batch}", expected, got, rounds, seconds)]
    (got, rounds), seconds = timed(decode_all, pipeline, prompts, pinned, SamplingParams(), args.batch)
    results.append(compare(f"greedy: ssd, K = 1..{most} by prompt, batches", expected, got, rounds, seconds))
    return results


def sampled_differences(pipeline: Pipeline, prompts, args) -> Comparison:
    common = dict(max_tokens=args.max_tokens, eos_token_id=-1, num_draft_tokens=args.num_draft_tokens)
    sampling, seeds = SamplingParams(temperature=SAMPLED), list(range(len(prompts)))
    (expected, _), _ = timed(decode_all, pipeline, prompts, DecodeOptions(mode="speculative", **common), sampling,
                             1, seeds)
    # K pinned: a seed replays exactly only when the same K are chosen (the load policy's vary)
    pinned = DecodeOptions(mode="ssd", fanout=(3,), **common)
    (got, rounds), seconds = timed(decode_all, pipeline, prompts, pinned, sampling, args.batch, seeds)
    return compare(f"sampled T={SAMPLED}: ssd vs sd, K pinned, batches of {args.batch}", expected, got, rounds,
                   seconds)


def chat_equalities(pipeline: Pipeline, args) -> list[dict]:
    """Each chat question alone: autoregressive, speculative and SSD ids, and whether equal."""
    common = dict(max_tokens=args.max_tokens)
    modes = {"autoregressive": DecodeOptions(mode="autoregressive", **common),
             "speculative": DecodeOptions(mode="speculative", num_draft_tokens=args.num_draft_tokens, **common),
             "ssd": DecodeOptions(mode="ssd", num_draft_tokens=args.num_draft_tokens, fanout=(3,), **common)}
    rows = []
    for question in CHAT_PROMPTS:
        prompt = pipeline.encode_chat(question)
        ids = {mode: pipeline.generate(prompt, options, SamplingParams()).output_ids for mode, options in modes.items()}
        rows.append({"question": question, "tokens": len(ids["autoregressive"]), "ids": ids["autoregressive"],
                     "speculative_equal": ids["speculative"] == ids["autoregressive"],
                     "ssd_equal": ids["ssd"] == ids["autoregressive"]})
        verdicts = ["equal" if rows[-1][f"{mode}_equal"] else "DIFFERS" for mode in ("speculative", "ssd")]
        print(f"{question:52s} {rows[-1]['tokens']:4d} tokens  speculative {verdicts[0]}  ssd {verdicts[1]}",
              flush=True)
    return rows


def describe(args, pipeline: Pipeline) -> str:
    source = args.engines or f"{args.target} + {args.draft}"
    target = cast(Any, pipeline.target)  # an Engine (Pipeline types it object)
    return f"{source} ({target.info.backend})"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="flip_rate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="the most K the policy may pick")
    parser.add_argument("--batch", type=int, default=None, help="requests decoded together (default: the KV slots)")
    parser.add_argument("--sampled", type=int, default=0, help="seeded sampled prompts to compare as well")
    parser.add_argument("--chat", action="store_true", help="bench.py --chat's questions, alone, greedy")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.engines and not (args.target and args.draft):
        parser.error("give --engines DIR, or --target DIR and --draft DIR")
    for flag in ("prompts", "max_tokens", "num_draft_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    pipeline = Pipeline.load(engines=args.engines) if args.engines else Pipeline.load(args.target, args.draft)
    args.batch = args.batch or pipeline.max_active
    report = {"engines": describe(args, pipeline), "max_tokens": args.max_tokens, "k": args.num_draft_tokens}
    try:
        if args.chat:
            report["chat"] = chat_equalities(pipeline, args)
        else:
            prompts = [pipeline.encode(text) for text in prompt_texts(max(args.prompts, args.sampled))]
            print(f"{report['engines']}: {args.prompts} prompts x {args.max_tokens} greedy tokens, K <= "
                  f"{args.num_draft_tokens}")
            print(f"{'comparison':44s} {'prompts':>7s} {'tokens':>9s} {'differing':>9s} {'share':>8s}  "
                  "rounds by K verified")
            results = greedy_flips(pipeline, prompts[:args.prompts], args)
            for result in results:
                print(result.row(), flush=True)
            if args.sampled:
                results.append(sampled_differences(pipeline, prompts[:args.sampled], args))
                print(results[-1].row(), flush=True)
            report["comparisons"] = [asdict(result) for result in results]
    finally:
        pipeline.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
