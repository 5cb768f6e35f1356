"""The contracts between the decoding loops and the engines under them, in one place.

An engine runs one model over a KV cache it allocates: `forward` appends tokens at given
positions under an attention mask (causal when none is given; a tree mask for draft
branches) and returns their logits; `verify` runs the fused verification op on top of a
forward so that only the outcome `(accepted, bonus)` leaves the engine; `plan_branches`
runs the branch-keyed drafting op. Caches truncate (roll back), gather (commit a branch)
and fork. Implementations: `engines/torch_engine.py` (eager reference),
`engines/onnxruntime_engine.py` and `engines/tensorrt_engine.py` (compiled engines).

The loops exchange small result records: a `Draft` (K proposed tokens), a `VerifyResult`
(the round's outcome) and a `SpeculationCache` (pre-speculated drafts keyed by outcome).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from saguaro.plugins.branch_draft.reference import BranchPlan
from saguaro.runtime.sampling import SamplingParams


def draft_cache_capacity(max_context: int, max_branches: int, num_draft_tokens: int) -> int:
    """KV entries a draft cache needs: the context, then a round's speculation window (the
    K drafts, the last fed by the glue forward, and K steps of each of `max_branches`
    branches; none without pre-speculation), plus one spare entry."""
    return max_context + (max_branches + 1) * num_draft_tokens + 1


@dataclass(frozen=True)
class EngineLimits:
    """What compiled engines were built for; larger requests fail with these numbers named."""

    max_draft_tokens: int
    max_branches: int
    max_context: int
    max_batch: int

    @property
    def max_cache_entries(self) -> int:
        return draft_cache_capacity(self.max_context, self.max_branches, self.max_draft_tokens)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "EngineLimits":
        build = manifest["build"]
        return cls(build["max_draft_tokens"], build["max_branches"], build["max_context"], build["max_batch"])


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    path: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]  # generation stops at any of them (e.g. end of turn, end of text)
    bos_token_id: int | None
    tokenizer_fingerprint: str
    limits: EngineLimits | None = None  # None: no limit beyond max_context (torch engines)

    @property
    def eos_token_id(self) -> int | None:
        """The first (main) end-of-generation token."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_draft_tokens(self) -> int | None:
        return None if self.limits is None else self.limits.max_draft_tokens

    @property
    def max_branches(self) -> int | None:
        return None if self.limits is None else self.limits.max_branches


class Cache(Protocol):
    length: int

    @property
    def capacity(self) -> int: ...
    def truncate(self, length: int) -> None: ...
    def gather(self, start: int, source_indices: torch.Tensor) -> None: ...
    def fork(self) -> "Cache": ...


class Engine(Protocol):
    info: EngineInfo
    tokenizer: object

    def new_cache(self, capacity: int) -> Cache: ...

    def forward(self, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor: ...

    def verify(self, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor,
               draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
               uniforms: torch.Tensor, sampling: SamplingParams) -> tuple[int, int]: ...

    def plan_branches(self, scores: torch.Tensor, draft_tokens: torch.Tensor,
                      fanout: torch.Tensor, context_length: int) -> BranchPlan: ...


def causal_mask(past: int, count: int) -> torch.Tensor:
    """`[count, past + count]`: new token i sees the past and new tokens 0..i."""
    return torch.ones(count, past + count, dtype=torch.bool).tril(diagonal=past)


@dataclass
class Draft:
    """K proposed tokens, the q each was sampled from (None when greedy), and the draft's
    logits at each of their positions (what branch keys are ranked by)."""

    tokens: torch.Tensor         # [K] int64
    probs: torch.Tensor | None   # [K, V]
    logits: torch.Tensor         # [K, V]

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class VerifyResult:
    """A round's outcome: `accepted` drafts (0..K), then the target's `bonus` token."""

    accepted: int
    bonus: int


@dataclass
class SpeculationCache:
    """Pre-speculated drafts keyed by outcome `(accepted, bonus)`; `scores` `[K+1, V]` are
    the logits the keys were ranked by (the round's draft logits plus the glue row)."""

    keys: dict[tuple[int, int], int]  # (j, t) -> branch index
    drafts: list[Draft]
    scores: torch.Tensor
    context_length: int
    seconds: float = 0.0  # how long pre-speculating it took

    def lookup(self, accepted: int, bonus: int) -> int | None:
        return self.keys.get((accepted, bonus))
