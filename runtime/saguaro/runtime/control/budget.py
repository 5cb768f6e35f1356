"""How many branches to pre-speculate at each depth j (the fan-out `F_j`).

`StaticFanout` is the official code's fixed list. `OnlineBudget` spends a total of B
branches where hits are likeliest: it estimates online `P(A = j)` (accepted length) and
`P(bonus has rank r | A = j)` (rank among the draft's candidates at depth j) and gives
each next branch to the depth whose next rank adds the most hit probability.

These place branches; how many a round may pre-speculate is not theirs to decide. Each
round may verify fewer drafts than the request's K and may cap the branches, both the
load policy's choice (what hides under this round's verification, `control.costs`):
`fanout(depths, cap)` places branches for accepted lengths 0..depths-1, at most `cap`.
"""
from __future__ import annotations

import torch

from saguaro.plugins.branch_draft.reference import candidate_scores


class StaticFanout:
    def __init__(self, fanout: list[int], num_draft_tokens: int):
        if len(fanout) == 1:
            fanout = fanout * (num_draft_tokens + 1)
        if len(fanout) != num_draft_tokens + 1:
            raise ValueError(f"fanout needs 1 or K+1 = {num_draft_tokens + 1} values, got {fanout}")
        # a list until a round drafts branches: a server makes one for every request it
        # takes (its limits checked), and each torch call releases the GIL and waits for it
        # behind the decoding thread
        self._fanout = list(fanout)
        self._tensor: torch.Tensor | None = None

    @property
    def max_branches(self) -> int:
        return sum(self._fanout)

    def fanout(self, depths: int | None = None, cap: int | None = None) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self._fanout, dtype=torch.int64)
        return within_cap(self._tensor[:depths], cap)

    def observe(self, accepted: int, bonus_rank: int) -> None:
        pass


class OnlineBudget:
    """Laplace-smoothed counts with a geometric prior on the accepted length."""

    def __init__(self, budget: int, num_draft_tokens: int, prior_acceptance: float = 0.5,
                 prior_weight: float = 4.0):
        self.budget, self.k = budget, num_draft_tokens
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        # ranks 0..budget-1 plus a last column for "outside the budget"
        self.ranks = budget
        # the counts are made when a round first drafts branches, as `StaticFanout`'s tensor
        self._counts: tuple[torch.Tensor, torch.Tensor] | None = None

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The accepted lengths' counts, by depth, and the bonus ranks', by depth and rank:
        the priors until rounds are observed."""
        if self._counts is None:
            depth = torch.arange(self.k + 1, dtype=torch.float64)
            geometric = self.prior_acceptance ** depth * (1 - self.prior_acceptance)
            geometric[-1] = self.prior_acceptance ** self.k  # all K accepted
            rank_prior = 1.0 / torch.arange(1, self.budget + 2, dtype=torch.float64)
            self._counts = (self.prior_weight * geometric / geometric.sum(),
                            (self.prior_weight * rank_prior / rank_prior.sum()).repeat(self.k + 1, 1))
        return self._counts

    @property
    def max_branches(self) -> int:
        return self.ranks

    def fanout(self, depths: int | None = None, cap: int | None = None) -> torch.Tensor:
        depths = self.k + 1 if depths is None else depths
        accepted_counts, rank_counts = self.counts()
        p_depth = accepted_counts[:depths] / accepted_counts[:depths].sum()
        p_rank = rank_counts[:depths] / rank_counts[:depths].sum(1, keepdim=True)
        hit_gain = p_depth.unsqueeze(1) * p_rank[:, :-1]
        fanout = torch.zeros(depths, dtype=torch.int64)
        rows = torch.arange(depths)
        for _ in range(self.budget if cap is None else min(self.budget, cap)):
            next_gain = hit_gain[rows, fanout.clamp(max=self.ranks - 1)]
            next_gain[fanout >= self.ranks] = -1.0
            fanout[int(torch.argmax(next_gain))] += 1
        return fanout

    def observe(self, accepted: int, bonus_rank: int) -> None:
        accepted_counts, rank_counts = self.counts()
        accepted_counts[accepted] += 1
        rank_counts[accepted, min(bonus_rank, self.ranks)] += 1


def within_cap(fanout: torch.Tensor, cap: int | None) -> torch.Tensor:
    """`fanout` with at most `cap` branches: the widest depth (the deepest of ties) gives
    one up at a time, so every depth keeps its likeliest keys longest."""
    fanout = fanout.clone()
    while cap is not None and int(fanout.sum()) > cap:
        widest = int(fanout.max())
        fanout[int(torch.nonzero(fanout == widest)[-1])] -= 1
    return fanout


def bonus_rank(scores: torch.Tensor, draft_tokens: torch.Tensor, accepted: int, bonus: int) -> int:
    """Rank of the bonus token among the draft's candidates at depth `accepted`."""
    row = candidate_scores(scores, draft_tokens)[accepted]
    return int((row > row[bonus]).sum())
