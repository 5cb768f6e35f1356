"""Packing a batch of `Step`s (ragged: each its own cache slot, length, tokens, positions
and mask) into the padded arrays a batched forward takes. Shared by the engines.

Rows are the pool slots from the lowest to the highest one in the batch; a slot in that
range without a step is an idle row (no new tokens). Each row's new tokens are padded on
the right to the longest; `query_seqlens` says how many are real. The mask `[B, S, T]`
is by cache entry (T = the longest cache after the step): a step's own mask (or the
causal one) in its rows, and one visible column in padded and idle rows, which no
result is read from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

import numpy as np

from saguaro.runtime.core.contracts import Step, causal_mask
from saguaro.runtime.engines.kv_cache import PooledCache


@dataclass
class PackedBatch:
    first_slot: int
    rows: list[int]               # the row of each step, in the steps' order
    counts: list[int]             # new tokens of each step
    input_ids: np.ndarray         # [B, S] int64
    position_ids: np.ndarray      # [B, S] int64
    seqlens_k: np.ndarray         # [B] int32: entries after the step, minus one
    query_seqlens: np.ndarray     # [B] int32: new tokens (0 in idle rows)
    total_sequence_length: int
    attention_mask: np.ndarray    # [B, S, T] bool
    scored_positions: np.ndarray  # [B, P] int64: the positions whose logits each row returns
    scored: list[int]             # rows of logits each step reads: 1 (last_only) or its tokens

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]


def check_step(step: Step) -> None:
    past, count = step.cache.length, len(step.tokens)
    if count < 1:
        raise ValueError("a step feeds at least one token")
    if past + count > step.cache.capacity:
        raise ValueError(f"KV cache overflow: {past} + {count} entries > capacity {step.cache.capacity}")
    if step.mask is not None and tuple(step.mask.shape) != (count, past + count):
        raise ValueError(f"mask shape {tuple(step.mask.shape)} is not [n, cache length + n] = "
                         f"{[count, past + count]}")


def pack_steps(steps: Sequence[Step]) -> PackedBatch:
    for step in steps:
        check_step(step)
    slots = [cast(PooledCache, step.cache).slot for step in steps]  # the engines' caches: slots of a pool
    if len(set(slots)) != len(slots):
        raise ValueError("a batch holds at most one step per sequence")
    first = min(slots)
    rows = [slot - first for slot in slots]
    batch, width = max(rows) + 1, max(len(step.tokens) for step in steps)
    lengths = [step.cache.length + len(step.tokens) for step in steps]
    total = max(lengths)
    input_ids = np.zeros((batch, width), np.int64)
    position_ids = np.zeros((batch, width), np.int64)
    seqlens_k = np.zeros(batch, np.int32)  # idle rows: one (unread) cached entry
    query_seqlens = np.zeros(batch, np.int32)
    mask = np.zeros((batch, width, total), bool)
    mask[:, :, 0] = True  # padded and idle rows: one visible column
    scored = [1 if step.last_only else len(step.tokens) for step in steps]
    scored_positions = np.zeros((batch, max(scored)), np.int64)  # idle rows, and the rest of short ones: unread
    for step, row, length, wanted in zip(steps, rows, lengths, scored):
        count, past = len(step.tokens), step.cache.length
        input_ids[row, :count] = step.tokens.numpy()
        position_ids[row, :count] = step.positions.numpy()
        seqlens_k[row], query_seqlens[row] = length - 1, count
        mask[row, :count, :length] = (causal_mask(past, count) if step.mask is None else step.mask).numpy()
        scored_positions[row, :wanted] = np.arange(count - wanted, count)
    return PackedBatch(first, rows, [len(step.tokens) for step in steps], input_ids, position_ids, seqlens_k,
                       query_seqlens, total, mask, scored_positions, scored)
