"""BranchDraft and the KV gather as OpenAI Triton kernels (behind the TensorRT plugin).

- `candidate_keys_kernel`: one program per depth j; it takes the row's best F_j tokens
  other than d_{j+1}, each the best after the one before (score descending, then index:
  F_j is small, a runtime loop bound), walking the row in tiles of at most `MAX_BLOCK_V`
  (any vocabulary compiles alike), and writes them at offset F_0 + .. + F_{j-1}, so the
  keys come out ordered by depth, then rank.
- `tree_layout_kernel`: one program per row `s*B + b` of the tree mask; it also writes
  position `[s, b]`.
- `gather_kv_kernel`: one program per (leading index, head-dim block); it loads all the
  committed entries before storing any, so it is safe in place even though a
  destination may be another entry's source (sources lie at or after destinations).

The launchers allocate outputs, so they need B = sum(fanout) on the host (one sync);
the TensorRT plugin gets its buffers from TensorRT and calls `launch_plan_outputs`, which
fills the plugin's eight outputs (`signature.SIGNATURE`) in whatever buffers it is given.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from saguaro.plugins.branch_draft.reference import BranchPlan
from saguaro.plugins.branch_draft.signature import SIGNATURE, extent_values, output_shapes

MAX_BLOCK_V = 4096  # scores a program holds at once


@triton.jit
def _next_best(row_ptr, vocab_size, draft, previous_score, previous_index, BLOCK_V: tl.constexpr):
    """The best token after `(previous_score, previous_index)` in the order score descending,
    then index ascending, the draft's own token left out: `(score, index)`."""
    best_score = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 2147483647, tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        scores = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf")).to(tl.float32)
        after = (scores < previous_score) | ((scores == previous_score) & (offsets > previous_index))
        candidate = (offsets < vocab_size) & (offsets != draft) & after
        tile_best = tl.max(tl.where(candidate, scores, float("-inf")), axis=0)
        tile_index = tl.min(tl.where(candidate & (scores == tile_best), offsets, 2147483647), axis=0)
        better = (tile_best > best_score) | ((tile_best == best_score) & (tile_index < best_index))
        best_score = tl.where(better, tile_best, best_score)
        best_index = tl.where(better, tile_index, best_index)
    return best_score, best_index


