"""The reference ops: verification rule, sampling math and branch layout."""
import torch

from saguaro.plugins import probs as probs_module
from saguaro.plugins.branch_draft.reference import candidate_keys, commit_indices, gather_kv, plan_branches, tree_mask
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.plugins.probs import logits_to_probs, saguaro_rescale, sample_from

GRID = 100  # uniforms on a midpoint grid: exact frequencies up to 1/GRID


def grid():
    return (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID


def test_greedy_accepts_the_matching_prefix_and_returns_the_next_argmax():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    for drafts, expected in [([2, 5, 1], (3, 3)), ([2, 5, 0], (2, 1)), ([4, 5, 1], (0, 2)), ([2, 0, 1], (1, 5))]:
        accepted, bonus = fused_verify(logits, torch.tensor(drafts), None, torch.zeros(4), 0.0)
        assert (int(accepted), int(bonus)) == expected


def test_greedy_with_no_drafts_is_the_argmax():
    accepted, bonus = fused_verify(torch.tensor([[0.1, 0.9, 0.3]]), torch.empty(0, dtype=torch.int64),
                                   None, torch.zeros(1), 0.0)
    assert (int(accepted), int(bonus)) == (0, 1)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert (logits_to_probs(logits, 1.0, top_k=2) > 0).tolist() == [True, True, False, False, False]
    full = torch.softmax(logits, -1)
    nucleus = logits_to_probs(logits, 1.0, top_p=float(full[0] + full[1]) - 1e-4)
    assert (nucleus > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(nucleus.sum(), torch.tensor(1.0))
    assert torch.allclose(logits_to_probs(logits, 2.0), torch.softmax(logits / 2, -1))


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by a sort of the whole row: what the head-only sort must equal."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(mass_before >= top_p, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def test_top_p_sorts_only_the_head_it_needs_and_equals_a_full_sort(monkeypatch):
    monkeypatch.setattr(probs_module, "NUCLEUS_WIDTHS", (4, 16))
    widths = []
    topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, k, **kw: widths.append(k) or topk(x, k, **kw))
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(3, 37, generator=generator) * 0.1
    ten_likely = noise + torch.cat((torch.full((3, 10), 6.0), torch.zeros(3, 27)), dim=1)
    for logits, top_p, widest in ((noise * 100, 0.5, 4), (ten_likely, 0.95, 16), (noise, 0.9, 37),
                                  (torch.randn(3, 37, generator=generator), 0.8, None)):
        widths.clear()
        filtered = logits_to_probs(logits, 1.0, 0, top_p)
        assert torch.equal(filtered, full_sort_nucleus(torch.softmax(logits, -1), top_p)), (top_p, widths)
        assert widths[0] == 4 and widths == sorted(widths)
        if widest:
            assert widths[-1] == widest, (top_p, widths)


def test_inverse_cdf_sampling_reproduces_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.4], dtype=torch.float64)
    picks = sample_from(probs.expand(GRID, 5), grid())
    frequencies = torch.bincount(picks, minlength=5).double() / GRID
    assert torch.allclose(frequencies, probs, atol=1.0 / GRID)
    assert frequencies[1] == 0


def test_saguaro_rescale_scales_the_top_tokens_and_renormalises():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scaled = saguaro_rescale(probs, top=2, factor=0.5)
    assert torch.allclose(scaled.sum(), torch.tensor(1.0))
    ratio = scaled / probs
    assert torch.allclose(ratio[0], ratio[1]) and torch.allclose(ratio[2], ratio[3])
    assert torch.allclose(ratio[0] / ratio[2], torch.tensor(0.5))


def first_token_distribution(verify, p_logits, q):
    """Exact law of the first emitted token for K=1 with d ~ q, measured on uniform grids:
    P(x) = sum_d q(d) [P(accept | d) 1{x = d} + P(reject | d) P(bonus = x | reject, d)]."""
    vocab = q.shape[-1]
    law = torch.zeros(vocab, dtype=torch.float64)
    for d in range(vocab):
        if q[0, d] == 0:
            continue
        accepts = sum(int(verify(p_logits, torch.tensor([d]), q, torch.tensor([u, 0.5]))[0]) for u in grid())
        p_accept = accepts / GRID
        bonus = torch.zeros(vocab, dtype=torch.float64)
        if p_accept < 1:
            rejecting_u = 0.9999  # u above every acceptance threshold < 1
            for u in grid():
                bonus[int(verify(p_logits, torch.tensor([d]), q, torch.tensor([rejecting_u, float(u)]))[1])] += 1 / GRID
        law[d] += q[0, d] * p_accept
        law += q[0, d] * (1 - p_accept) * bonus
    return law


def sampled_verify(p_logits, drafts, q, uniforms):
    return fused_verify(p_logits, drafts, q, uniforms, temperature=1.0)


def test_leviathan_rule_is_lossless_and_a_biased_rule_is_not():
    torch.manual_seed(0)
    p_logits = torch.randn(2, 5) * 1.5
    q = torch.softmax(torch.randn(1, 5) * 1.5, -1)
    p = torch.softmax(p_logits[0].double(), -1)
    law = first_token_distribution(sampled_verify, p_logits, q)
    assert torch.allclose(law, p, atol=3.0 / GRID)

    def always_accept(p_logits, drafts, q, uniforms):
        return torch.tensor(1), torch.tensor(0)

    assert (first_token_distribution(always_accept, p_logits, q) - p).abs().max() > 0.05


def test_candidate_keys_skip_the_draft_token_and_follow_the_fanout():
    scores = torch.tensor([[5.0, 4, 3, 2, 1], [1.0, 5, 4, 3, 2], [0.0, 1, 2, 3, 4]])
    drafts = torch.tensor([0, 2])
    depth, token, rank = candidate_keys(scores, drafts, torch.tensor([2, 1, 3]))
    assert depth.tolist() == [0, 0, 1, 2, 2, 2]
    assert token.tolist() == [1, 2, 1, 4, 3, 2]   # depth 0 skips d_1=0, depth 1 skips d_2=2
    assert rank.tolist() == [0, 1, 0, 0, 1, 2]
    assert candidate_keys(scores, drafts, torch.tensor([0, 0, 1]))[0].tolist() == [2]


def test_tree_mask_shows_each_branch_its_prefix_and_own_chain():
    depth = torch.tensor([0, 2])  # two branches, K = 2 drafts, 2 steps
    mask = tree_mask(depth, num_drafts=2, num_steps=2)
    assert mask.shape == (4, 2 + 4)
    # rows: (step0,b0) (step0,b1) (step1,b0) (step1,b1); columns: d1 d2 | s0b0 s0b1 s1b0 s1b1
    assert mask.int().tolist() == [[0, 0, 1, 0, 0, 0],
                                   [1, 1, 0, 1, 0, 0],
                                   [0, 0, 1, 0, 1, 0],
                                   [1, 1, 0, 1, 0, 1]]


def test_plan_positions_and_commit_indices():
    plan = plan_branches(torch.randn(3, 7), torch.tensor([1, 2]), torch.tensor([1, 1, 1]), context_length=10)
    assert plan.positions.tolist() == [[10, 11, 12], [11, 12, 13]]
    assert commit_indices(10, 2, 3, branch=1, num_steps=2).tolist() == [13, 16]


def test_gather_kv_moves_entries_in_order():
    buffer = torch.arange(10.0).view(1, 10, 1).repeat(1, 1, 2)
    gather_kv(buffer, 3, torch.tensor([5, 8]))
    assert buffer[0, :5, 0].tolist() == [0, 1, 2, 5, 8]
