"""Reference (pure torch) branch-keyed drafting: the definition every other form must match.

A round drafted `d_1..d_K` from a context of `n0` tokens, so the draft's KV cache holds
the context at indices `[0, n0)` and `d_1..d_K` at `[n0, n0 + K)` (the last one fed by
the "glue" forward). The verification outcome is a key `(j, t)`: j drafts accepted, then
bonus token t. Candidates at depth j are the draft's top tokens at position j, leaving
out `d_{j+1}` (a rejection there means the bonus differs from it).

Each of the B branches drafts K tokens from `context ‖ d_1..d_j ‖ t`; all B advance
together, one tree forward per step. Step s feeds one token per branch, appended to the
cache at `n0 + K + s*B + b`, at position `n0 + j_b + s`. The tree mask below is over the
"speculation window", cache indices from `n0` on; every branch sees the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def candidate_scores(scores: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """Scores `[K+1, V]` with each depth's own next draft token `d_{j+1}` ruled out."""
    masked = scores.float().clone()
    masked[torch.arange(draft_tokens.shape[0], device=scores.device), draft_tokens] = float("-inf")
    return masked


def feasible_fanout(fanout: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The fan-out capped by the candidates there are: V - 1 at a depth j < K (the draft's
    own next token is left out), V at depth K. A wider request would be a key that can
    never be anything but a duplicate."""
    limit = torch.full_like(fanout, vocab_size - 1)
    limit[-1] = vocab_size
    return torch.minimum(fanout, limit)


def candidate_keys(scores: torch.Tensor, draft_tokens: torch.Tensor, fanout: torch.Tensor):
    """Branch keys from draft scores `[K+1, V]` (logits or probs) and fan-out `[K+1]`.

    Returns `(depth, token, rank)`, each `[B]` with B = sum(fanout), ordered by depth
    then rank (rank 0 = the most likely token other than the draft's own).
    """
    k = draft_tokens.shape[0]
    masked = candidate_scores(scores, draft_tokens)
    widest = max(int(fanout.max()), 1)
    top_tokens = torch.topk(masked, widest, dim=-1).indices
    rank = torch.arange(widest, device=scores.device).expand(k + 1, widest)
    depth = torch.arange(k + 1, device=scores.device).unsqueeze(1).expand(k + 1, widest)
    keep = rank < fanout.unsqueeze(1)
    return depth[keep], top_tokens[keep], rank[keep]


def branch_positions(depth: torch.Tensor, context_length: int, num_steps: int) -> torch.Tensor:
    """`[num_steps, B]`: the position of the token each branch feeds at each step."""
    steps = torch.arange(num_steps, device=depth.device).unsqueeze(1)
    return context_length + depth.unsqueeze(0) + steps


def tree_mask(depth: torch.Tensor, num_drafts: int, num_steps: int) -> torch.Tensor:
    """Bool `[num_steps*B, num_drafts + num_steps*B]` over the speculation window.

    Row `s*B + b` (branch b's step-s query) sees draft entry c iff c < depth_b, and
    branch entry `s'*B + b'` iff b' == b and s' <= s.
    """
    branches = depth.shape[0]
    sees_drafts = torch.arange(num_drafts, device=depth.device).unsqueeze(0) < depth.unsqueeze(1)
    query_step = torch.arange(num_steps, device=depth.device).repeat_interleave(branches)
    query_branch = torch.arange(branches, device=depth.device).repeat(num_steps)
    sees_own_chain = (query_branch.unsqueeze(1) == query_branch.unsqueeze(0)) & (
        query_step.unsqueeze(0) <= query_step.unsqueeze(1))
    return torch.cat((sees_drafts.repeat(num_steps, 1), sees_own_chain), dim=1)


def step_mask(window_mask: torch.Tensor, context_length: int, step: int, branches: int,
              num_drafts: int) -> torch.Tensor:
    """The attention mask for tree step `step`, over all cache entries so far plus its own."""
    rows = window_mask[step * branches:(step + 1) * branches, :num_drafts + (step + 1) * branches]
    return torch.cat((torch.ones(branches, context_length, dtype=torch.bool), rows), dim=1)


def commit_indices(context_length: int, num_drafts: int, branches: int, branch: int,
                   num_steps: int) -> torch.Tensor:
    """Cache indices of branch `branch`'s entries, in step order: what a hit commits."""
    return context_length + num_drafts + torch.arange(num_steps) * branches + branch


def gather_kv(buffer: torch.Tensor, start: int, source_indices: torch.Tensor) -> None:
    """In place on `[..., capacity, head_dim]`: entries `source_indices` move to `start` on.

    Sources lie at or after their destinations, and the gather reads before it writes.
    """
    count = source_indices.shape[0]
    buffer[..., start:start + count, :] = buffer[..., source_indices, :]


@dataclass(frozen=True)
class BranchPlan:
    """The op's outputs for one round: keys `(depth, token)` with their rank, the position
    each branch feeds at each step `[K, B]`, and the tree mask over the speculation window."""

    depth: torch.Tensor
    token: torch.Tensor
    rank: torch.Tensor
    positions: torch.Tensor
    window_mask: torch.Tensor

    @property
    def branches(self) -> int:
        return self.depth.shape[0]


def plan_branches(scores: torch.Tensor, draft_tokens: torch.Tensor, fanout: torch.Tensor,
                  context_length: int) -> BranchPlan:
    """The op: candidate keys and their tree layout for K drafting steps."""
    num_drafts = draft_tokens.shape[0]
    depth, token, rank = candidate_keys(scores, draft_tokens, fanout)
    return BranchPlan(depth, token, rank,
                      branch_positions(depth, context_length, num_drafts),
                      tree_mask(depth, num_drafts, num_drafts))
