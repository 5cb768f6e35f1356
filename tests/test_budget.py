"""Branch budgets: where B branches go; an "auto" budget is sized by the load policy."""
import torch

from saguaro.runtime.control.budget import OnlineBudget, StaticFanout, bonus_rank
from saguaro.runtime.core.options import AUTO_BUDGET_CAP, DecodeOptions


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


def test_an_auto_budget_places_up_to_the_engines_limit_and_the_round_cap_sizes_it():
    """"auto" is an online budget as wide as the engines allow; how many of its branches a
    round pre-speculates is the load policy's cap (a request with it is steered)."""
    options = DecodeOptions(budget="auto", num_draft_tokens=3)
    budget = options.fanout_policy(max_branches=8)
    assert isinstance(budget, OnlineBudget) and budget.max_branches == 8 and options.steered
    assert int(budget.fanout().sum()) == 8
    assert int(budget.fanout(cap=3).sum()) == 3 and int(budget.fanout(depths=2, cap=3).sum()) == 3
    assert options.fanout_policy().max_branches == AUTO_BUDGET_CAP
    assert not DecodeOptions(budget=8).steered and DecodeOptions(adapt_k=True).steered


def test_bonus_rank_counts_better_candidates_leaving_out_the_draft_token():
    scores = torch.tensor([[0.0, 5.0, 4.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    drafts = torch.tensor([1])
    assert bonus_rank(scores, drafts, accepted=0, bonus=3) == 1  # only token 2 beats it; 1 is d_1
    assert bonus_rank(scores, drafts, accepted=1, bonus=3) == 0
