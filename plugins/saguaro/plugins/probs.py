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
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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
