"""The plugins' ONNX local functions, run in ONNX Runtime, against the torch reference ops."""
import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from verify_rounds import random_round

from saguaro.plugins.branch_draft import onnx_function as branch_onnx
from saguaro.plugins.branch_draft.reference import commit_indices, gather_kv, plan_branches
from saguaro.plugins.branch_draft.signature import SIGNATURE as branch_signature
from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.plugins.signature import onnx_type

OPSETS = (17, 21)  # 18 moved ReduceMin/Max axes to an input; 21 is recent
DRAFT_LENGTHS = (0, 1, 3, 5)
SAMPLING = [  # (temperature, top_k, top_p); top_k >= V and top_p = 1 are the "off" values
    (1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 5, 1.0), (1.4, 0, 0.8),
    (0.8, 8, 0.9), (1.0, 3, 0.5), (2.0, 500, 0.95),
]


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # shared 2-core machines
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=OPSETS)
def verify_session(request):
    return session(verify_onnx.standalone_model(request.param))


@pytest.fixture(scope="module", params=OPSETS)
def branch_session(request):
    return session(branch_onnx.standalone_model(request.param))


@pytest.fixture(scope="module")
def gather_session():
    return session(branch_onnx.gather_standalone_model())


def run_verify(sess, logits, drafts, q, uniforms, temperature, top_k=0, top_p=1.0):
    feeds = {"target_logits": logits.numpy(), "draft_tokens": drafts.numpy(), "draft_probs": q.numpy(),
             "uniforms": uniforms.numpy(), "temperature": np.array(temperature, np.float32),
             "top_k": np.array(top_k, np.int64), "top_p": np.array(top_p, np.float32)}
    accepted, bonus = sess.run(None, feeds)
    assert accepted.shape == () and bonus.shape == () and accepted.dtype == np.int64
    return int(accepted), int(bonus)


def reference_outcome(logits, drafts, q, uniforms, temperature, top_k=0, top_p=1.0):
    accepted, bonus = fused_verify(logits, drafts, q, uniforms, temperature, top_k, top_p)
    return int(accepted), int(bonus)


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
def test_greedy_matches_reference(verify_session, k):
    generator = torch.Generator().manual_seed(k)
    for case in range(12):
        logits, drafts, q, uniforms = random_round(generator, k, 41, drafts_are_argmax=case % 2 == 0)
        if case % 4 == 0 and k:  # argmax drafts with one mismatch at a random position
            drafts[case % k] = (drafts[case % k] + 1) % 41
        expected = reference_outcome(logits, drafts, q, uniforms, 0.0)
        assert run_verify(verify_session, logits, drafts, q, uniforms, 0.0) == expected


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
def test_sampling_matches_reference(verify_session, k):
    generator = torch.Generator().manual_seed(100 + k)
    outcomes = set()
    for case in range(3 * len(SAMPLING)):
        params = SAMPLING[case % len(SAMPLING)]
        logits, drafts, q, uniforms = random_round(generator, k, 41, drafts_are_argmax=case % 3 == 0)
        expected = reference_outcome(logits, drafts, q, uniforms, *params)
        assert run_verify(verify_session, logits, drafts, q, uniforms, *params) == expected, (case, params)
        outcomes.add(expected)
    assert len(outcomes) > 3  # the cases exercise varied outcomes, not one constant answer


@pytest.mark.parametrize("widths,vocab", [((4, 16), 37), (verify_onnx.NUCLEUS_WIDTHS, 600)])
def test_top_p_from_the_head_of_each_row_matches_reference(monkeypatch, widths, vocab):
    """Rows sharp enough for the first width, for the next, and flat enough for a full sort."""
    monkeypatch.setattr(verify_onnx, "NUCLEUS_WIDTHS", widths)
    sess = session(verify_onnx.standalone_model(17))
    generator = torch.Generator().manual_seed(vocab)
    outcomes = set()
    for case, (sharpness, top_p) in enumerate([(8.0, 0.5), (8.0, 0.95), (3.0, 0.9), (0.05, 0.9), (1.0, 0.99)] * 4):
        logits, drafts, q, uniforms = random_round(generator, 3, vocab, drafts_are_argmax=case % 2 == 0)
        logits = logits / 3 * sharpness
        expected = reference_outcome(logits, drafts, q, uniforms, 1.0, 0, top_p)
        assert run_verify(sess, logits, drafts, q, uniforms, 1.0, 0, top_p) == expected, (case, sharpness, top_p)
        outcomes.add(expected)
    assert len(outcomes) > 3


