"""Compile a draft and a target checkpoint into an engine directory (the main build entry).

    python scripts/build_engines.py                                # build/configs/tiny.yaml
    python scripts/build_engines.py --config build/configs/bench.yaml --precision int4
    python scripts/generate.py --engines engines/tiny ...          # run what was built

Flags override the config file. Bad input (unknown keys, wrong types, impossible values,
a checkpoint that is not a Llama, draft and target tokenizers that differ) exits with
status 2 and a message naming the problem, before any long work starts.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "build" / "configs" / "tiny.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML build config")
    parser.add_argument("--out", type=Path, help="engine directory (default: engines/<name>)")
    parser.add_argument("--backend", choices=("onnxruntime", "tensorrt"))
    parser.add_argument("--precision", help="fp32 | int8 | int4 (onnxruntime); fp32 | fp16 (tensorrt)")
    parser.add_argument("--max-draft-tokens", type=int, help="K: the longest draft a verify accepts")
    parser.add_argument("--max-branches", type=int, help="fan-out budget: branches per round")
    parser.add_argument("--max-context", type=int, help="prompt + output tokens per sequence")
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--threads", type=int, help="intra-op threads per engine")
    parser.add_argument("--target", type=Path, help="target checkpoint folder")
    parser.add_argument("--draft", type=Path, help="draft checkpoint folder")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from build.builder import build_engines, summary
    from build.config import ConfigError, resolve_config
    from runtime.checkpoint import CheckpointError

    overrides = {key: getattr(args, key) for key in ("backend", "precision", "max_draft_tokens", "max_branches",
                                                     "max_context", "max_batch", "threads", "target", "draft")}
    try:
        config = resolve_config(args.config, overrides)
        out = args.out or Path("engines") / config.name
        record = build_engines(config, out, show_progress=not args.quiet)
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary(config, out, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
