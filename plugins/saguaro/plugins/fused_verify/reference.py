"""Reference (pure torch) fused verification: the definition every other form must match.

Inputs for a round with K draft tokens:
  target_logits `[K+1, V]` (rows for `[last, d_1..d_K]`), draft_tokens `[K]`,
  draft_probs `[K, V]` (the q each draft token was sampled from; unused when greedy),
  uniforms `[K+1]` (K acceptance tests, then one for the bonus token).
Output: `(accepted, bonus)`: how many drafts were accepted (0..K) and the token that
follows them. Greedy (a temperature below `probs.GREEDY_TEMPERATURE`, 0 included):
accept while the target's argmax equals the draft, bonus = argmax of the first row not
accepted. Sampling: the rule of Leviathan et al.
"""
from __future__ import annotations

import torch

from saguaro.plugins.probs import is_greedy, logits_to_probs, sample_from


def accepted_prefix_length(accept: torch.Tensor) -> torch.Tensor:
    """Number of leading True values in a `[K]` bool tensor."""
    return torch.cumprod(accept.to(torch.int64), dim=0).sum()


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor):
    choices = torch.argmax(target_logits, dim=-1)
    accepted = accepted_prefix_length(choices[:-1] == draft_tokens)
    return accepted, choices[accepted]


def residual_rows(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """`norm(max(p_j - q_j, 0))` for j < K and `p_{K+1}` for the all-accepted row.

    Where p == q the residual has no mass; the rejection there has probability zero, and
    falling back to p keeps the row a distribution.
    """
    q_padded = torch.cat((draft_probs, torch.zeros_like(target_probs[-1:])), dim=0)
    residual = (target_probs - q_padded).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


def verify_sampling(target_logits, draft_tokens, draft_probs, uniforms,
                    temperature: float, top_k: int = 0, top_p: float = 1.0):
    k = draft_tokens.shape[0]
    p = logits_to_probs(target_logits, temperature, top_k, top_p)
    rows = torch.arange(k, device=target_logits.device)
    p_draft, q_draft = p[rows, draft_tokens], draft_probs[rows, draft_tokens]
    # accept d_j with probability min(1, p/q): u * q < p, written without a division
    accepted = accepted_prefix_length(uniforms[:k] * q_draft < p_draft)
    bonus = sample_from(residual_rows(p, draft_probs)[accepted], uniforms[k])
    return accepted, bonus


def fused_verify(target_logits, draft_tokens, draft_probs, uniforms,
                 temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The op: `(accepted, bonus)` as 0-d int64 tensors."""
    if is_greedy(temperature):
        return verify_greedy(target_logits, draft_tokens)
    return verify_sampling(target_logits, draft_tokens, draft_probs, uniforms, temperature, top_k, top_p)
