"""Distilling a draft on its target's answers, and measuring how often it agrees.

The data are `Sequence`s: a prompt, the target's greedy continuation, and the target's top
tokens with their log-probabilities at each continuation position. A step's loss is the
cross-entropy against the greedy tokens (what greedy acceptance counts) plus a soft
cross-entropy against the target's distribution over its top tokens. Agreement is
measured teacher-forced along held-out continuations, as `acceptance` does for pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from saguaro.modelmaker.acceptance import summarize
from saguaro.modelmaker.train import TrainSettings, fit
from saguaro.runtime.models.llama import Llama


@dataclass
class Sequence:
    """A prompt's ids followed by the target's greedy continuation (ending at EOS if reached),
    and for each continuation token the target's top tokens and their log-probabilities."""

    ids: list[int]
    start: int  # index of the first continuation token
    top_ids: torch.Tensor | None = None       # [continuation, soft_top]
    top_logprobs: torch.Tensor | None = None  # [continuation, soft_top]

    @property
    def continuation(self) -> list[int]:
        return self.ids[self.start:]


@dataclass
class Batch:
    """Right-padded rows: ids, a causal mask, positions, and what each continuation token
    teaches: its output row (`labels`, -100 for prompt tokens and tokens the draft cannot
    score) and the output rows and probabilities of the target's top tokens there."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    soft_rows: torch.Tensor   # [rows, width, soft_top]; `unscored` where the draft has no row
    soft_probs: torch.Tensor  # [rows, width, soft_top]; 0 on prompt tokens


def batch_of(sequences: list[Sequence], output_rows: torch.Tensor, unscored: int, soft_top: int = 1) -> Batch:
    count, width = len(sequences), max(len(s.ids) for s in sequences)
    ids = torch.zeros(count, width, dtype=torch.long)
    labels = torch.full((count, width), -100)
    soft_rows = torch.full((count, width, soft_top), unscored)
    soft_probs = torch.zeros(count, width, soft_top)
    for row, s in enumerate(sequences):
        end = len(s.ids)
        ids[row, :end] = torch.tensor(s.ids)
        rows = output_rows[torch.tensor(s.continuation)]
        labels[row, s.start:end] = torch.where(rows == unscored, -100, rows)
        if s.top_ids is not None:
            assert s.top_logprobs is not None  # recorded with the top ids
            soft_rows[row, s.start:end] = output_rows[s.top_ids[:, :soft_top]]
            soft_probs[row, s.start:end] = s.top_logprobs[:, :soft_top].exp()
    mask = torch.ones(width, width, dtype=torch.bool).tril().expand(count, width, width)
    return Batch(ids, mask, torch.arange(width).expand(count, width), labels, soft_rows, soft_probs)


def output_rows_of(model: torch.nn.Module) -> torch.Tensor:
    """A draft's `output_rows` buffer, typed (an `nn.Module` attribute reads as Tensor | Module)."""
    return cast(torch.Tensor, model.output_rows)


def empty_past(model: Llama, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers, heads, dim = model.shape.kv_shape
    return torch.zeros(layers, batch, heads, 0, dim), torch.zeros(layers, batch, heads, 0, dim)


def soft_cross_entropy(log_q: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor, unscored: int) -> torch.Tensor:
    """-sum p log q over the target's top tokens the draft can score, averaged over the
    positions that have any (`log_q` `[.., output_vocab]`)."""
    scorable = rows != unscored
    picked = log_q.gather(-1, torch.where(scorable, rows, 0))
    per_position = -(probs * picked * scorable).sum(-1)
    counted = (probs * scorable).sum(-1) > 0
    return per_position[counted].mean() if counted.any() else per_position.sum() * 0


def distillation_step_loss(draft: Llama, batch: Batch, soft_weight: float) -> torch.Tensor:
    hidden, _, _ = draft.hidden_concat(batch.ids, batch.positions, batch.mask, *empty_past(draft, len(batch.ids)))
    log_q = draft.output_logits(hidden[:, :-1]).log_softmax(-1)  # row i predicts token i + 1
    hard = F.nll_loss(log_q.flatten(0, 1), batch.labels[:, 1:].flatten(), ignore_index=-100)
    soft = soft_cross_entropy(log_q, batch.soft_rows[:, 1:], batch.soft_probs[:, 1:], draft.shape.output_vocab)
    return hard + soft_weight * soft


def distill(draft: Llama, sequences: list[Sequence], train: TrainSettings, soft_top: int, soft_weight: float,
            seed: int, progress: bool) -> list[float]:
    """Distil on random batches of the target's answers (see `distillation_step_loss`)."""
    draws = torch.Generator().manual_seed(seed)

    def batch_loss() -> torch.Tensor:
        picks = torch.randint(len(sequences), (train.batch_size,), generator=draws).tolist()
        batch = batch_of([sequences[i] for i in picks], output_rows_of(draft), draft.shape.output_vocab, soft_top)
        return distillation_step_loss(draft, batch, soft_weight)

    return fit(draft, train, batch_loss, progress, "draft")


@torch.no_grad()
def agreement(draft: Llama, sequences: list[Sequence], k: int) -> dict:
    """Per continuation token: does the draft's argmax (full vocabulary) equal the target's?"""
    draft.eval()
    matches = []
    for s in sequences:
        batch = batch_of([s], output_rows_of(draft), draft.shape.output_vocab)
        logits, _, _ = draft.forward_concat(batch.ids, batch.positions, batch.mask, *empty_past(draft, 1))
        guesses = logits[0, s.start - 1:len(s.ids) - 1].argmax(-1)
        matches.append((guesses == torch.tensor(s.continuation)).tolist())
    return summarize(matches, k, sum(s.start for s in sequences) // len(sequences),
                     max(len(s.continuation) for s in sequences))
