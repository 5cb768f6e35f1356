"""The plugins' ops timed per call: the reference (PyTorch ops) against the OpenAI Triton
kernels that TensorRT's plugins run, on the same device and the same random rounds.

    python scripts/bench_kernels.py                     # a CUDA GPU: reference and kernels
    python scripts/bench_kernels.py --vocab 49152 -k 1,4,8 --json kernels.json

Each row is one op at one K: `fused_verify` greedy and sampled (temperature 0.8, top-p
0.95) over a `[K+1, V]` round, `plan_branches` with two branches per depth over a
`[K+1, V]` score block. A call's time is the wall time of `--calls` calls in a row, the
device synchronised before and after, divided by the calls (launches included: a
round pays them), the median of `--repeats` such runs. Every kernel's outcome is compared
with the reference's on the same inputs; a row that differs is reported and the exit
status is 1. Without a CUDA GPU only the reference is timed (on the CPU, as the ONNX
Runtime engines' graphs run these ops); the kernels are compiled for a GPU only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Callable

import torch

from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.plugins.fused_verify.reference import fused_verify

SAMPLED = dict(temperature=0.8, top_k=0, top_p=0.95)
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0)
BRANCHES_PER_DEPTH = 2


@dataclass(frozen=True)
class KernelRow:
    op: str
    draft_tokens: int
    reference_us: float
    kernel_us: float | None  # None: no CUDA GPU, no kernel
    same_outcome: bool | None
    kernel_first_call_s: float | None = None  # the first launch, which compiles the kernel

    @property
    def speedup(self) -> float | None:
        return self.reference_us / self.kernel_us if self.kernel_us else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's: 49152)")
    parser.add_argument("-k", "--draft-tokens", default="1,4,8", help="comma-separated K values")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row (the median is reported)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when a GPU is there, else cpu (the reference alone)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        args.draft_tokens = [int(k) for k in args.draft_tokens.split(",")]
    except ValueError:
        parser.error(f"--draft-tokens takes comma-separated integers; got {args.draft_tokens!r}")
    if any(k < 1 for k in args.draft_tokens) or args.vocab < 2 or args.calls < 1 or args.repeats < 1:
        parser.error("--draft-tokens must be >= 1, --vocab >= 2, --calls and --repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to PyTorch")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def first_call_s(call: Callable[[], object], device: str) -> float:
    """The first call's wall time: a kernel compiles (or loads from Triton's cache) then."""
    started = time.perf_counter()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def per_call_us(call: Callable[[], object], device: str, calls: int, repeats: int) -> float:
    """Median over `repeats` runs of the wall time of `calls` calls, per call, in µs."""
    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def verify_round(generator: torch.Generator, k: int, vocab: int, device: str):
    """Target logits `[K+1, V]`, the draft's K tokens (the target's argmax for the first
    half: a round with both accepted and rejected drafts), q `[K, V]`, uniforms `[K+1]`."""
    logits = torch.randn(k + 1, vocab, generator=generator) * 3
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 2, dim=-1)
    drafts = torch.multinomial(q, 1, generator=generator).view(k)
    drafts[:(k + 1) // 2] = logits[:(k + 1) // 2].argmax(-1)
    uniforms = torch.rand(k + 1, generator=generator)
    return tuple(tensor.to(device) for tensor in (logits, drafts, q, uniforms))


def verify_rows(k: int, args, generator) -> list[KernelRow]:
    logits, drafts, q, uniforms = verify_round(generator, k, args.vocab, args.device)
    rows = []
    for name, sampling in (("fused_verify greedy", GREEDY), ("fused_verify sampled", SAMPLED)):
        def run_reference():
            return fused_verify(logits, drafts, q, uniforms, **sampling)
        rows.append(timed_row(name, k, run_reference, kernel_call(
            "fused_verify", lambda kernel: kernel(logits, drafts, q, uniforms, **sampling), args.device), args))
    return rows


def plan_rows(k: int, args, generator) -> list[KernelRow]:
    scores = torch.randn(k + 1, args.vocab, generator=generator).to(args.device)
    drafts = scores[:k].argmax(-1)
    fanout = torch.full((k + 1,), BRANCHES_PER_DEPTH, dtype=torch.int64, device=args.device)
    context_length = 64

    def run_reference():
        return plan_branches(scores, drafts, fanout, context_length)
    return [timed_row("plan_branches", k, run_reference, kernel_call(
        "plan_branches", lambda kernel: kernel(scores, drafts, fanout, context_length), args.device), args)]


def kernel_call(op: str, call_with: Callable, device: str) -> Callable[[], object] | None:
    """The OpenAI Triton kernel's call of `op`, or None without a GPU (the kernels' modules
    import `triton`, which a CPU machine need not have)."""
    if device != "cuda":
        return None
    from saguaro.plugins.branch_draft.triton_kernel import plan_branches as plan_kernel
    from saguaro.plugins.fused_verify.triton_kernel import fused_verify as verify_kernel
    kernel = verify_kernel if op == "fused_verify" else plan_kernel
    return lambda: call_with(kernel)


def outcome(result) -> list[list[int]]:
    """An op's result as plain lists, to compare the reference's with a kernel's."""
    tensors = [getattr(result, field.name) for field in fields(result)] if is_dataclass(result) else result
    return [torch.as_tensor(tensor).to(torch.int64).flatten().tolist() for tensor in tensors]


def timed_row(op: str, k: int, reference: Callable, kernel: Callable | None, args) -> KernelRow:
    first_call_s(reference, args.device)
    reference_us = per_call_us(reference, args.device, args.calls, args.repeats)
    if kernel is None:
        return KernelRow(op, k, reference_us, None, None)
    compile_s = first_call_s(kernel, args.device)
    same = outcome(kernel()) == outcome(reference())
    return KernelRow(op, k, reference_us, per_call_us(kernel, args.device, args.calls, args.repeats), same,
                     compile_s)


def table(rows: list[KernelRow]) -> str:
    return "\n".join(["| op | K | reference µs | kernel µs | reference / kernel | same outcome | first call s |",
                      "|---|---|---|---|---|---|---|"] + [table_line(row) for row in rows])


def table_line(row: KernelRow) -> str:
    kernel = f"{row.kernel_us:.1f}" if row.kernel_us is not None else "(no GPU)"
    speedup = f"{row.speedup:.2f}x" if row.speedup else ""
    same = "" if row.same_outcome is None else ("yes" if row.same_outcome else "NO")
    first = f"{row.kernel_first_call_s:.2f}" if row.kernel_first_call_s is not None else ""
    return f"| {row.op} | {row.draft_tokens} | {row.reference_us:.1f} | {kernel} | {speedup} | {same} | {first} |"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main(argv=None) -> int:
    args = parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    print(f"kernels: {device_name(args.device)}, vocabulary {args.vocab}, K {args.draft_tokens}", flush=True)
    rows: list[KernelRow] = []
    for k in args.draft_tokens:
        for row in verify_rows(k, args, generator) + plan_rows(k, args, generator):
            print(f"  {table_line(row)}", flush=True)  # progress: a slow compile shows where it is
            rows.append(row)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(args.device), "vocab": args.vocab,
                                         "rows": [asdict(row) | {"speedup": row.speedup} for row in rows]}, indent=2))
    differing = [f"{row.op} K={row.draft_tokens}" for row in rows if row.same_outcome is False]
    if differing:
        print(f"kernels differ from the reference: {', '.join(differing)}", file=sys.stderr)
        return 1
    return 0
