"""scripts/bench_kernels.py: rows, the outcome check and its exit status (on CPU; the
kernels themselves are timed on a GPU only, tests/test_gpu.py checks them there)."""
import json
import subprocess
import sys

import pytest
import torch

from saguaro.benchmarks import kernel_bench
from saguaro.plugins.branch_draft import triton_kernel as branch_triton
from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.plugins.fused_verify import triton_kernel as verify_triton
from saguaro.plugins.fused_verify.reference import fused_verify

SMALL = ["--vocab", "300", "-k", "1,3", "--calls", "2", "--repeats", "1", "--device", "cpu"]


def test_without_a_gpu_the_reference_alone_is_timed_for_every_op_and_k(tmp_path):
    out = tmp_path / "kernels.json"
    run = subprocess.run([sys.executable, "scripts/bench_kernels.py", *SMALL, "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["op"], row["draft_tokens"]) for row in rows] == [
        (op, k) for k in (1, 3) for op in ("fused_verify greedy", "fused_verify sampled", "plan_branches")]
    assert all(row["reference_us"] > 0 and row["kernel_us"] is None for row in rows)
    assert "| plan_branches | 3 |" in run.stdout and "(no GPU)" in run.stdout


def test_bad_arguments_are_refused_naming_the_flag():
    with pytest.raises(SystemExit):
        kernel_bench.parse_args(["-k", "1,x"])
    with pytest.raises(SystemExit):
        kernel_bench.parse_args(["-k", "0"])


def test_the_kernels_under_the_interpreter_give_the_references_outcomes():
    # the rows' check compares the kernel's outcome with the reference's, plans included
    args = kernel_bench.parse_args(SMALL)
    generator = torch.Generator().manual_seed(1)
    logits, drafts, q, uniforms = kernel_bench.verify_round(generator, 3, 300, "cpu")
    for sampling in (kernel_bench.GREEDY, kernel_bench.SAMPLED):
        row = kernel_bench.timed_row("verify", 3, lambda: fused_verify(logits, drafts, q, uniforms, **sampling),
                                     lambda: verify_triton.fused_verify(logits, drafts, q, uniforms, **sampling),
                                     args)
        assert row.same_outcome is True and row.kernel_us > 0
    fanout = torch.full((4,), 2)
    row = kernel_bench.timed_row("plan", 3, lambda: plan_branches(logits, drafts, fanout, 9),
                                 lambda: branch_triton.plan_branches(logits, drafts, fanout, 9), args)
    assert row.same_outcome is True


def test_a_kernel_that_differs_is_reported_and_fails_the_run(monkeypatch, capsys):
    def other_plan(scores, drafts, fanout, context_length):
        return plan_branches(scores, drafts, fanout, context_length + 1)  # every position shifted
    monkeypatch.setattr(kernel_bench, "kernel_call", lambda op, call_with, device:
                        (lambda: call_with(other_plan)) if op == "plan_branches" else None)
    assert kernel_bench.main(SMALL) == 1
    captured = capsys.readouterr()
    assert "| plan_branches | 1 |" in captured.out and "| NO |" in captured.out
    assert "plan_branches K=1, plan_branches K=3" in captured.err
