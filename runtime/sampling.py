"""Sampling parameters (validated once, up front) and the draft's proposal distribution."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plugins.probs import logits_to_probs, saguaro_rescale, sample_from


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 turn those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SaguaroSampling:
    """Saguaro sampling: the draft scales its `top` most likely tokens by `factor`."""

    top: int
    factor: float

    def __post_init__(self):
        if not 0 < self.factor <= 1:
            raise ValueError(f"saguaro factor must be in (0, 1], got {self.factor!r}")


def draft_distribution(logits: torch.Tensor, params: SamplingParams,
                       saguaro: SaguaroSampling | None = None) -> torch.Tensor:
    """The q the draft samples from (and that verification must use): `[..., V]`."""
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
    return saguaro_rescale(probs, saguaro.top, saguaro.factor) if saguaro else probs


def pick_tokens(logits: torch.Tensor, params: SamplingParams, saguaro: SaguaroSampling | None,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens for rows of logits: argmax when greedy, else sampled from q (returned)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1), None
    q = draft_distribution(logits, params, saguaro)
    uniforms = torch.rand(q.shape[:-1], generator=generator)
    return sample_from(q, uniforms), q


# Odd 64-bit constant: the draft's stream for seed s is never the target's for any small seed.
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15


def seeded_generator(seed: int) -> torch.Generator:
    """The target's random stream for a request seed."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def draft_generator(seed: int) -> torch.Generator:
    """The draft's own stream. It runs on its own thread, so sharing the target's stream
    would make seeded runs depend on thread timing; offsetting the seed keeps the two
    streams apart, also across requests with neighbouring seeds."""
    return seeded_generator((seed + DRAFT_SEED_OFFSET) % 2**63)
