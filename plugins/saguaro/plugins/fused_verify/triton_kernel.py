"""FusedVerify as OpenAI Triton kernels (the GPU implementation behind the TensorRT plugin).

Two launches, neither syncing with the host, so the op can sit inside an engine:

1. `row_outcome_kernel`, one program per row j of the K+1 target rows. Each row works
   out, on its own, whether d_j is accepted and which bonus token the round would end
   with if it stopped at row j (sampled from row j's residual with the bonus uniform).
2. `round_outcome_kernel`, one program: accepted = the first row not accepted, and the
   bonus is that row's candidate.

A program walks its row in tiles of `BLOCK_V` tokens (at most `MAX_BLOCK_V`), so the
kernel compiles in about a second for any vocabulary: one holding a whole row in
registers took 172 s to compile for sm_90 at a 16K block and longer at SmolLM2's 49K.
Sampling parameters are read from device memory, so greedy vs sampling and the top-k /
top-p filters are runtime branches, not recompilations.

Passes over the row (each a loop over its tiles): greedy takes one (the first maximum,
as torch.argmax). Sampling takes the maximum, the softmax's sum, then the residual's
mass and the inverse-CDF search; top-k and top-p add thresholds found by bisection over
the values' bit patterns (32 and 30 counting passes): keep x >= the k-th largest, and
keep p >= the smallest probability inside the nucleus (the largest set of top tokens
whose mass before each one is below top_p). This equals the reference except when
tokens tie exactly at the cut, where the reference keeps the ones its sort happens to
put first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from saguaro.plugins.probs import GREEDY_TEMPERATURE

GREEDY_BELOW = tl.constexpr(GREEDY_TEMPERATURE)  # below it: argmax, never a division by T
MAX_BLOCK_V = 4096  # tokens a program holds at once: 16 float32 registers a thread at 8 warps
ONE_KEY = tl.constexpr(0x3F800000)  # the order key (the bits) of 1.0: no probability lies above it


@triton.jit
def _order_key(x):
    """float32 -> int32 in the same order (x < y iff key(x) < key(y)); -0.0 sits just below 0.0."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V: tl.constexpr):
    """One tile of logits / temperature (-inf past the vocabulary), and where it lies."""
    offsets = start + tl.arange(0, BLOCK_V)
    in_vocab = offsets < vocab_size
    logits = tl.load(row_ptr + offsets, mask=in_vocab, other=float("-inf")).to(tl.float32)
    return logits / temperature, offsets, in_vocab


@triton.jit
def _argmax(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """The first index of the row's maximum."""
    best_value = tl.full((), float("-inf"), tl.float32)
    best_index = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab_size, BLOCK_V):
        values, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, 1.0, BLOCK_V)
        tile_best = tl.max(values, axis=0)
        tile_index = tl.argmax(values, axis=0).to(tl.int64) + start
        best_index = tl.where(tile_best > best_value, tile_index, best_index)
        best_value = tl.maximum(tile_best, best_value)
    return best_index


@triton.jit
def _kth_largest_key(row_ptr, vocab_size, temperature, top_k, BLOCK_V: tl.constexpr):
    """The order key of the top_k-th largest scaled logit: the largest key t with at least
    top_k values at or above it, by bisection over the 2^32 keys."""
    low = tl.full((), -2147483648, tl.int64)
    high = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        middle = (low + high + 1) // 2
        count = tl.zeros((), dtype=tl.int64)
        for start in range(0, vocab_size, BLOCK_V):
            scaled, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V)
            count += tl.sum((in_vocab & (_order_key(scaled) >= middle)).to(tl.int64), axis=0)
        enough = count >= top_k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    return low


@triton.jit
def _probs(scaled, in_vocab, top_k_key, maximum, total):
    """The tile's softmax probabilities after top-k (top_k_key: the lowest key kept)."""
    kept = in_vocab & (_order_key(scaled) >= top_k_key)
    return tl.where(kept, tl.exp(scaled - maximum) / total, 0.0)