def test_greedy_explicit_outcomes(verify_session):
    logits = torch.randn(4, 17, generator=torch.Generator().manual_seed(7))
    argmax = logits.argmax(-1)
    q, uniforms = torch.zeros(3, 17), torch.rand(4)
    assert run_verify(verify_session, logits, argmax[:3], q, uniforms, 0.0) == (3, int(argmax[3]))
    wrong = argmax[:3].clone()
    wrong[1] = (wrong[1] + 1) % 17
    assert run_verify(verify_session, logits, wrong, q, uniforms, 0.0) == (1, int(argmax[1]))


def test_sampling_rejects_a_draft_outside_top_k(verify_session):
    """top_k=1 leaves p one-hot; a draft elsewhere has p = 0 and must be rejected."""
    logits = torch.randn(3, 19, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1)
    drafts = torch.stack([best[0], (best[1] + 1) % 19])
    q = torch.full((2, 19), 1 / 19)
    accepted, bonus = run_verify(verify_session, logits, drafts, q, torch.zeros(3), 1.0, 1, 1.0)
    assert (accepted, bonus) == (1, int(best[1]))


def test_empty_residual_falls_back_to_target(verify_session):
    """p == q (both one-hot) and a draft outside their support: the residual is all zero,
    so the bonus comes from p, not from an empty row (which would give V - 1)."""
    vocab, hot = 13, 4
    logits = torch.zeros(2, vocab)
    logits[:, hot] = 10.0
    q = torch.zeros(1, vocab)
    q[0, hot] = 1.0
    drafts = torch.tensor([7])
    expected = reference_outcome(logits, drafts, q, torch.tensor([0.5, 0.5]), 1.0, 1, 1.0)
    assert expected == (0, hot)
    assert run_verify(verify_session, logits, drafts, q, torch.tensor([0.5, 0.5]), 1.0, 1, 1.0) == expected


def test_uniforms_steer_the_bonus(verify_session):
    """The bonus is drawn from the given uniform: different uniforms, different tokens."""
    logits = torch.zeros(1, 10)
    empty_q, empty_drafts = torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64)
    bonuses = {run_verify(verify_session, logits, empty_drafts, empty_q, torch.tensor([u]), 1.0)[1]
               for u in (0.05, 0.35, 0.65, 0.95)}
    assert bonuses == {0, 3, 6, 9}


def test_the_bonus_is_the_first_token_past_the_threshold_and_the_last_when_none_is(verify_session):
    """The CDF's tokens at or below u * total are a prefix (probabilities are >= 0), so
    the bonus is the first token past it, zero-probability tokens never chosen; where u *
    total rounds up to the total (here u = 1, outside the uniforms' [0, 1)), none is past
    it and the bonus is the last token, as the reference's clamp gives it."""
    logits = torch.tensor([[0.0, -float("inf"), 0.0, -float("inf"), 0.0, -float("inf")]])
    empty_q, empty_drafts = torch.zeros(0, 6), torch.zeros(0, dtype=torch.int64)
    us = (0.0, 0.3, 0.34, 0.5, 0.66, 0.7, 0.99, float(np.nextafter(np.float32(1), np.float32(0))), 1.0)
    # the whole row's CDF, and a filtered row's (top-k, top-p): the CDF of its nonzero tokens
    for u, (top_k, top_p) in itertools.product(us, [(0, 1.0), (3, 1.0), (0, 0.999)]):
        uniforms = torch.tensor([u], dtype=torch.float32)
        expected = reference_outcome(logits, empty_drafts, empty_q, uniforms, 1.0, top_k, top_p)
        assert run_verify(verify_session, logits, empty_drafts, empty_q, uniforms, 1.0, top_k, top_p) == expected
        assert expected[1] == (5 if u == 1.0 else 0 if u < 1 / 3 else 2 if u < 2 / 3 else 4)


def run_branches(sess, scores, drafts, fanout, context_length):
    feeds = {"scores": scores.numpy(), "draft_tokens": drafts.numpy(), "fanout": fanout.numpy(),
             "context_length": np.array(context_length, np.int64)}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def fanouts_for(k):
    return [[0] * (k + 1), [1] * (k + 1), list(range(k + 1)), [3] * (k + 1), [0] * k + [2], [2] + [0] * k]


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
def test_branch_plan_matches_reference(branch_session, k):
    generator = torch.Generator().manual_seed(200 + k)
    for fanout in fanouts_for(k):
        scores = torch.randn(k + 1, 29, generator=generator)
        drafts = scores[:k].argmax(-1) if fanout[0] % 2 else torch.randint(0, 29, (k,), generator=generator)
        fanout = torch.tensor(fanout)
        expected = plan_branches(scores, drafts, fanout, 11)
        got = run_branches(branch_session, scores, drafts, fanout, 11)
        for name in branch_onnx.PLAN_OUTPUTS:
            want = getattr(expected, name).numpy()
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, (name, fanout)
            assert np.array_equal(got[name], want), (name, fanout)