@triton.jit
def candidate_keys_kernel(scores_ptr, scores_row_stride, draft_tokens_ptr, fanout_ptr,
                          depth_ptr, token_ptr, rank_ptr, num_drafts, vocab_size,
                          BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    depth = tl.program_id(0)
    rows = tl.arange(0, BLOCK_ROWS)
    fanouts = tl.load(fanout_ptr + rows, mask=rows <= num_drafts, other=0)
    first = tl.sum(tl.where(rows < depth, fanouts, 0), axis=0)
    width = tl.load(fanout_ptr + depth)
    draft = tl.load(draft_tokens_ptr + depth, mask=depth < num_drafts, other=-1)
    score = tl.full((), float("inf"), tl.float32)
    token = tl.full((), -1, tl.int32)
    slot = first
    for _ in range(0, width):
        score, token = _next_best(scores_ptr + depth * scores_row_stride, vocab_size, draft, score, token, BLOCK_V)
        tl.store(depth_ptr + slot, depth.to(tl.int64))
        tl.store(token_ptr + slot, token.to(tl.int64))
        tl.store(rank_ptr + slot, slot - first)
        slot += 1


@triton.jit
def tree_layout_kernel(depth_ptr, positions_ptr, mask_ptr, context_length_ptr, num_drafts,
                       num_branches, BLOCK_COLS: tl.constexpr):
    row = tl.program_id(0)
    step = row // num_branches
    branch = row % num_branches
    depth = tl.load(depth_ptr + branch)
    context_length = tl.load(context_length_ptr)
    tl.store(positions_ptr + row, context_length + depth + step)
    width = num_drafts + num_drafts * num_branches
    for start in range(0, width, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        chain = cols - num_drafts  # index into the branch entries, s'*B + b'
        sees_draft = (cols < num_drafts) & (cols < depth)
        sees_chain = (chain >= 0) & (chain % num_branches == branch) & (chain // num_branches <= step)
        tl.store(mask_ptr + row * width + cols, sees_draft | sees_chain, mask=cols < width)


@triton.jit
def gather_kv_kernel(buffer_ptr, source_ptr, start, count, capacity, head_dim,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    lead = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    entries = tl.arange(0, BLOCK_N)
    live = (entries[:, None] < count) & (dims[None, :] < head_dim)
    sources = tl.load(source_ptr + entries, mask=entries < count, other=0)
    base = buffer_ptr + lead.to(tl.int64) * capacity * head_dim
    values = tl.load(base + sources[:, None] * head_dim + dims[None, :], mask=live)
    tl.store(base + (start + entries)[:, None] * head_dim + dims[None, :], values, mask=live)


def launch_candidate_keys(scores: torch.Tensor, draft_tokens: torch.Tensor, fanout: torch.Tensor,
                          depth: torch.Tensor, token: torch.Tensor, rank: torch.Tensor) -> None:
    """Fill `[B]` depth / token / rank; the caller sized them with B = sum(fanout)."""
    rows, vocab_size = scores.shape
    if scores.stride(1) != 1:
        raise ValueError("candidate_keys needs score rows with unit stride along the vocabulary")
    candidate_keys_kernel[(rows,)](
        scores, scores.stride(0), draft_tokens, fanout, depth, token, rank, rows - 1, vocab_size,
        BLOCK_V=min(triton.next_power_of_2(vocab_size), MAX_BLOCK_V), BLOCK_ROWS=triton.next_power_of_2(rows))


def launch_tree_layout(depth: torch.Tensor, context_length: torch.Tensor, num_drafts: int,
                       positions: torch.Tensor, window_mask: torch.Tensor) -> None:
    """Fill positions `[K, B]` and the window mask `[K*B, K + K*B]` (K steps; bool, or int32
    as the TensorRT plugin gives it: a store casts to the buffer's type)."""
    num_branches = depth.shape[0]
    if num_drafts * num_branches == 0:
        return  # both outputs are empty
    tree_layout_kernel[(num_drafts * num_branches,)](
        depth, positions, window_mask, context_length, num_drafts, num_branches, BLOCK_COLS=128)


def launch_gather_kv(buffer: torch.Tensor, start: int, source_indices: torch.Tensor) -> None:
    """In place on a contiguous `[..., capacity, head_dim]` buffer, like `reference.gather_kv`."""
    if not buffer.is_contiguous():
        raise ValueError("gather_kv works in place and needs a contiguous buffer")
    count = source_indices.shape[0]
    if count == 0:
        return
    capacity, head_dim = buffer.shape[-2:]
    leading = buffer.numel() // (capacity * head_dim)
    block_d = min(triton.next_power_of_2(head_dim), 128)
    grid = (leading, triton.cdiv(head_dim, block_d))
    gather_kv_kernel[grid](buffer, source_indices, start, count, capacity, head_dim,
                           BLOCK_N=triton.next_power_of_2(count), BLOCK_D=block_d)


def launch_plan_outputs(scores: torch.Tensor, draft_tokens: torch.Tensor, fanout: torch.Tensor,
                        context_length: torch.Tensor, max_branches: int, output) -> None:
    """The BranchDraft plugin's body: every output of `SIGNATURE`, in its order, written to
    the buffer `output(index, shape, dtype)` returns for it (TensorRT's memory on a GPU)."""
    branches = int(fanout.sum())  # one host sync: TensorRT reads the size tensors back anyway
    if branches > max_branches:
        raise ValueError(f"{SIGNATURE.plugin_id}: sum(fanout) = {branches} exceeds max_branches = {max_branches}")
    drafts = draft_tokens.shape[0]
    shapes = output_shapes(drafts, branches)
    out = {spec.name: output(index, shapes[spec.name], spec.dtype) for index, spec in enumerate(SIGNATURE.outputs)}
    launch_candidate_keys(scores, draft_tokens, fanout, out["depth"], out["token"], out["rank"])
    launch_tree_layout(out["depth"], context_length, drafts, out["positions"], out["window_mask"])
    for name, value in extent_values(drafts, branches).items():
        out[name].fill_(value)


def candidate_keys(scores: torch.Tensor, draft_tokens: torch.Tensor, fanout: torch.Tensor):
    """Same result as `reference.candidate_keys`: `(depth, token, rank)`, each `[B]` int64."""
    branches = int(fanout.sum())
    depth, token, rank = (torch.empty(branches, dtype=torch.int64, device=scores.device) for _ in range(3))
    launch_candidate_keys(scores.contiguous(), draft_tokens.to(torch.int64).contiguous(),
                          fanout.to(torch.int64).contiguous(), depth, token, rank)
    return depth, token, rank


def tree_layout(depth: torch.Tensor, context_length: int, num_drafts: int):
    """`(positions, window_mask)` as `reference.branch_positions` / `reference.tree_mask` give
    for `num_drafts` steps."""
    branches, device = depth.shape[0], depth.device
    positions = torch.empty(num_drafts, branches, dtype=torch.int64, device=device)
    window_mask = torch.empty(num_drafts * branches, num_drafts + num_drafts * branches,
                              dtype=torch.bool, device=device)
    length = torch.tensor([context_length], dtype=torch.int64, device=device)
    launch_tree_layout(depth.contiguous(), length, num_drafts, positions, window_mask)
    return positions, window_mask


def plan_branches(scores: torch.Tensor, draft_tokens: torch.Tensor, fanout: torch.Tensor,
                  context_length: int) -> BranchPlan:
    """Same result as `reference.plan_branches`."""
    depth, token, rank = candidate_keys(scores, draft_tokens, fanout)
    positions, window_mask = tree_layout(depth, context_length, draft_tokens.shape[0])
    return BranchPlan(depth, token, rank, positions, window_mask)


def gather_kv(buffer: torch.Tensor, start: int, source_indices: torch.Tensor) -> None:
    """Same effect as `reference.gather_kv` (in place)."""
    launch_gather_kv(buffer, start, source_indices.to(device=buffer.device, dtype=torch.int64).contiguous())
