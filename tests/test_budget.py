"""Branch budgets: where B branches go, and how an "auto" budget picks B."""
import torch

from saguaro.runtime.control.budget import AdaptiveBudget, OnlineBudget, StaticFanout, bonus_rank


def test_static_fanout_broadcasts_one_value_to_every_depth():
    assert StaticFanout([3], 4).fanout().tolist() == [3, 3, 3, 3, 3]
    assert StaticFanout([3, 2, 1], 2).max_branches == 6


def test_online_budget_moves_branches_to_the_outcomes_seen():
    budget = OnlineBudget(6, num_draft_tokens=3)
    assert int(budget.fanout().sum()) == 6
    for _ in range(200):  # verification keeps accepting everything; bonus is rank 0 or 1
        budget.observe(accepted=3, bonus_rank=0)
        budget.observe(accepted=3, bonus_rank=1)
    fanout = budget.fanout()
    assert int(fanout.sum()) == 6 and fanout[3] >= 2 and fanout[3] == fanout.max()


def test_adaptive_budget_shrinks_when_prespeculation_shows_and_grows_when_hidden():
    budget = AdaptiveBudget(cap=8, num_draft_tokens=2)
    assert budget.budget == 8 and budget.max_branches == 8
    for _ in range(20):
        budget.observe_timing(verify_s=1.0, prespeculate_s=1.5)
    assert budget.budget == 1 and int(budget.fanout().sum()) == 1
    budget.observe_timing(verify_s=1.0, prespeculate_s=0.9)  # hidden, but with little slack
    assert budget.budget == 1
    for _ in range(3):
        budget.observe_timing(verify_s=1.0, prespeculate_s=0.5)
    assert budget.budget == 4 and int(budget.fanout().sum()) == 4
    for _ in range(20):
        budget.observe_timing(verify_s=1.0, prespeculate_s=0.1)
    assert budget.budget == 8  # never past its cap


def test_bonus_rank_counts_better_candidates_leaving_out_the_draft_token():
    scores = torch.tensor([[0.0, 5.0, 4.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    drafts = torch.tensor([1])
    assert bonus_rank(scores, drafts, accepted=0, bonus=3) == 1  # only token 2 beats it; 1 is d_1
    assert bonus_rank(scores, drafts, accepted=1, bonus=3) == 0
