"""FusedVerify as OpenAI Triton kernels (the GPU implementation behind the TensorRT plugin).

Two launches, neither syncing with the host, so the op can sit inside an engine:

1. `row_outcome_kernel`, one program per row j of the K+1 target rows. Each row works
   out, on its own, whether d_j is accepted and which bonus token the round would end
   with if it stopped at row j (sampled from row j's residual with the bonus uniform).
2. `round_outcome_kernel`, one program: accepted = the first row not accepted, and the
   bonus is that row's candidate.

A program holds a whole vocabulary row (BLOCK_V = next power of two >= V) in registers;
fine for the vocabularies this project builds (2K-32K), spills beyond. Sampling
parameters are read from device memory, so greedy vs sampling and the top-k / top-p
filters are runtime branches, not recompilations.

Top-k and top-p use `tl.sort` (values only) and turn into thresholds: keep x >= the k-th
largest, and keep p >= the smallest probability inside the nucleus. This equals the
reference except when tokens tie exactly at the cut, where the reference keeps the ones
its sort happens to put first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from saguaro.plugins.probs import GREEDY_TEMPERATURE

GREEDY_BELOW = tl.constexpr(GREEDY_TEMPERATURE)  # below it: argmax, never a division by T


@triton.jit
def _kth_largest(x, k, offsets):
    """The k-th largest value of a row (1-based k)."""
    descending = tl.sort(x, descending=True)
    return tl.max(tl.where(offsets == k - 1, descending, float("-inf")), axis=0)


@triton.jit
def _nucleus(probs, top_p, offsets, in_vocab):
    """Zero the tokens outside the smallest prefix whose mass reaches top_p; renormalise."""
    descending = tl.sort(tl.where(in_vocab, probs, -1.0), descending=True)
    descending = tl.where(descending < 0, 0.0, descending)
    mass_before = tl.cumsum(descending, axis=0) - descending
    cutoff = tl.min(tl.where(mass_before < top_p, descending, float("inf")), axis=0)
    kept = tl.where(probs >= cutoff, probs, 0.0)
    return kept / tl.sum(kept, axis=0)


@triton.jit
def _sample(row, uniform, offsets, in_vocab, vocab_size):
    """Inverse CDF: the first index whose cumulative mass exceeds uniform * total."""
    row = tl.where(in_vocab, row, 0.0)
    cdf = tl.cumsum(row, axis=0)
    total = tl.max(tl.where(in_vocab, cdf, 0.0), axis=0)
    below = (cdf <= uniform * total) & in_vocab
    return tl.minimum(tl.sum(below.to(tl.int64), axis=0), vocab_size - 1)


@triton.jit
def row_outcome_kernel(logits_ptr, logits_row_stride, draft_tokens_ptr, draft_probs_ptr,
                       draft_probs_row_stride, uniforms_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
                       row_accepted_ptr, row_bonus_ptr, num_drafts, vocab_size,
                       BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_V)
    in_vocab = offsets < vocab_size
    has_draft = row < num_drafts
    logits = tl.load(logits_ptr + row * logits_row_stride + offsets, mask=in_vocab,
                     other=float("-inf")).to(tl.float32)
    draft = tl.load(draft_tokens_ptr + row, mask=has_draft, other=-1)
    temperature = tl.load(temperature_ptr).to(tl.float32)
    if temperature < GREEDY_BELOW:
        choice = tl.argmax(logits, axis=0).to(tl.int64)
        accepted = choice == draft
        bonus = choice
    else:
        scaled = logits / temperature
        top_k = tl.load(top_k_ptr)
        if (top_k > 0) & (top_k < vocab_size):
            kth = _kth_largest(scaled, top_k, offsets)
            scaled = tl.where(scaled < kth, float("-inf"), scaled)
        weights = tl.exp(scaled - tl.max(scaled, axis=0))
        probs = weights / tl.sum(weights, axis=0)
        top_p = tl.load(top_p_ptr).to(tl.float32)
        if top_p < 1.0:
            probs = _nucleus(probs, top_p, offsets, in_vocab)
        # row K has no draft: q is the zero row, so its residual is p itself
        q_length = tl.where(has_draft, vocab_size, 0)
        q = tl.load(draft_probs_ptr + row * draft_probs_row_stride + offsets,
                    mask=offsets < q_length, other=0.0).to(tl.float32)
        p_draft = tl.sum(tl.where(offsets == draft, probs, 0.0), axis=0)
        q_draft = tl.sum(tl.where(offsets == draft, q, 0.0), axis=0)
        u_accept = tl.load(uniforms_ptr + row, mask=has_draft, other=1.0)
        accepted = u_accept * q_draft < p_draft
        residual = tl.maximum(probs - q, 0.0)
        empty = tl.sum(tl.where(in_vocab, residual, 0.0), axis=0) <= 0
        residual = tl.where(empty, probs, residual)
        bonus = _sample(residual, tl.load(uniforms_ptr + num_drafts), offsets, in_vocab, vocab_size)
    tl.store(row_accepted_ptr + row, (accepted & has_draft).to(tl.int32))
    tl.store(row_bonus_ptr + row, bonus.to(tl.int64))


@triton.jit
def round_outcome_kernel(row_accepted_ptr, row_bonus_ptr, accepted_ptr, bonus_ptr, num_drafts,
                         BLOCK_K: tl.constexpr):
    offsets = tl.arange(0, BLOCK_K)
    is_draft = offsets < num_drafts
    row_accepted = tl.load(row_accepted_ptr + offsets, mask=is_draft, other=0)
    first_rejected = tl.min(tl.where((row_accepted == 0) & is_draft, offsets, num_drafts), axis=0)
    tl.store(accepted_ptr, first_rejected.to(tl.int64))
    tl.store(bonus_ptr, tl.load(row_bonus_ptr + first_rejected))


def launch(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
           uniforms: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           accepted: torch.Tensor, bonus: torch.Tensor) -> None:
    """Run the op on tensors already on one device, writing 0-d int64 `accepted` / `bonus`.

    Every argument is a tensor (sampling parameters too) so no value crosses to the host.
    """
    rows, vocab_size = target_logits.shape
    num_drafts = rows - 1
    if target_logits.stride(1) != 1 or (num_drafts and draft_probs.stride(1) != 1):
        raise ValueError("fused_verify needs rows with unit stride along the vocabulary")
    device = target_logits.device
    row_accepted = torch.empty(rows, dtype=torch.int32, device=device)
    row_bonus = torch.empty(rows, dtype=torch.int64, device=device)
    row_outcome_kernel[(rows,)](
        target_logits, target_logits.stride(0), draft_tokens, draft_probs,
        draft_probs.stride(0) if num_drafts else 0, uniforms, temperature, top_k, top_p,
        row_accepted, row_bonus, num_drafts, vocab_size, BLOCK_V=triton.next_power_of_2(vocab_size))
    round_outcome_kernel[(1,)](row_accepted, row_bonus, accepted, bonus, num_drafts,
                               BLOCK_K=triton.next_power_of_2(rows))


def fused_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 uniforms: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Same signature and result as `reference.fused_verify`: `(accepted, bonus)` 0-d int64."""
    device = target_logits.device
    if draft_probs is None:  # greedy callers may omit q; the kernel never reads it then
        draft_probs = torch.zeros(draft_tokens.shape[0], target_logits.shape[1], device=device)
    accepted = torch.empty((), dtype=torch.int64, device=device)
    bonus = torch.empty((), dtype=torch.int64, device=device)
    launch(target_logits.contiguous(), draft_tokens.to(torch.int64).contiguous(), draft_probs.contiguous(),
           uniforms.to(torch.float32).contiguous(), torch.tensor(temperature, dtype=torch.float32, device=device),
           torch.tensor(top_k, dtype=torch.int64, device=device),
           torch.tensor(top_p, dtype=torch.float32, device=device), accepted, bonus)
    return accepted, bonus
