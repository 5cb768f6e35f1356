"""Command-line flags for decoding and sampling, shared by every entry point.

Defaults come from `DecodeOptions` and `SamplingParams` themselves, and values are parsed
by `options.parse_fanout` / `parse_budget`: a flag's default or syntax cannot drift
between `generate`, `bench` and `serve`.
"""
from __future__ import annotations

import argparse
from typing import Callable

from saguaro.runtime.core.options import DRAFT_METHODS, MODES, DecodeOptions, parse_budget, parse_fanout
from saguaro.runtime.core.sampling import SamplingParams

DECODE_DEFAULTS = DecodeOptions()
SAMPLING_DEFAULTS = SamplingParams()


def flag_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse `type` that shows the parser's own message for a bad value."""
    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    parse_flag.__name__ = parse.__name__
    return parse_flag


def add_decoding_arguments(parser: argparse.ArgumentParser, defaults: DecodeOptions | None = DECODE_DEFAULTS,
                           per_request_flags: bool = True) -> None:
    """--mode, --num-draft-tokens, --fanout | --budget, and with `per_request_flags`
    --saguaro and --no-prespeculate. `defaults=None` leaves K, fan-out and budget None
    (the server then fits them to the engines)."""
    def default(name: str):
        return None if defaults is None else getattr(defaults, name)

    parser.add_argument("--mode", "--decoding-mode", dest="mode", choices=MODES,
                        default=default("mode") or DECODE_DEFAULTS.mode)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=default("num_draft_tokens"),
                        help=f"K, drafts per round (default {DECODE_DEFAULTS.num_draft_tokens})")
    branching = parser.add_mutually_exclusive_group()
    branching.add_argument("--fanout", type=flag_type(parse_fanout), default=default("fanout"),
                           help="branches per depth: one value or K+1 values "
                                f"(default {','.join(map(str, DECODE_DEFAULTS.fanout))})")
    branching.add_argument("--budget", type=flag_type(parse_budget), default=default("budget"),
                           help="B branches placed online where hits are likeliest; 'auto': the load policy "
                                "sizes B each round, so pre-speculation stays hidden under verification")
    if per_request_flags:
        parser.add_argument("--saguaro", type=float, metavar="C", help="Saguaro sampling factor in (0, 1]")
        parser.add_argument("--saguaro-top", type=int, metavar="N", default=None,
                            help=f"tokens Saguaro sampling rescales (default {DECODE_DEFAULTS.saguaro_top})")
        parser.add_argument("--no-prespeculate", action="store_true", help="ssd without pre-speculation")
        parser.add_argument("--fixed-k", action="store_true",
                            help="draft K tokens every round instead of letting the load policy choose "
                                 "K (up to --num-draft-tokens) from measured costs and acceptance; a sampled "
                                 "request's --seed replays exactly with K fixed")


def add_draft_method_argument(parser) -> None:
    """--draft-method: the engines' draft model, or n-gram matching (no draft model)."""
    parser.add_argument("--draft-method", choices=DRAFT_METHODS, default=DRAFT_METHODS[0],
                        help="'model': the draft the engine folder or --draft holds; 'ngram': propose the "
                             "tokens that followed the latest earlier occurrence of the last 2-4 tokens "
                             "in the sequence itself (prompt lookup: no draft model, no draft forwards); "
                             "'ngram+model': a round whose first token such a match proposes is drafted "
                             "by matching alone (while matches are accepted at least as often as the "
                             "model's drafts), every other round by the draft model")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=SAMPLING_DEFAULTS.temperature, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=SAMPLING_DEFAULTS.top_k, help="0 = off")
    parser.add_argument("--top-p", type=float, default=SAMPLING_DEFAULTS.top_p, help="1 = off")
    parser.add_argument("--seed", type=int, default=SAMPLING_DEFAULTS.seed,
                        help="sampling seed (default: a fresh one, printed with the result)")


def decode_options(args: argparse.Namespace, **overrides) -> DecodeOptions:
    """The options the decoding flags ask for (validated: errors name the value)."""
    fields = dict(mode=args.mode, num_draft_tokens=args.num_draft_tokens, fanout=args.fanout,
                  budget=args.budget, saguaro_factor=getattr(args, "saguaro", None),
                  saguaro_top=getattr(args, "saguaro_top", None),
                  prespeculate=not getattr(args, "no_prespeculate", False),
                  adapt_k=not getattr(args, "fixed_k", False))
    fields.update(overrides)
    return DecodeOptions(**{name: value for name, value in fields.items() if value is not None})


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
