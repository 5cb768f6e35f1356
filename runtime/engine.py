"""The one protocol the decoding loops see, and its eager torch backend.

An engine runs one model over a KV cache it allocates: `forward` appends tokens at given
positions under an attention mask (causal when none is given; a tree mask for draft
branches) and returns their logits; `verify` runs the fused verification op on top of a
forward so that only the outcome `(accepted, bonus)` leaves the engine. Caches truncate
(roll back), gather (commit a branch) and fork. Backends: `torch` (this file),
`onnxruntime` and `tensorrt` (compiled engines, `runtime/engines/`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from plugins.branch_draft.reference import BranchPlan, plan_branches
from plugins.fused_verify.reference import fused_verify
from runtime.checkpoint import load_checkpoint, tokenizer_fingerprint
from runtime.sampling import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    path: str
    vocab_size: int
    max_context: int
    eos_token_id: int | None
    bos_token_id: int | None
    tokenizer_fingerprint: str
    # Limits a compiled engine was built for (None: no limit beyond max_context).
    max_draft_tokens: int | None = None
    max_branches: int | None = None


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


class TorchEngine:
    """Eager PyTorch reference engine over a Hugging Face Llama checkpoint."""

    def __init__(self, checkpoint_dir: str | Path):
        checkpoint = load_checkpoint(checkpoint_dir)
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.info = EngineInfo(
            backend="torch", path=str(checkpoint.path), vocab_size=checkpoint.shape.vocab_size,
            max_context=checkpoint.shape.max_position_embeddings,
            eos_token_id=checkpoint.eos_token_id, bos_token_id=checkpoint.bos_token_id,
            tokenizer_fingerprint=tokenizer_fingerprint(checkpoint.tokenizer))

    def new_cache(self, capacity: int):
        from runtime.llama import KVCache

        return KVCache(self.model.shape, capacity)

    def forward(self, cache, tokens, positions, mask=None):
        if mask is None:
            mask = causal_mask(cache.length, len(tokens))
        return self.model.forward_cached(cache, tokens, positions, mask)

    def verify(self, cache, tokens, positions, draft_tokens, draft_probs, uniforms, sampling):
        logits = self.forward(cache, tokens, positions)
        accepted, bonus = fused_verify(logits, draft_tokens, draft_probs, uniforms,
                                       sampling.temperature, sampling.top_k, sampling.top_p)
        return int(accepted), int(bonus)

    def plan_branches(self, scores, draft_tokens, fanout, context_length):
        return plan_branches(scores, draft_tokens, fanout, context_length)
