"""Fill the Triton model repository templates (`model_repo/`) into a run folder.

    python scripts/prepare_model_repo.py --engines engines/tiny --out .triton/model_repo
    python scripts/prepare_model_repo.py --target models/tiny/target --draft models/tiny/draft \
        --out .triton/model_repo

The tensorrtllm_backend way (its `fill_template.py`): each `config.pbtxt` is a template
whose `${key}` placeholders are substituted from one mapping; a placeholder without a
value, a value no template uses, or a placeholder left after filling is an error. The
values come from the engine manifest (tokenizer folder, BOS id, the limits the engines
were built for) or from the checkpoints, plus the default SSD knobs. The templates are
never edited in place: the filled copy goes to `--out`.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from saguaro.runtime.arguments import DECODE_DEFAULTS, add_decoding_arguments, add_draft_method_argument
from saguaro.runtime.control.calibration import calibration_from_manifest
from saguaro.runtime.core.options import (
    DRAFT_METHODS,
    NO_MODEL_METHOD,
    DecodeOptions,
    check_engine_limits,
    hidden_branch_options,
    uses_draft_model,
)
from saguaro.runtime.engines.manifest import read_manifest
from saguaro.runtime.engines.torch_engine import DEFAULT_MAX_CONTEXT as TORCH_MAX_CONTEXT
from saguaro.runtime.models.checkpoint import llama_shape, read_config
from saguaro.runtime.pipeline import BATCHING
from saguaro.serving.settings import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_STREAM_INTERVAL,
    DEFAULT_TRITON_MAX_BATCH_SIZE,
    parse_stream_interval,
)

PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def templates_dir() -> Path:
    """The templates: packaged inside `saguaro.serving` in a wheel, or the checkout's own
    top-level `model_repo/` when the project runs from its source tree."""
    packaged = Path(__file__).resolve().parent / "model_repo"
    if (packaged / "ensemble" / "config.pbtxt").is_file():
        return packaged
    checkout = Path(__file__).resolve().parents[3] / "model_repo"  # runtime/saguaro/serving/ -> root
    if (checkout / "ensemble" / "config.pbtxt").is_file():
        return checkout
    raise FileNotFoundError(f"no model repository templates in {packaged} or {checkout}")


@dataclass(frozen=True)
class ModelSource:
    """Where the models and their tokenizer are, and what the engines were built for."""

    tokenizer_dir: Path
    max_context: int
    engines_dir: Path | None = None
    target_dir: Path | None = None
    draft_dir: Path | None = None
    max_draft_tokens: int | None = None  # None: checkpoints have no built limit
    max_branches: int | None = None
    hidden_branches: tuple[int, ...] | None = None  # by K: what pre-speculation hides (measured at build)
    draft_method: str = DRAFT_METHODS[0]  # "ngram": no draft model (`draft_dir` None with checkpoints)


def source_from_engines(engines_dir: Path) -> ModelSource:
    """Raises ManifestError naming what is wrong with the folder."""
    engines_dir = Path(engines_dir).resolve()
    manifest = read_manifest(engines_dir)
    build = manifest["build"]
    return ModelSource(tokenizer_dir=engines_dir / manifest["tokenizer"]["dir"],
                       max_context=build["max_context"], engines_dir=engines_dir,
                       max_draft_tokens=build.get("max_draft_tokens"), max_branches=build.get("max_branches"),
                       hidden_branches=hidden_by_k(manifest))


def hidden_by_k(manifest: dict) -> tuple[int, ...] | None:
    """What pre-speculation hides at each K the engines take (the calibration's rule)."""
    calibration, build = calibration_from_manifest(manifest), manifest["build"]
    return None if calibration is None else calibration.hidden_by_k(build["max_draft_tokens"], build["max_branches"])


def source_from_checkpoints(target_dir: Path, draft_dir: Path | None) -> ModelSource:
    """Raises CheckpointError naming the folder that is not a checkpoint (`draft_dir` None:
    no draft model, for the n-gram draft)."""
    target_dir = Path(target_dir).resolve()
    config = read_config(target_dir)
    if draft_dir is not None:
        draft_dir = Path(draft_dir).resolve()
        read_config(draft_dir)
    positions = llama_shape(config, str(target_dir)).max_position_embeddings
    return ModelSource(tokenizer_dir=target_dir, max_context=min(positions, TORCH_MAX_CONTEXT),
                       target_dir=target_dir, draft_dir=draft_dir)


def default_options(source: ModelSource, mode: str, num_draft_tokens: int | None,
                    fanout: tuple[int, ...] | None, budget: int | str | None,
                    adapt_k: bool = True) -> DecodeOptions:
    """The knobs a request gets when it gives none: `DecodeOptions`' defaults, with K and
    the fan-out shrunk to fit what the engines were built for unless given explicitly
    (then they must fit): at most the default fan-out, and no more branches than hide
    under one verification on the machine the engines were built on."""
    k = num_draft_tokens
    if k is None:
        k = min(DECODE_DEFAULTS.num_draft_tokens, source.max_draft_tokens or DECODE_DEFAULTS.num_draft_tokens)
    if fanout is None and budget is None and source.hidden_branches is not None:
        hidden = source.hidden_branches[min(k, len(source.hidden_branches) - 1)]
        spend = hidden_branch_options(min(hidden, max(DECODE_DEFAULTS.fanout) * (k + 1)), k)
        fanout, budget = spend["fanout"], spend["budget"]
    if fanout is None and budget is None and source.max_branches is not None:
        fanout = (max(1, min(max(DECODE_DEFAULTS.fanout), source.max_branches // (k + 1))),)
    options = DecodeOptions(mode=mode, num_draft_tokens=k, fanout=fanout or DECODE_DEFAULTS.fanout, budget=budget,
                            adapt_k=adapt_k)
    check_engine_limits(options, source.max_draft_tokens, source.max_branches)
    return options


def template_values(source: ModelSource, options: DecodeOptions, max_concurrency: int | None,
                    max_queue: int, batching: str = BATCHING[0],
                    triton_max_batch_size: int = DEFAULT_TRITON_MAX_BATCH_SIZE,
                    decoupled: bool = True, stream_interval: int | str = DEFAULT_STREAM_INTERVAL) -> dict[str, str]:
    def text(value) -> str:
        return "" if value is None else str(value)

    return {"engines_dir": text(source.engines_dir), "target_dir": text(source.target_dir),
            "draft_dir": text(source.draft_dir), "draft_method": source.draft_method,
            "tokenizer_dir": str(source.tokenizer_dir),
            "max_context": str(source.max_context),
            "default_decoding_mode": options.mode,
            "default_num_draft_tokens": str(options.num_draft_tokens),
            "default_fanout": ",".join(map(str, options.fanout)), "default_budget": text(options.budget),
            "default_adapt_k": str(options.adapt_k).lower(),
            "max_concurrency": text(max_concurrency), "max_queue": str(max_queue), "batching": batching,
            "stream_interval": str(stream_interval),
            "triton_max_batch_size": str(triton_max_batch_size), "decoupled_mode": str(decoupled).lower()}


def fill(template: str, values: dict[str, str], where: str) -> str:
    """Substitute every `${key}`; a key without a value is an error naming it."""
    def value_of(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"{where}: no value for template parameter ${{{name}}}")
        return values[name].replace("\\", "\\\\").replace('"', '\\"')  # a pbtxt string

    return PLACEHOLDER.sub(value_of, template)


def placeholders(text: str) -> set[str]:
    return set(PLACEHOLDER.findall(text))


def prepare_model_repo(out: Path, values: dict[str, str], templates: Path | None = None) -> Path:
    """A filled copy of the templates at `out` (replacing an earlier prepared copy)."""
    templates = (templates or templates_dir()).resolve()
    out = Path(out).resolve()
    if out == templates or templates in out.parents:
        raise ValueError(f"--out {out} is inside the templates folder {templates}")
    if out.exists():
        if not (out / "ensemble" / "config.pbtxt").is_file():
            raise ValueError(f"--out {out} exists and is not a prepared model repository; not replacing it")
        shutil.rmtree(out)
    configs = sorted(templates.glob("*/config.pbtxt"))
    unused = set(values) - set().union(*(placeholders(c.read_text()) for c in configs))
    if unused:
        raise KeyError(f"template values {sorted(unused)} are used by no config.pbtxt in {templates}")
    shutil.copytree(templates, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".gitkeep"))
    for config in out.glob("*/config.pbtxt"):
        config.write_text(fill(config.read_text(), values, str(config.relative_to(out))))
        (config.parent / "1").mkdir(exist_ok=True)  # Triton needs a version folder, even an ensemble's
    return out


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """What to serve and the default SSD knobs (shared with `launch`)."""
    source = parser.add_argument_group("models: a built engine folder, or two checkpoints")
    source.add_argument("--engines", type=Path, help="a folder made by scripts/build_engines.py")
    source.add_argument("--target", type=Path, help="target Hugging Face checkpoint folder")
    source.add_argument("--draft", type=Path, help="draft Hugging Face checkpoint folder")
    add_draft_method_argument(source)
    knobs = parser.add_argument_group("what a request gets for the SSD knobs it leaves out "
                                      "(K and the fan-out are capped by the engines' limits)")
    # a group takes the same add_argument calls as the parser add_decoding_arguments is typed for
    add_decoding_arguments(cast(argparse.ArgumentParser, knobs), defaults=None, per_request_flags=False)
    knobs.add_argument("--fixed-k", action="store_true",
                       help="K drafts every round, instead of K per round from the load policy")
    parser.add_argument("--batching", choices=BATCHING, default=BATCHING[0],
                        help="iteration: one scheduler batches every request's rounds (default); "
                             "per-request: each request decoded alone in a thread of its own (a baseline)")
    parser.add_argument("--max-concurrency", type=int,
                        help="requests decoded together (default: the engines' KV slots, their max_batch)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting beyond those; more are refused (default {DEFAULT_MAX_QUEUE})")
    triton = parser.add_argument_group("the model repository, as tensorrtllm_backend's fill_template.py sets it")
    triton.add_argument("--triton-max-batch-size", type=int, default=DEFAULT_TRITON_MAX_BATCH_SIZE,
                        help="prompts one request may hold (batched requests get one response per prompt, "
                             f"each with its batch_index; default {DEFAULT_TRITON_MAX_BATCH_SIZE})")
    triton.add_argument("--stream-interval", default=DEFAULT_STREAM_INTERVAL,
                        help="rounds a stream's tokens may wait before they are sent (as TensorRT-LLM's "
                             "stream_interval): an integer N, or 'auto' (about 4 responses per round whatever "
                             "the batch: every round for up to 4 streams, every 4th for 16; default)")
    triton.add_argument("--decoupled-mode", choices=("true", "false"), default="true",
                        help="true: streaming, one response per round (default); false: one response per "
                             "request (Triton's non-streaming API)")


def source_from_args(args: argparse.Namespace) -> ModelSource:
    """The models `add_source_arguments`' flags name; ValueError names the flag at fault."""
    by_model = uses_draft_model(args.draft_method)
    if args.engines is not None:
        if args.target or args.draft:
            raise ValueError("give --engines or --target/--draft, not both")
        source = source_from_engines(args.engines)
    elif args.target is not None and (args.draft is not None or not by_model):
        if args.draft is not None and not by_model:
            raise ValueError(f"--draft: --draft-method {args.draft_method} uses no draft model; leave --draft out")
        source = source_from_checkpoints(args.target, args.draft)
    else:
        raise ValueError("give --engines DIR, or both --target DIR and --draft DIR (--target alone with "
                         f"--draft-method {NO_MODEL_METHOD})")
    return replace(source, draft_method=args.draft_method)


def values_from_args(args: argparse.Namespace) -> dict[str, str]:
    """Checked template values for parsed flags; ValueError names the flag at fault."""
    source = source_from_args(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.triton_max_batch_size < 1:
        raise ValueError(f"--triton-max-batch-size must be >= 1, got {args.triton_max_batch_size}")
    try:
        stream_interval = parse_stream_interval(args.stream_interval)
    except ValueError as error:
        raise ValueError(f"--stream-interval: {error}") from None
    options = default_options(source, args.mode, args.num_draft_tokens, args.fanout, args.budget,
                              adapt_k=not args.fixed_k)
    return template_values(source, options, args.max_concurrency, args.max_queue, args.batching,
                           args.triton_max_batch_size, args.decoupled_mode == "true", stream_interval)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prepare_model_repo.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path(".triton") / "model_repo")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = prepare_model_repo(args.out, values_from_args(args))
    except ValueError as error:  # ManifestError and CheckpointError are ValueErrors too
        print(f"prepare_model_repo: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
