"""Every form of the runtime's fused verification against an oracle that shares none of
its code: the oracle's own float64 softmax, top-k and top-p filters, acceptance rule,
residual and inverse-CDF draw, fed its own uniforms (numpy's generator, not the keyed
streams), on drafts close to the target, the regime of every good draft:

- q is p perturbed by a relative 0.1-5% on some tokens and equal to p on the others, so
  the residual max(p - q, 0) is small but not empty, and empty where q == p exactly;
- half the rounds force a rejection (a draft token where q > p, an acceptance uniform
  above p / q), so the bonus is drawn from that small residual.

The outcome `(accepted, bonus)` must be exactly the oracle's. The runtime computes in
float32 and the oracle in float64, so a round whose decision lies within float32's
rounding of a threshold (1e-5 relative, 2e-6 absolute in a cdf) is left out as
undecidable (a few in a hundred); every other round is compared exactly.
"""
import numpy as np
import pytest
import torch
from test_plugin_onnx import run_verify, session

from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify import triton_kernel
from saguaro.plugins.fused_verify.reference import fused_verify

VOCAB = 24
MARGIN = 1e-5     # relative distance to a decision threshold below which float32 may decide otherwise
NOISE = 2e-6      # absolute: float32 rounding of a vocabulary's probabilities, summed in a cdf
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.9), (0.8, 12, 0.85)]


class Undecidable(Exception):
    """A decision within MARGIN of its threshold: float32 and float64 may part there."""


# --- the oracle: float64, written from the rule's statement ------------------------------

def oracle_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < len(x):
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    e = np.exp(x - x.max())
    p = e / e.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.concatenate(([0.0], np.cumsum(p[order])[:-1]))
        if np.any(np.abs(before - top_p) < MARGIN):
            raise Undecidable("top-p cut")
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def oracle_draw(weights: np.ndarray, u: float) -> int:
    """The first index whose cumulative weight exceeds u * total."""
    cdf = np.cumsum(weights)
    threshold = u * cdf[-1]
    if np.min(np.abs(cdf - threshold)) < MARGIN * cdf[-1] + NOISE:
        raise Undecidable("draw on a cdf step")
    return int(np.searchsorted(cdf, threshold, side="right"))


def oracle_verify(logits, drafts, q, uniforms, temperature, top_k, top_p) -> tuple[int, int]:
    """Leviathan et al.: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the
    first rejection the bonus comes from norm(max(p_j - q_j, 0)), or p_j where that is
    empty; after K acceptances, from p_{K+1}."""
    k = len(drafts)
    for j in range(k + 1):
        p = oracle_probs(logits[j], temperature, top_k, top_p)
        if j == k:
            return k, oracle_draw(p, uniforms[k])
        target, draft = p[drafts[j]], q[j][drafts[j]] * uniforms[j]
        if abs(target - draft) < MARGIN * max(target, draft):
            raise Undecidable("acceptance test")
        if draft < target:
            continue
        residual = np.maximum(p - q[j], 0.0)
        mass = residual.sum()
        if 0 < mass < 50 * NOISE:
            raise Undecidable("residual all but empty")
        return j, oracle_draw(residual if mass > 0 else p, uniforms[k])
    raise AssertionError("unreachable")


# --- rounds with drafts close to the target --------------------------------------------

