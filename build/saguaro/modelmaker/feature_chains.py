"""Unrolled drafting chains over the target's answers: what training and the held-out
report both run a feature head on (`feature_draft`, `feature_report`).

Indexing used throughout: element e of a sequence's arrays is the token at position
e + 1 paired with the target's feature of position e (the token at position 0 has no
feature before it, as in the releases); step j of an unrolled chain started at element e
reads the token at position e + j and predicts the one at e + j + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.modelmaker.feature_answers import Answer
from saguaro.runtime.models.feature_head import FeatureHead
from saguaro.runtime.models.llama import rope_cos_sin


@dataclass
class Batch:
    """Right-padded arrays by position (see the module docstring for the indexing)."""

    ids: torch.Tensor         # [B, W + 1 + steps]: the tokens by position, 0-padded
    features: torch.Tensor    # [B, W, feature_width]: element e holds the feature of position e
    finals: torch.Tensor      # [B, W + steps, hidden]: the target's last-layer output by position, 0-padded
    fed: torch.Tensor         # [B, W + steps] bool: positions with a feature and a final (not padding)
    scored: torch.Tensor      # [B, W + 1 + steps] bool: continuation positions (labels)
    soft_ids: torch.Tensor    # [B, W + 1 + steps, soft_top]: target tokens predicting each position
    soft_probs: torch.Tensor  # [B, W + 1 + steps, soft_top]; 0 off the continuation
    width: int


def batch_of(answers: list[Answer], steps: int, soft_top: int) -> Batch:
    width = max(len(a.ids) for a in answers) - 1
    count, span = len(answers), width + 1 + steps
    ids = torch.zeros(count, span, dtype=torch.long)
    features = torch.zeros(count, width, answers[0].features.shape[-1], dtype=answers[0].features.dtype)
    finals = torch.zeros(count, width + steps, answers[0].finals.shape[-1], dtype=answers[0].finals.dtype)
    fed = torch.zeros(count, width + steps, dtype=torch.bool)
    scored = torch.zeros(count, span, dtype=torch.bool)
    soft_ids = torch.zeros(count, span, soft_top, dtype=torch.long)
    soft_probs = torch.zeros(count, span, soft_top)
    for row, a in enumerate(answers):
        end = len(a.ids)
        ids[row, :end] = torch.tensor(a.ids)
        features[row, :end - 1] = a.features
        finals[row, :end - 1] = a.finals
        fed[row, :end - 1] = True
        scored[row, a.start:end] = True
        soft_ids[row, a.start:end] = a.top_ids[:, :soft_top]
        soft_probs[row, a.start:end] = a.top_logprobs[:, :soft_top].float().exp()
    return Batch(ids, features, finals, fed, scored, soft_ids, soft_probs, width)


def chain_mask(width: int, step: int) -> torch.Tensor:
    """`[width, width * step]`: step `step`'s query at element e sees the first step's keys
    up to e (true features) and, of each later step, the key of its own chain (element e)."""
    causal = torch.arange(width) <= torch.arange(width).unsqueeze(1)
    return torch.cat([causal] + [torch.eye(width, dtype=torch.bool)] * (step - 1), dim=1)


def unrolled(head: FeatureHead, batch: Batch, steps: int) -> list[torch.Tensor]:
    """hidden_out of each drafting step `[B, W, hidden]`: step 1 on the target's features,
    step j on step j - 1's hidden_out at the same element (the chain's previous token)."""
    count, width = batch.ids.shape[0], batch.width
    hidden = head.project(batch.features)
    keys, values, outs = [], [], []
    for step in range(1, steps + 1):
        tokens = batch.ids[:, step:step + width]
        positions = (torch.arange(width) + step).expand(count, width)
        x, residual = head.layer_inputs(tokens, hidden)
        cos, sin = rope_cos_sin(positions, head.inv_freq)
        q, k, v = head.project_qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        mask = chain_mask(width, step).expand(count, width, width * step)
        hidden = head.finish_layer(residual, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        outs.append(hidden)
    return outs
