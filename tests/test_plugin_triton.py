"""The plugins' OpenAI Triton kernels against the torch reference ops.

Run on CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is first
imported: `triton.jit` picks interpreted or compiled when it decorates, and triton's own
library functions are decorated at that first import).
A separate test compiles the same kernels for an sm_90 GPU (to PTX and cubin, no GPU
needed), since the interpreter accepts some code the compiler rejects.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="OpenAI Triton is not installed (pip install triton)")
import triton.runtime.interpreter  # noqa: E402, F811 (the submodule, after the mode is set)

if not isinstance(triton.language.standard.cumsum, triton.runtime.interpreter.InterpretedFunction):
    # triton's own library (tl.sort, tl.cumsum ...) took its mode when triton was imported
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this file on its own "
                "or set the variable in tests/conftest.py", allow_module_level=True)

from verify_rounds import random_round  # noqa: E402

from saguaro.plugins.branch_draft import triton_kernel as branch_triton  # noqa: E402
from saguaro.plugins.branch_draft.reference import commit_indices, gather_kv, plan_branches  # noqa: E402
from saguaro.plugins.fused_verify import triton_kernel as verify_triton  # noqa: E402
from saguaro.plugins.fused_verify.reference import fused_verify  # noqa: E402

DRAFT_LENGTHS = (0, 1, 3, 5)
# The interpreter runs tl.sort slowly, so the filtered settings use a small vocabulary.
PLAIN_SAMPLING = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 0, 1.0), (1.0, 99, 1.0)]
FILTERED_SAMPLING = [(1.0, 3, 1.0), (1.4, 0, 0.8), (0.8, 5, 0.9), (1.0, 0, 0.4)]


def outcome(op, *args):
    accepted, bonus = op(*args)
    assert accepted.shape == () and accepted.dtype == torch.int64 and bonus.dtype == torch.int64
    return int(accepted), int(bonus)


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
def test_greedy_matches_reference(k):
    generator = torch.Generator().manual_seed(k)
    for case in range(8):
        logits, drafts, q, uniforms = random_round(generator, k, 37, drafts_are_argmax=case % 2 == 0)
        if case % 4 == 0 and k:
            drafts[case % k] = (drafts[case % k] + 1) % 37
        args = (logits, drafts, q, uniforms, 0.0)
        assert outcome(verify_triton.fused_verify, *args) == outcome(fused_verify, *args)


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
@pytest.mark.parametrize("settings,vocab", [(PLAIN_SAMPLING, 37), (FILTERED_SAMPLING, 13)])
def test_sampling_matches_reference(k, settings, vocab):
    generator = torch.Generator().manual_seed(300 + k + vocab)
    for case in range(len(settings)):
        logits, drafts, q, uniforms = random_round(generator, k, vocab, drafts_are_argmax=case % 3 == 0)
        args = (logits, drafts, q, uniforms, *settings[case % len(settings)])
        assert outcome(verify_triton.fused_verify, *args) == outcome(fused_verify, *args), case


@pytest.mark.parametrize("k", (0, 3))
def test_rows_walked_in_tiles_match_reference(k, monkeypatch):
    """Rows longer than a program's tile: every pass carries its running value across tiles
    (a last tile only partly in the vocabulary included)."""
    monkeypatch.setattr(verify_triton, "MAX_BLOCK_V", 8)
    generator = torch.Generator().manual_seed(500 + k)
    for case, settings in enumerate([(0.0, 0, 1.0)] * 2 + PLAIN_SAMPLING + FILTERED_SAMPLING):
        logits, drafts, q, uniforms = random_round(generator, k, 37, drafts_are_argmax=case % 3 == 0)
        args = (logits, drafts, q, uniforms, *settings)
        assert outcome(verify_triton.fused_verify, *args) == outcome(fused_verify, *args), settings


def test_greedy_across_tiles_takes_the_first_maximum(monkeypatch):
    monkeypatch.setattr(verify_triton, "MAX_BLOCK_V", 8)
    logits = torch.zeros(1, 30)
    logits[0, [11, 19, 27]] = 5.0  # the maximum three times, in three tiles
    no_drafts = torch.zeros(0, dtype=torch.int64)
    assert outcome(verify_triton.fused_verify, logits, no_drafts, None, torch.rand(1), 0.0) == (0, 11)


def test_greedy_without_draft_probs():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    drafts = logits[:2].argmax(-1)
    assert outcome(verify_triton.fused_verify, logits, drafts, None, torch.rand(3), 0.0) == (2, int(logits[2].argmax()))


def test_top_k_and_empty_residual():
    """top_k=1 makes p one-hot: a draft outside it is rejected, and where q == p the empty
    residual falls back to p (the bonus is the hot token, not V - 1)."""
    logits = torch.zeros(2, 13)
    logits[:, 4] = 10.0
    q = torch.zeros(1, 13)
    q[0, 4] = 1.0
    args = (logits, torch.tensor([7]), q, torch.tensor([0.5, 0.5]), 1.0, 1, 1.0)
    assert outcome(verify_triton.fused_verify, *args) == outcome(fused_verify, *args) == (0, 4)


def test_uniforms_steer_the_bonus():
    logits, q, drafts = torch.zeros(1, 10), torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64)
    bonuses = {outcome(verify_triton.fused_verify, logits, drafts, q, torch.tensor([u]), 1.0)[1]
               for u in (0.05, 0.35, 0.65, 0.95)}
    assert bonuses == {0, 3, 6, 9}


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
def test_branch_plan_matches_reference(k):
    generator = torch.Generator().manual_seed(400 + k)
    fanouts = [[0] * (k + 1), [1] * (k + 1), list(range(k + 1)), [3] * (k + 1), [0] * k + [2]]
    for fanout in fanouts:
        scores = torch.randn(k + 1, 29, generator=generator)
        drafts = scores[:k].argmax(-1) if fanout[-1] % 2 else torch.randint(0, 29, (k,), generator=generator)
        fanout = torch.tensor(fanout)
        expected = plan_branches(scores, drafts, fanout, 13)
        got = branch_triton.plan_branches(scores, drafts, fanout, 13)
        for name in ("depth", "token", "rank", "positions", "window_mask"):
            want, have = getattr(expected, name), getattr(got, name)
            assert have.dtype == want.dtype and have.shape == want.shape, (name, fanout)
            assert torch.equal(have, want), (name, fanout)


@pytest.mark.parametrize("k", (0, 3))
def test_branch_plan_over_rows_walked_in_tiles_matches_reference(k, monkeypatch):
    monkeypatch.setattr(branch_triton, "MAX_BLOCK_V", 8)
    generator = torch.Generator().manual_seed(600 + k)
    for fanout in ([3] * (k + 1), list(range(k + 1)), [0] * k + [5]):
        scores = torch.randn(k + 1, 29, generator=generator)
        drafts = scores[:k].argmax(-1)
        fanout = torch.tensor(fanout)
        expected, got = plan_branches(scores, drafts, fanout, 13), branch_triton.plan_branches(scores, drafts, fanout, 13)
        for name in ("depth", "token", "rank"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (name, fanout)


def test_branch_keys_with_tied_scores_come_in_index_order(monkeypatch):
    monkeypatch.setattr(branch_triton, "MAX_BLOCK_V", 8)
    scores = torch.zeros(2, 30)
    scores[0, [25, 3, 17, 9]] = 2.0  # four tied best tokens in three tiles, 9 the next draft
    _, token, rank = branch_triton.candidate_keys(scores, torch.tensor([9]), torch.tensor([4, 0]))
    assert token.tolist() == [3, 17, 25, 0] and rank.tolist() == [0, 1, 2, 3]


def test_branch_keys_skip_the_draft_token():
    scores = torch.randn(3, 12, generator=torch.Generator().manual_seed(5))
    drafts = scores[:2].argmax(-1)
    depth, token, rank = branch_triton.candidate_keys(scores, drafts, torch.tensor([2, 2, 2]))
    assert depth.tolist() == [0, 0, 1, 1, 2, 2] and rank.tolist() == [0, 1] * 3
    for j in range(2):
        assert int(drafts[j]) not in token[depth == j].tolist()


@pytest.mark.parametrize("start,branches,branch", [(6, 3, 1), (0, 2, 0), (4, 4, 3), (5, 1, 0)])
def test_gather_kv_matches_reference(start, branches, branch):
    """In place, including overlapping moves where a destination is another entry's source."""
    num_steps = 3
    capacity = start + 2 + num_steps * branches + 2
    cache = torch.randn(2, 3, capacity, 5, generator=torch.Generator().manual_seed(start))
    sources = commit_indices(start, 2, branches, branch, num_steps)
    expected, got = cache.clone(), cache.clone()
    gather_kv(expected, start, sources)
    branch_triton.gather_kv(got, start, sources)
    assert torch.equal(got, expected)
    assert not torch.equal(got, cache)


