"""Sampling parameters (validated once, up front) and the draft's proposal distribution."""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace

import numpy as np
import torch

from saguaro.plugins.probs import is_greedy, logits_to_probs, saguaro_rescale, sample_from

UNSCORED = -1e9  # the logit of a token outside a draft's output vocabulary: probability 0
# An n-gram proposal's row: every other token's logit, probability 0 after any temperature,
# yet above `UNSCORED`, which would mark the columns as outside a reduced vocabulary, and a
# sampler reads those from a batch's first row: the rows of a pre-speculation step propose
# different tokens.
NOT_PROPOSED = -1e8


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy, and so does any temperature below
    `probs.GREEDY_TEMPERATURE` (it is stored as 0: every op and loop then sees greedy);
    top_k 0 and top_p 1 turn those filters off. A seed of None asks for a fresh one
    (`with_seed`), so unseeded requests differ from each other."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if is_greedy(self.temperature):
            object.__setattr__(self, "temperature", 0.0)
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    def with_seed(self) -> "SamplingParams":
        """These parameters with a seed: the given one, or a fresh random one (reported
        with the generation, so that it can be replayed)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))

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
        if not (isinstance(self.top, int) and self.top >= 1):
            raise ValueError(f"saguaro top must be an integer >= 1, got {self.top!r}")


def draft_distribution(logits: torch.Tensor, params: SamplingParams,
                       saguaro: SaguaroSampling | None = None) -> torch.Tensor:
    """The q the draft samples from (and that verification must use): `[..., V]`."""
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
    return saguaro_rescale(probs, saguaro.top, saguaro.factor) if saguaro else probs


def pick_tokens(logits: torch.Tensor, params: SamplingParams, saguaro: SaguaroSampling | None,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens for rows of logits, each to sit at `positions`: argmax when greedy, else
    sampled from q (returned) with the draft's keyed uniform for that position."""
    if params.greedy:
        return torch.argmax(logits, dim=-1), None
    assert params.seed is not None  # the loops sample with seeded parameters (`with_seed`)
    uniforms = keyed_uniforms(params.seed, DRAFT_STREAM, positions)
    scored = scored_columns(logits)
    if scored is None:
        q = draft_distribution(logits, params, saguaro)
        return sample_from(q, uniforms), q
    # a draft that scores part of the vocabulary: its distribution over those tokens alone,
    # in the vocabulary's order, then spread (q = 0 elsewhere, as the whole row gives it):
    # top-p over all 49,152 columns of SmolLM2's head, most of them a constant UNSCORED,
    # had been half of sampled pre-speculation's time
    q_scored = draft_distribution(logits[..., scored], params, saguaro)
    q = torch.zeros(logits.shape, dtype=q_scored.dtype).index_copy_(-1, scored, q_scored)
    return scored[sample_from(q_scored, uniforms)], q


def scored_columns(logits: torch.Tensor) -> torch.Tensor | None:
    """The columns a draft scores (ascending), where its logits leave some at `UNSCORED`
    (a reduced vocabulary); None when it scores every token."""
    scored = logits.reshape(-1, logits.shape[-1])[0] > UNSCORED
    return None if bool(scored.all()) else torch.nonzero(scored).flatten()


# Counter-based randomness: the uniform a sampling decision uses is a pure function of
# (request seed, purpose, absolute position). A draft token for position i is therefore
# drawn with the same uniform whether it was pre-speculated in a branch or drafted after a
# miss, so SSD gives speculative decoding's output for a seed, whatever the branch budget
# or thread timing, as far as the draft's q is the same in both: a branch's comes from a
# tree-masked forward, whose attention sums run over another cache layout and can differ
# in the last bits (docs/exactness.md counts the samples that moved). Each position's
# acceptance test and each round's bonus draw happen once; a draft
# uniform is reused only for positions whose earlier drafts never reached verification.
DRAFT_STREAM, ACCEPT_STREAM, BONUS_STREAM = 1, 2, 3
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def verification_uniforms(params: SamplingParams, draft_positions: torch.Tensor, first_new: int) -> torch.Tensor:
    """A round's K acceptance tests, keyed at the drafts' absolute positions, then its bonus
    draw, keyed at the position of the first token the round commits. Greedy verification
    draws nothing (zeros), and needs no seed."""
    if params.greedy:
        return torch.zeros(len(draft_positions) + 1)
    assert params.seed is not None  # the loops verify with seeded parameters (`with_seed`)
    return torch.cat((keyed_uniforms(params.seed, ACCEPT_STREAM, draft_positions),
                      keyed_uniforms(params.seed, BONUS_STREAM, [first_new])))


def keyed_uniforms(seed: int, stream: int, positions) -> torch.Tensor:
    """Uniforms in [0, 1), one per position, exact in float32 (24 random bits each)."""
    key = _splitmix64(np.array([(seed * 0xD1B54A32D192ED03 + stream) & _MASK64], dtype=np.uint64))
    counters = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    bits = _splitmix64(key ^ (counters * np.uint64(0x9E3779B97F4A7C15)))
    return torch.from_numpy((bits >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24))
