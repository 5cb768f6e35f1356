"""Mutation check: plant realistic bugs in the sampling and exactness path, one at a time,
and show that the test suite fails on each.

    .venv/bin/python tests/mutation_check.py            # every mutation, a table at the end
    .venv/bin/python tests/mutation_check.py --only swapped-q-p

Each mutation is a text replacement in one source file of a copy of the package (the
checkout itself is never touched); pytest runs the exactness and losslessness tests
against the copy, which comes first on PYTHONPATH. A mutation that no test catches is
a hole in the suite: the script exits 1. Slow (a few minutes a mutation), so it is not
part of the default run; `pytest -m mutation` runs it as a test.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("runtime", "plugins", "build")
# The exactness and losslessness tests, the quick ones first (pytest stops at the first failure)
SUITE = ["tests/test_plugins_reference.py", "tests/test_verification_oracle.py", "tests/test_plugin_onnx.py",
         "tests/test_tensorrt_engine.py", "tests/test_row_independence.py", "tests/test_verified_q.py",
         "tests/test_lossless_sampling.py", "tests/test_greedy_exactness.py", "tests/test_speculation_cache.py",
         "tests/test_modes_and_inputs.py", "tests/test_batching.py"]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str  # relative to the repository
    old: str
    new: str


VERIFY = "plugins/saguaro/plugins/fused_verify/reference.py"
VERIFIER = "runtime/saguaro/runtime/decoding/verifier.py"
MUTATIONS = [
    Mutation("one-acceptance-uniform", "one acceptance uniform reused for every depth (uniforms[:1])",
             VERIFY, "accepted_prefix_length(uniforms[:k] * q_draft < p_draft)",
             "accepted_prefix_length(uniforms[:1] * q_draft < p_draft)"),
    Mutation("round-relative-acceptance-keys", "acceptance uniforms keyed by position within the round",
             "runtime/saguaro/runtime/core/sampling.py", "keyed_uniforms(params.seed, ACCEPT_STREAM, draft_positions)",
             "keyed_uniforms(params.seed, ACCEPT_STREAM, draft_positions - first_new)"),
    Mutation("count-passing-tests", "accepted counted as the passing tests, not the leading run",
             VERIFY, "accepted_prefix_length(uniforms[:k] * q_draft < p_draft)",
             "(uniforms[:k] * q_draft < p_draft).sum()"),
    Mutation("branch-draft-uniform-position", "a branch's draft uniform keyed at the fed token's position",
             "runtime/saguaro/runtime/decoding/speculator.py",
             "pick_tokens(rows.logits, self.sampling, self.saguaro, plan.positions[step] + 1)",
             "pick_tokens(rows.logits, self.sampling, self.saguaro, plan.positions[step])"),
    Mutation("swapped-q-p", "q and p swapped in the acceptance test",
             VERIFY, "uniforms[:k] * q_draft < p_draft", "uniforms[:k] * p_draft < q_draft"),
    Mutation("bonus-from-p", "the bonus after a rejection sampled from p, not the residual",
             VERIFY, "sample_from(residual_rows(p, draft_probs)[accepted], uniforms[k])",
             "sample_from(p[accepted], uniforms[k])"),
    Mutation("one-stream", "one random stream for draft tokens and acceptance tests",
             "runtime/saguaro/runtime/core/sampling.py", "DRAFT_STREAM, ACCEPT_STREAM, BONUS_STREAM = 1, 2, 3",
             "DRAFT_STREAM, ACCEPT_STREAM, BONUS_STREAM = 1, 1, 3"),
    Mutation("verify-without-last-token", "verify feeds d_1 where the last committed token belongs "
             "(logits shifted by one)", VERIFIER, "tokens = torch.tensor([ids[-1], *drafts.tolist()])",
             "tokens = torch.tensor([*(drafts[:1].tolist() or [ids[-1]]), *drafts.tolist()])"),
    Mutation("off-by-one-truncate", "the target's cache rolled back one entry too far",
             VERIFIER, "self.cache.truncate(len(ids) + outcome.accepted)",
             "self.cache.truncate(len(ids) + outcome.accepted - 1)"),
    # drafts close to the target leave a small residual: falling back to p there is wrong
    Mutation("residual-empty-below-5%", "the residual taken for empty below 5% of the mass (a rejection's "
             "bonus then drawn from p when p is close to q)",
             VERIFY, "empty = residual.sum(-1, keepdim=True) <= 0", "empty = residual.sum(-1, keepdim=True) <= 0.05"),
    Mutation("bfloat16-q-in-verification", "the q used in verification rounded to bfloat16 (the draft "
             "sampled from the exact q)", VERIFIER,
             "probs = None if draft.probs is None else draft.probs[:num_tokens]",
             "probs = None if draft.probs is None else draft.probs[:num_tokens].bfloat16().float()"),
    Mutation("tensorrt-verify-unfiltered", "the TensorRT engine's verification given top_k=0, top_p=1 "
             "(the draft filtered q)", "runtime/saguaro/runtime/engines/tensorrt_engine.py",
             "top_k=(sampling.top_k, torch.int64), top_p=(sampling.top_p, torch.float32))",
             "top_k=(0, torch.int64), top_p=(1.0, torch.float32))"),
    Mutation("one-token-attention-unpadded", "a one-token sequence left to GroupQueryAttention's "
             "matrix-vector kernel (its logits then differ from the same token's in a verify)",
             "build/saguaro/compiler/fused_export.py",
             'extra = g.node("Cast", [one_token], ["/gqa/extra"], to=int32)[0]',
             'extra = g.node("Sub", ["query_seqlens", "query_seqlens"], ["/gqa/extra"])[0]'),
]


def mutated_copy(mutation: Mutation, work: Path) -> Path:
    """A copy of the package folders with the mutation applied; fails if it does not apply."""
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(REPO / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    path = work / mutation.file
    source = path.read_text()
    if source.count(mutation.old) != 1:
        raise RuntimeError(f"{mutation.name}: the code to mutate is not found once in {mutation.file}")
    path.write_text(source.replace(mutation.old, mutation.new))
    return work


def run_suite(package_root: Path | None, timeout_s: int) -> tuple[bool, str]:
    """(suite passed, first failing test or ''), with the package copy first on the path."""
    env = dict(os.environ)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(package_root / folder) for folder in PACKAGE_FOLDERS)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not mutation", *SUITE]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    failed = [line.removeprefix("FAILED ").split(" - ")[0] for line in result.stdout.splitlines()
              if line.startswith("FAILED ")]
    return result.returncode == 0, (failed[0] if failed else "")


def check(mutations: list[Mutation], timeout_s: int = 1800) -> list[tuple[Mutation, str, float]]:
    """(mutation, what killed it or '' if nothing did, seconds) for each mutation."""
    rows = []
    for mutation in mutations:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            passed, killer = run_suite(mutated_copy(mutation, Path(work)), timeout_s)
        rows.append((mutation, "" if passed else (killer or "(an error)"), time.perf_counter() - started))
        print(f"{mutation.name:32s} {'KILLED by ' + rows[-1][1] if rows[-1][1] else 'SURVIVED'} "
              f"({rows[-1][2]:.0f} s)", flush=True)
    return rows


def table(rows) -> str:
    lines = ["| planted bug | killed by |", "|---|---|"]
    for mutation, killer, _ in rows:
        lines.append(f"| {mutation.what} | {('`' + killer.split('::', 1)[-1] + '`') if killer else '**survived**'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS])
    args = parser.parse_args(argv)
    passed, killer = run_suite(None, 1800)
    if not passed:
        print(f"the unmutated suite fails ({killer}); fix that first", file=sys.stderr)
        return 2
    rows = check([m for m in MUTATIONS if not args.only or m.name in args.only])
    print(table(rows))
    return 0 if all(killer for _, killer, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