def test_gather_kv_reads_before_it_writes():
    cache = torch.arange(12.0).view(1, 12, 1).repeat(2, 1, 3)
    branch_triton.gather_kv(cache, 3, torch.tensor([4, 6, 8, 10]))  # entry 4: a source and a destination
    assert cache[0, :, 0].tolist() == [0, 1, 2, 4, 6, 8, 10, 7, 8, 9, 10, 11]


COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from saguaro.plugins.branch_draft import triton_kernel as bd
    from saguaro.plugins.fused_verify import triton_kernel as fv

    def sig(**kinds):
        return kinds

    kernels = [
        (fv.row_outcome_kernel, sig(logits_ptr="*fp16", logits_row_stride="i32", draft_tokens_ptr="*i64",
            draft_probs_ptr="*fp32", draft_probs_row_stride="i32", uniforms_ptr="*fp32",
            temperature_ptr="*fp32", top_k_ptr="*i64", top_p_ptr="*fp32", row_accepted_ptr="*i32",
            row_bonus_ptr="*i64", num_drafts="i32", vocab_size="i32", BLOCK_V="constexpr"),
            {"BLOCK_V": fv.MAX_BLOCK_V}),  # the tile any large vocabulary launches
        (fv.round_outcome_kernel, sig(row_accepted_ptr="*i32", row_bonus_ptr="*i64", accepted_ptr="*i64",
            bonus_ptr="*i64", num_drafts="i32", BLOCK_K="constexpr"), {"BLOCK_K": 8}),
        (bd.candidate_keys_kernel, sig(scores_ptr="*fp32", scores_row_stride="i32", draft_tokens_ptr="*i64",
            fanout_ptr="*i64", depth_ptr="*i64", token_ptr="*i64", rank_ptr="*i64", num_drafts="i32",
            vocab_size="i32", BLOCK_V="constexpr", BLOCK_ROWS="constexpr"),
            {"BLOCK_V": bd.MAX_BLOCK_V, "BLOCK_ROWS": 8}),
        (bd.tree_layout_kernel, sig(depth_ptr="*i64", positions_ptr="*i64", mask_ptr="*i1",
            context_length_ptr="*i64", num_drafts="i32", num_branches="i32", BLOCK_COLS="constexpr"),
            {"BLOCK_COLS": 128}),
        # the TensorRT plugin's mask is int32 (plugins cannot give bool)
        (bd.tree_layout_kernel, sig(depth_ptr="*i64", positions_ptr="*i64", mask_ptr="*i32",
            context_length_ptr="*i64", num_drafts="i32", num_branches="i32", BLOCK_COLS="constexpr"),
            {"BLOCK_COLS": 128}),
        (bd.gather_kv_kernel, sig(buffer_ptr="*fp16", source_ptr="*i64", start="i32", count="i32",
            capacity="i32", head_dim="i32", BLOCK_N="constexpr", BLOCK_D="constexpr"),
            {"BLOCK_N": 8, "BLOCK_D": 64}),
    ]
    for fn, signature, constexprs in kernels:
        source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn
""")


@pytest.mark.slow
def test_kernels_compile_for_a_gpu(tmp_path):
    """Lower every kernel to an sm_90 cubin (no GPU needed), outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