def close_to(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """p perturbed by a relative 0.1-5% on about half the tokens, exactly p on the rest
    (renormalised over the perturbed ones only), in float32 as a draft would hand it over."""
    scale = rng.choice([1e-3, 1e-2, 5e-2])
    moved = rng.random(len(p)) < 0.5
    q = np.where(moved, p * (1 + scale * rng.standard_normal(len(p))), p).clip(min=0)
    q[moved] *= (1 - p[~moved].sum()) / max(q[moved].sum(), 1e-30)
    return q.astype(np.float32).astype(np.float64)


def close_round(rng: np.random.Generator, settings):
    temperature, top_k, top_p = settings
    k = int(rng.integers(1, 5))
    logits = (rng.standard_normal((k + 1, VOCAB)) * 2).astype(np.float32)
    p = [oracle_probs(row, temperature, top_k, top_p) for row in logits[:k]]
    q = np.stack([close_to(row, rng) if rng.random() < 0.8 else row.astype(np.float32).astype(np.float64)
                  for row in p])
    uniforms = rng.random(k + 1)
    drafts = np.array([oracle_draw(row, u) for row, u in zip(q, rng.random(k))])
    if rng.random() < 0.5:  # force a rejection at a random depth, where q > p
        j = int(rng.integers(0, k))
        above = np.flatnonzero(q[j] > p[j] * (1 + 1e-3))
        if len(above):
            drafts[j] = rng.choice(above)
            ratio = p[j][drafts[j]] / q[j][drafts[j]]
            uniforms[j] = ratio + (1 - ratio) * rng.uniform(0.01, 0.99)
            uniforms[:j] = 0.0  # the depths before it accept (u * q = 0 < p unless p = 0)
    uniforms = uniforms.astype(np.float32).astype(np.float64)
    return logits, drafts, q, uniforms


def decided_rounds(count: int, seed: int):
    """`count` rounds the oracle decides, each with its outcome; asserts few were undecidable."""
    rng, rounds, undecidable = np.random.default_rng(seed), [], 0
    while len(rounds) < count:
        settings = SETTINGS[len(rounds) % len(SETTINGS)]
        try:
            logits, drafts, q, uniforms = close_round(rng, settings)
            rounds.append(((logits, drafts, q, uniforms, *settings),
                           oracle_verify(logits, drafts, q, uniforms, *settings)))
        except Undecidable:
            undecidable += 1
    assert undecidable < 0.05 * count + 5, f"{undecidable} undecidable rounds for {count} decided"
    return rounds


def as_tensors(logits, drafts, q, uniforms, temperature, top_k, top_p):
    return (torch.from_numpy(logits), torch.from_numpy(drafts).to(torch.int64), torch.from_numpy(q).float(),
            torch.from_numpy(uniforms).float(), temperature, top_k, top_p)


def the_rounds_exercise_small_residuals(rounds) -> None:
    """The rounds this test stands on: rejections whose residual holds under 5% of the mass."""
    small = 0
    for (logits, drafts, q, uniforms, *settings), (accepted, _) in rounds:
        if accepted < len(drafts):
            p = oracle_probs(logits[accepted], *settings)
            small += 0 < np.maximum(p - q[accepted], 0).sum() < 0.05
    assert small >= len(rounds) // 5, f"only {small} rejections with a small residual"


def reference_form(*args):
    return tuple(int(x) for x in fused_verify(*args))


@pytest.mark.parametrize("form, count", [("reference", 1000), ("onnx", 1500), ("triton", 30)])
def test_every_verification_form_decides_each_close_round_as_the_oracle(form, count):
    rounds = decided_rounds(count, seed={"reference": 1, "onnx": 2, "triton": 3}[form])
    the_rounds_exercise_small_residuals(rounds)
    if form == "onnx":
        onnx_session = session(verify_onnx.standalone_model())
        verify = lambda *args: run_verify(onnx_session, *args)  # noqa: E731
    elif form == "triton":
        verify = lambda *args: tuple(int(x) for x in triton_kernel.fused_verify(*args))  # noqa: E731
    else:
        verify = reference_form
    wrong = [(index, expected, verify(*as_tensors(*case))) for index, (case, expected) in enumerate(rounds)]
    wrong = [row for row in wrong if row[1] != row[2]]
    assert not wrong, f"{len(wrong)} of {count} rounds differ from the oracle; (round, oracle, {form}): {wrong[:3]}"


def test_the_oracle_tells_a_residual_from_p():
    """The oracle's own check: where q is close to p, drawing the bonus from p instead of
    the residual changes the outcome of many of these rounds."""
    rounds = decided_rounds(400, seed=4)
    differs = 0
    for (logits, drafts, q, uniforms, *settings), (accepted, bonus) in rounds:
        if accepted < len(drafts):
            p = oracle_probs(logits[accepted], *settings)
            try:
                differs += oracle_draw(p, uniforms[len(drafts)]) != bonus
            except Undecidable:
                pass
    assert differs > 40