@pytest.fixture(scope="module")
def branch_node_session():
    """The BranchDraft node alone with all eight of its outputs as graph outputs: exactly
    what the TensorRT plugin gives (int32 mask and extents)."""
    model = branch_onnx.standalone_model()
    graph = model.graph
    node = next(n for n in graph.node if n.op_type == "BranchDraft")
    del graph.node[:]
    graph.node.append(node)
    del graph.output[:]
    graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx_type(spec.dtype), [None] * spec.rank)
                        for name, spec in zip(node.output, branch_signature.outputs))
    return session(model)


@pytest.mark.parametrize("k, fanout", [(3, [2, 0, 1, 3]), (0, [2]), (2, [0, 0, 0])])
def test_branch_node_outputs_are_the_signature(branch_node_session, k, fanout):
    """int32 mask equal to the reference's bool one; extents B, K*B, K + K*B as 0-d int32."""
    scores = torch.randn(k + 1, 17, generator=torch.Generator().manual_seed(k))
    drafts, fanout = scores[:k].argmax(-1), torch.tensor(fanout)
    expected = plan_branches(scores, drafts, fanout, 4)
    outputs = branch_node_session.run(None, {"scores": scores.numpy(), "draft_tokens": drafts.numpy(),
                                             "fanout": fanout.numpy(), "context_length": np.array(4, np.int64)})
    got = dict(zip(branch_signature.output_names, outputs))
    for spec in branch_signature.outputs:
        assert got[spec.name].dtype == np.dtype(spec.dtype) and got[spec.name].ndim == spec.rank, spec.name
    assert np.array_equal(got["window_mask"], expected.window_mask.numpy().astype(np.int32))
    b = int(fanout.sum())
    assert [int(got[name]) for name in ("branches", "mask_rows", "mask_cols")] == [b, k * b, k + k * b]


def test_branch_keys_skip_the_draft_token(branch_session):
    scores = torch.randn(3, 12, generator=torch.Generator().manual_seed(5))
    drafts = scores[:2].argmax(-1)  # the best token at depths 0 and 1 is the draft's own
    got = run_branches(branch_session, scores, drafts, torch.tensor([2, 2, 2]), 0)
    assert got["depth"].tolist() == [0, 0, 1, 1, 2, 2] and got["rank"].tolist() == [0, 1] * 3
    for j in range(2):
        assert int(drafts[j]) not in got["token"][got["depth"] == j]
    assert got["token"][4] == int(scores[2].argmax())


def test_branch_positions_follow_context_length(branch_session):
    scores, drafts, fanout = torch.randn(3, 9), torch.tensor([1, 2]), torch.tensor([1, 1, 1])
    near = run_branches(branch_session, scores, drafts, fanout, 5)["positions"]
    far = run_branches(branch_session, scores, drafts, fanout, 9)["positions"]
    assert np.array_equal(far - near, np.full((2, 3), 4))
    assert near.tolist() == [[5, 6, 7], [6, 7, 8]]


@pytest.mark.parametrize("start,branches,branch", [(6, 3, 1), (0, 2, 0), (9, 1, 0), (4, 4, 3)])
def test_gather_kv_matches_reference(gather_session, start, branches, branch):
    num_steps = 3
    capacity = start + 2 + num_steps * branches  # prefix, K=2 drafts, the branch entries
    cache = torch.randn(2, 1, 3, capacity, 4, generator=torch.Generator().manual_seed(start))
    sources = commit_indices(start, 2, branches, branch, num_steps)
    expected = cache.clone()
    gather_kv(expected, start, sources)
    got = gather_session.run(None, {"cache": cache.numpy(), "start": np.array(start, np.int64),
                                    "source_indices": sources.numpy()})[0]
    assert got.shape == (2, 1, 3, start + num_steps, 4)
    assert np.array_equal(got, expected[..., :start + num_steps, :].numpy())
    assert np.array_equal(got[..., :start, :], cache[..., :start, :].numpy())
