"""Compile a draft and a target checkpoint into an engine directory (the main build entry).

    python scripts/build_engines.py                                # the shipped `tiny` config
    python scripts/build_engines.py --config bench --precision int4    # or --config my.yaml
    python scripts/generate.py --engines engines/tiny ...          # run what was built

Flags override the config file. Bad input (unknown keys, wrong types, impossible values,
a checkpoint that is not a Llama, draft and target tokenizers that differ) exits with
status 2 and a message naming the problem, before any long work starts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saguaro.compiler.builder import build_engines, summary
from saguaro.compiler.config import BACKENDS, ConfigError, resolve_config
from saguaro.runtime.models.checkpoint import CheckpointError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="build_engines.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", help="a YAML build config file, or a shipped one by "
                                                          "name: tiny, bench (default tiny)")
    parser.add_argument("--out", type=Path, help="engine directory (default: engines/<name>)")
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--precision", help="fp32 | int8 | int4 | w8a8 (onnxruntime); fp32 | fp16 | bf16 (tensorrt); "
                                            "auto: the backend's default (fp32, fp16)")
    parser.add_argument("--max-draft-tokens", type=int, help="K: the longest draft a verify accepts")
    parser.add_argument("--max-branches", type=int, help="fan-out budget: branches per round")
    parser.add_argument("--max-context", type=int, help="prompt + output tokens per sequence")
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--threads", type=int, help="intra-op threads per engine")
    parser.add_argument("--target", type=Path, help="target checkpoint folder")
    parser.add_argument("--draft", type=Path, help="draft checkpoint folder, or a feature head's (EAGLE-3)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
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
