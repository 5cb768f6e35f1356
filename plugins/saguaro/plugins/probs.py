"""Sampling math shared by every op and decoding loop: one definition of each rule.

All sampling is by inverse CDF from explicit uniforms, so a compiled graph or a GPU kernel
given the same uniforms picks the same token as this reference.
"""
from __future__ import annotations

import torch

# Temperatures below this decode greedily (argmax), in every op and loop, as in vLLM:
# dividing logits by a smaller one overflows float32 (1e-39 gives inf, a NaN softmax, and
# inverse-CDF sampling then picks token 0 forever). From it upwards the division stays
# finite for any logit below 3e33, and the distribution is as sharp as float32 can hold.
# A power of two, so a float64 and a float32 comparison with it agree.
GREEDY_TEMPERATURE = 2.0 ** -17  # 7.63e-06
# Top-p sorts the 256 most likely tokens, then 4096, then all, until the sorted ones hold
# top_p of the mass: a sort of SmolLM2's 49,152 took 3.5-5 ms a row on this project's CPU
# against 0.1-0.2 ms for the first 256, which hold a 0.95 nucleus in 89% of its rows of
# chat and prose at T = 0.7 (4096: all of them at 0.7, 94% at T = 1).
NUCLEUS_WIDTHS = (256, 4096)


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_TEMPERATURE


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) over the last axis. A temperature
    below `GREEDY_TEMPERATURE` has no distribution here (greedy decoding takes argmax)."""
    if is_greedy(temperature):
        raise ValueError(f"temperature {temperature!r} is below {GREEDY_TEMPERATURE:.3g}, which decodes greedily: "
                         "no distribution to sample from")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return top_p_filter(probs, top_p) if top_p < 1.0 else probs


def nucleus_widths(vocab_size: int) -> list[int]:
    """How many of the most likely tokens top-p sorts, widest last (the whole vocabulary)."""
    return [width for width in NUCLEUS_WIDTHS if width < vocab_size] + [vocab_size]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of the tokens by probability whose mass reaches top_p (the
    token crossing it included), renormalised. Only the head of each row is sorted: when
    the first `width` tokens hold top_p of the mass, every token after them falls outside
    the nucleus, and the cumulative sums of the head are those of the full sort."""
    for width in nucleus_widths(probs.shape[-1]):
        sorted_probs, order = torch.topk(probs, width, dim=-1)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        if bool((cumulative[..., -1] >= top_p).all()):
            break
    kept = sorted_probs.masked_fill(cumulative - sorted_probs >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, kept)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling per row: the first index whose cumulative mass exceeds u * total.

    `probs` `[..., V]` need not be normalised; `uniforms` `[...]` in [0, 1).
    """
    cdf = torch.cumsum(probs, dim=-1)
    threshold = uniforms.unsqueeze(-1) * cdf[..., -1:]
    index = (cdf <= threshold).sum(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def saguaro_rescale(probs: torch.Tensor, top: int, factor: float) -> torch.Tensor:
    """Saguaro sampling: scale the draft's `top` most likely tokens by `factor`, renormalise.

    The rescaled q is both the draft's sampling distribution and the q used in
    verification, so decoding stays lossless; `factor` < 1 moves residual mass
    max(p - q, 0) onto those tokens, so bonus tokens land on cached branch keys more often.
    """
    top = min(top, probs.shape[-1])
    top_index = torch.topk(probs, top, dim=-1).indices
    scale = torch.ones_like(probs).scatter(-1, top_index, factor)
    scaled = probs * scale
    return scaled / scaled.sum(-1, keepdim=True)
