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

from saguaro.runtime.core.contracts import Step
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
    """Built with whole-array operations rather than row by row: at 16 streams of one token
    each, filling rows one at a time (a causal mask per row among them) was a fifth of a
    round of the tiny engines, all of it holding the GIL."""
    for step in steps:
        check_step(step)
    slots = [cast(PooledCache, step.cache).slot for step in steps]  # the engines' caches: slots of a pool
    if len(set(slots)) != len(slots):
        raise ValueError("a batch holds at most one step per sequence")
    first = min(slots)
    rows = np.array(slots) - first
    counts = np.array([step.tokens.shape[0] for step in steps])
    pasts = np.array([step.cache.length for step in steps])
    lengths = pasts + counts
    batch, width, total = int(rows.max()) + 1, int(counts.max()), int(lengths.max())
    # each new token's (row, column) in the padded arrays
    token_rows = np.repeat(rows, counts)
    token_columns = np.arange(token_rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    input_ids = np.zeros((batch, width), np.int64)
    # read as lists: `.numpy()` is a torch call, and each releases the GIL and waits to take
    # it back (in the server, behind the threads that send responses)
    input_ids[token_rows, token_columns] = [token for step in steps for token in step.tokens.tolist()]
    position_ids = np.zeros((batch, width), np.int64)
    position_ids[token_rows, token_columns] = [position for step in steps for position in step.positions.tolist()]
    seqlens_k = np.zeros(batch, np.int32)  # idle rows: one (unread) cached entry
    seqlens_k[rows] = lengths - 1
    query_seqlens = np.zeros(batch, np.int32)
    query_seqlens[rows] = counts
    # causal: token i of a row sees its cache entries up to past + i; padded and idle rows
    # see column 0 only
    last_visible = np.zeros((batch, width), np.int64)
    last_visible[token_rows, token_columns] = np.repeat(pasts, counts) + token_columns
    mask = np.arange(total) <= last_visible[:, :, None]
    for step, row, count, length in zip(steps, rows, counts, lengths):
        if step.mask is not None:
            mask[row, :count, :length] = step.mask.numpy()
    scored = [1 if step.last_only else count for step, count in zip(steps, counts.tolist())]
    wanted = np.array(scored)
    offsets = np.arange(wanted.max())
    scored_positions = np.zeros((batch, offsets.size), np.int64)  # idle rows, and the rest of short ones: unread
    scored_positions[rows] = np.where(offsets < wanted[:, None], (counts - wanted)[:, None] + offsets, 0)
    return PackedBatch(first, rows.tolist(), counts.tolist(), input_ids, position_ids, seqlens_k,
                       query_seqlens, total, mask, scored_positions, scored)
