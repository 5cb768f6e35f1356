"""Generate text with a draft/target pair: autoregressive, speculative or SSD decoding.

    python scripts/generate.py --mode ssd --prompt "The with statement" --max-tokens 64
    python scripts/generate.py --engines engines/tiny --json ...
    python scripts/generate.py --engines engines/smollm2 --chat --prompt "What is the capital of France?"
    python scripts/generate.py --engines engines/bench --prompt "The with statement" --prompt "A class"
    python scripts/generate.py --engines engines/smollm2 --chat --prompt "Why is the sky blue?" \
        --mode ssd --compare autoregressive

Several `--prompt`s are decoded together, their rounds batched (`saguaro.runtime.decoding.scheduler`).
`--compare MODE` then decodes them again in this process with both modes, each once
untimed and then `--repeats` times taking turns, and prints both speeds and whether
greedy decoding gave the same tokens (`saguaro.runtime.mode_comparison`).

Every flag is validated before a model loads; a bad value exits with code 2 and a
message naming it.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from saguaro.runtime.arguments import (
    DECODE_DEFAULTS,
    add_decoding_arguments,
    add_draft_method_argument,
    add_sampling_arguments,
    decode_options,
    sampling_params,
)
from saguaro.runtime.control.probes import PROBE_PERIOD
from saguaro.runtime.core.options import MODES
from saguaro.runtime.mode_comparison import compare_modes
from saguaro.runtime.pipeline import Pipeline

DEFAULT_MODELS = Path("models/tiny")
DEFAULT_PROMPT = "The with statement is used to"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="generate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("models (checkpoints, or a built engine folder)")
    source.add_argument("--target", type=Path, default=DEFAULT_MODELS / "target")
    source.add_argument("--draft", type=Path, default=DEFAULT_MODELS / "draft")
    source.add_argument("--engines", type=Path, help="a folder made by scripts/build_engines.py")
    add_draft_method_argument(source)
    add_decoding_arguments(parser)
    parser.add_argument("--prompt", action="append", help=f"repeat to decode several together "
                                                             f"(default {DEFAULT_PROMPT!r})")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt is a user message: render it with the model's chat template "
                             "(generation stops at the model's end-of-turn token)")
    parser.add_argument("--system", help="with --chat: a system prompt (default: the template's own)")
    parser.add_argument("--max-tokens", type=int, default=DECODE_DEFAULTS.max_tokens)
    add_sampling_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per model")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (a list for several prompts; with --compare, "
                             "{\"generations\": [...], \"comparison\": {...}})")
    parser.add_argument("--compare", choices=MODES, metavar="MODE",
                        help=f"then time --mode against MODE (one of {', '.join(MODES)}) on the same engines, "
                             "in this process: one untimed run of each, then --repeats runs each, taking turns")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode with --compare (default 3)")
    args = parser.parse_args(argv)
    args.prompts = args.prompt or [DEFAULT_PROMPT]
    if args.compare == args.mode:
        parser.error(f"--compare {args.compare}: that is the --mode being run; name the other mode to time against")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def report(pipeline, generation) -> dict:
    stats = generation.stats.as_dict()
    return {"prompt_ids": generation.prompt_ids, "output_ids": generation.output_ids,
            "text": pipeline.decode(generation.output_ids), "finish_reason": generation.finish_reason,
            "seed": generation.seed, "stats": stats}


def policy_summary(stats: dict) -> str:
    """What the load policy chose over a generation's rounds: K per round, how often it
    speculated and pre-speculated, and the acceptance its drafts showed."""
    rounds, by_k, probes = max(stats["rounds"], 1), stats["rounds_by_k"], stats["probe_rounds"]
    # with no drafts in the generation, the policy went by the draft's acceptance as measured
    # when it was made (its report, carried into the engines)
    acceptance = (f"acceptance {stats['verified_acceptance']:.2f}" if stats["drafted_tokens"]
                  else "the draft's acceptance as measured when it was made")
    probing = f"probes at least {PROBE_PERIOD} rounds apart ({probes} probed)" if probes else "no probe"
    if by_k[0] > rounds / 2:
        drafted = rounds - by_k[0]
        return (f"load policy: K per round 0 in {by_k[0] / rounds:.0%} of rounds (speculation off: {acceptance} "
                f"does not pay for drafting at these costs); K > 0 in {drafted} rounds, {probing}")
    usual = max(range(1, len(by_k)), key=lambda k: by_k[k])
    prespeculated = stats["prespeculated_rounds"] / rounds
    how = f"with pre-speculation in {prespeculated:.0%} of rounds" if prespeculated else "without pre-speculation"
    return (f"load policy: K={usual} in {by_k[usual] / rounds:.0%} of rounds (mean K per round {stats['mean_k']:.2f}), "
            f"{how}; {acceptance} per draft; {probing}")


def print_human(result: dict, prompt: str, chat: bool, sampled: bool, adapts: bool) -> None:
    stats = result["stats"]
    if chat:
        print(f"user: {prompt}\nassistant: \033[1m{result['text']}\033[0m")
    else:
        print(f"{prompt}\033[1m{result['text']}\033[0m")
    replay = f", seed {result['seed']}" if sampled else ""
    print(f"\n[{stats['mode']}] {stats['tokens']} tokens in {stats['total_s']:.3f} s "
          f"({stats['tokens_per_s']:.1f} tok/s), {stats['rounds']} rounds, finish: {result['finish_reason']}{replay}")
    if stats["num_draft_tokens"] and adapts:
        print(policy_summary(stats))
    if stats["num_draft_tokens"]:
        print(f"acceptance {stats['acceptance_rate']:.2f} per token (mean accepted "
              f"{stats['mean_accepted']:.2f} of K={stats['num_draft_tokens']}), histogram "
              f"{stats['accepted_histogram']}")
    if stats["cache_hits"] + stats["cache_misses"]:
        print(f"speculation cache: {stats['cache_hits']} hits, {stats['cache_misses']} misses "
              f"(hit rate {stats['cache_hit_rate']:.2f}, {stats['branches_drafted']} branches drafted); "
              f"acceptance per token of pre-speculated drafts {stats['prespeculated_acceptance']:.2f} "
              f"({stats['hit_rounds']} rounds), of fresh ones {stats['fresh_acceptance']:.2f}")
    print(f"time: verify {stats['verify_s']:.3f} s, draft on critical path {stats['draft_s']:.3f} s, "
          f"pre-speculation {stats['prespeculate_s']:.3f} s (target waited {stats['wait_s']:.3f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        options = decode_options(args, max_tokens=args.max_tokens)
        sampling = sampling_params(args)
        if args.engines is not None:
            pipeline = Pipeline.load(engines=args.engines, threads=args.threads, options=options,
                                     draft_method=args.draft_method)
        else:
            pipeline = Pipeline.load(target=args.target, draft=args.draft, threads=args.threads,
                                     draft_method=args.draft_method)
        if args.system and not args.chat:
            raise ValueError("--system needs --chat")
        prompts = [pipeline.encode_chat(prompt, args.system) if args.chat else pipeline.encode(prompt)
                   for prompt in args.prompts]

        def make_requests(decoding):
            return [pipeline.request(prompt_ids, decoding, sampling) for prompt_ids in prompts]
        requests = make_requests(options)
        compared = replace(options, mode=args.compare) if args.compare else None
    except ValueError as error:
        print(f"generate.py: error: {error}", file=sys.stderr)
        return 2
    with pipeline:
        results = [report(pipeline, generation) for generation in pipeline.generate_batch(requests)]
        if not args.json:
            for prompt, result in zip(args.prompts, results):
                print_human(result, prompt, args.chat, sampled=not sampling.greedy, adapts=options.adapt_k)
        comparison = None if compared is None else compare_modes(
            pipeline.generate_batch, make_requests, options, compared, args.repeats, sampling.greedy)
    if args.json:
        generations = results[0] if len(results) == 1 else results
        print(json.dumps(generations if comparison is None else
                         {"generations": results, "comparison": comparison.as_dict()}))
    elif comparison is not None:
        print(comparison.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