@triton.jit
def _nucleus_key(row_ptr, vocab_size, temperature, top_k_key, maximum, total, top_p, BLOCK_V: tl.constexpr):
    """The order key of the smallest probability kept by top-p: the smallest key t whose
    mass strictly above it is below top_p, by bisection over the keys of [0, 1]."""
    low = tl.zeros((), dtype=tl.int64)
    high = tl.full((), ONE_KEY, tl.int64)
    for _ in range(30):
        middle = (low + high) // 2
        mass_above = tl.zeros((), dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            scaled, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V)
            probs = _probs(scaled, in_vocab, top_k_key, maximum, total)
            mass_above += tl.sum(tl.where(_order_key(probs) > middle, probs, 0.0), axis=0)
        below = mass_above < top_p
        high = tl.where(below, middle, high)
        low = tl.where(below, low, middle + 1)
    return high


@triton.jit
def _filtered(scaled, in_vocab, top_k_key, maximum, total, nucleus_key, kept_mass):
    """The tile's probabilities after top-k and top-p, renormalised."""
    probs = _probs(scaled, in_vocab, top_k_key, maximum, total)
    return tl.where(_order_key(probs) >= nucleus_key, probs / kept_mass, 0.0)


@triton.jit
def _softmax_after_top_k(row_ptr, vocab_size, temperature, top_k_ptr, BLOCK_V: tl.constexpr):
    """`(maximum, top_k_key, total)`: the scaled row's maximum, the lowest key top-k keeps
    (every key when top-k is off) and the softmax's sum over the kept tokens."""
    maximum = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        scaled, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V)
        maximum = tl.maximum(maximum, tl.max(scaled, axis=0))
    top_k = tl.load(top_k_ptr)
    top_k_key = tl.full((), -2147483648, tl.int64)
    if (top_k > 0) & (top_k < vocab_size):
        top_k_key = _kth_largest_key(row_ptr, vocab_size, temperature, top_k, BLOCK_V)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        scaled, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V)
        kept = in_vocab & (_order_key(scaled) >= top_k_key)
        total += tl.sum(tl.where(kept, tl.exp(scaled - maximum), 0.0), axis=0)
    return maximum, top_k_key, total


@triton.jit
def _top_p(row_ptr, vocab_size, temperature, top_k_key, maximum, total, top_p_ptr, BLOCK_V: tl.constexpr):
    """`(nucleus_key, kept_mass)`: the lowest key top-p keeps and the mass it keeps (every
    key and all of it when top-p is off)."""
    top_p = tl.load(top_p_ptr).to(tl.float32)
    nucleus_key = tl.zeros((), dtype=tl.int64)
    kept_mass = tl.full((), 1.0, tl.float32)
    if top_p < 1.0:
        nucleus_key = _nucleus_key(row_ptr, vocab_size, temperature, top_k_key, maximum, total, top_p, BLOCK_V)
        kept_mass = tl.zeros((), dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            scaled, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V)
            probs = _probs(scaled, in_vocab, top_k_key, maximum, total)
            kept_mass += tl.sum(tl.where(_order_key(probs) >= nucleus_key, probs, 0.0), axis=0)
    return nucleus_key, kept_mass


@triton.jit
def _p_and_q(row_ptr, q_ptr, q_length, start, vocab_size, temperature, top_k_key, maximum, total,
             nucleus_key, kept_mass, BLOCK_V: tl.constexpr):
    """One tile of the target's filtered probabilities p and the draft's q (0 past `q_length`)."""
    scaled, offsets, in_vocab = _scaled(row_ptr, start, vocab_size, temperature, BLOCK_V)
    probs = _filtered(scaled, in_vocab, top_k_key, maximum, total, nucleus_key, kept_mass)
    q = tl.load(q_ptr + offsets, mask=offsets < q_length, other=0.0).to(tl.float32)
    return probs, q, offsets, in_vocab


@triton.jit
def _sampled_outcome(row_ptr, q_ptr, q_length, draft, u_accept, u_bonus, vocab_size, temperature,
                     top_k_ptr, top_p_ptr, BLOCK_V: tl.constexpr):
    """`(accepted, bonus)` of a sampled row: d_j accepted with probability min(1, p/q), and
    the bonus drawn by inverse CDF from the residual max(p - q, 0) (p where that has no mass)."""
    maximum, top_k_key, total = _softmax_after_top_k(row_ptr, vocab_size, temperature, top_k_ptr, BLOCK_V)
    nucleus_key, kept_mass = _top_p(row_ptr, vocab_size, temperature, top_k_key, maximum, total, top_p_ptr,
                                    BLOCK_V)
    p_draft = tl.zeros((), dtype=tl.float32)
    q_draft = tl.zeros((), dtype=tl.float32)
    p_mass = tl.zeros((), dtype=tl.float32)
    residual_mass = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        probs, q, offsets, in_vocab = _p_and_q(row_ptr, q_ptr, q_length, start, vocab_size, temperature,
                                               top_k_key, maximum, total, nucleus_key, kept_mass, BLOCK_V)
        p_draft += tl.sum(tl.where(offsets == draft, probs, 0.0), axis=0)
        q_draft += tl.sum(tl.where(offsets == draft, q, 0.0), axis=0)
        p_mass += tl.sum(probs, axis=0)
        residual_mass += tl.sum(tl.maximum(probs - q, 0.0), axis=0)
    # the bonus: how many tokens' cumulative mass stays at or below u * total
    empty = residual_mass <= 0
    threshold = u_bonus * tl.where(empty, p_mass, residual_mass)
    cumulative = tl.zeros((), dtype=tl.float32)
    below = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab_size, BLOCK_V):
        probs, q, offsets, in_vocab = _p_and_q(row_ptr, q_ptr, q_length, start, vocab_size, temperature,
                                               top_k_key, maximum, total, nucleus_key, kept_mass, BLOCK_V)
        mass = tl.where(empty, probs, tl.maximum(probs - q, 0.0))
        cdf = cumulative + tl.cumsum(mass, axis=0)
        below += tl.sum(((cdf <= threshold) & in_vocab).to(tl.int64), axis=0)
        cumulative += tl.sum(mass, axis=0)
    return u_accept * q_draft < p_draft, tl.minimum(below, vocab_size - 1)


@triton.jit
def row_outcome_kernel(logits_ptr, logits_row_stride, draft_tokens_ptr, draft_probs_ptr,
                       draft_probs_row_stride, uniforms_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
                       row_accepted_ptr, row_bonus_ptr, num_drafts, vocab_size,
                       BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row * logits_row_stride
    has_draft = row < num_drafts
    draft = tl.load(draft_tokens_ptr + row, mask=has_draft, other=-1)
    temperature = tl.load(temperature_ptr).to(tl.float32)
    if temperature < GREEDY_BELOW:
        choice = _argmax(row_ptr, vocab_size, BLOCK_V)
        accepted = choice == draft
        bonus = choice
    else:
        # row K has no draft: q is the zero row, so its residual is p itself
        accepted, bonus = _sampled_outcome(
            row_ptr, draft_probs_ptr + row * draft_probs_row_stride, tl.where(has_draft, vocab_size, 0), draft,
            tl.load(uniforms_ptr + row, mask=has_draft, other=1.0), tl.load(uniforms_ptr + num_drafts),
            vocab_size, temperature, top_k_ptr, top_p_ptr, BLOCK_V)
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
        row_accepted, row_bonus, num_drafts, vocab_size,
        BLOCK_V=min(triton.next_power_of_2(vocab_size), MAX_BLOCK_V))
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
