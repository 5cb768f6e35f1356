"""The eager PyTorch engines: a checkpoint (`TorchEngine`, the reference every compiled
engine is tested against) and a feature draft over a target checkpoint (`TorchFeatureDraft`)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.runtime.models.checkpoint import load_checkpoint, measured_acceptance, tokenizer_fingerprint
from saguaro.runtime.core.contracts import (
    BUILD_DEFAULT_LIMITS,
    EngineInfo,
    EngineLimits,
    OneSequenceForms,
    Rows,
    Step,
    VerifyResult,
    VerifyStep,
)
from saguaro.runtime.engines.batching import pack_steps
from saguaro.runtime.models.feature_head import is_feature_head, load_feature_head
from saguaro.runtime.engines.kv_cache import KVPool, PooledCache
from saguaro.runtime.core.logprobs import verified_on_host

# What a checkpoint run eagerly is sized for (a compiled engine's come from its build).
# An eager engine compiles nothing, so it has no built maximum; these bounds only size its
# caches: a build's defaults, with twice its branches, so that fan-outs over any K up to 8
# fit without a build.
DEFAULT_LIMITS = dict(max_draft_tokens=BUILD_DEFAULT_LIMITS.max_draft_tokens,
                      max_branches=2 * BUILD_DEFAULT_LIMITS.max_branches, max_batch=BUILD_DEFAULT_LIMITS.max_batch)
DEFAULT_MAX_CONTEXT = 4096  # or the model's own, if shorter: it bounds every KV slot (zeroed lazily by the OS)


def forward_alone(pool: KVPool, step: Step, forward) -> Rows:
    """One step as a forward of its own over its pool slot: `forward(kv, tokens, positions,
    past, counts, mask)` returns logits and hidden states (or None) with a batch axis."""
    packed = pack_steps([step])
    past = torch.from_numpy(packed.seqlens_k + 1 - packed.query_seqlens)
    slot = slice(packed.first_slot, packed.first_slot + 1)
    logits, hidden = forward(pool.tensor[:, :, slot], torch.from_numpy(packed.input_ids),
                             torch.from_numpy(packed.position_ids), past, torch.from_numpy(packed.query_seqlens),
                             torch.from_numpy(packed.attention_mask))
    step.cache.length += len(step.tokens)
    return Rows(logits[0], None if hidden is None else hidden[0])


class TorchEngine(OneSequenceForms):
    """A Hugging Face Llama checkpoint run by `llama.Llama` over a pool of KV slots; with
    `feature_layers`, its rows carry those layers' hidden states for a feature draft."""

    def __init__(self, checkpoint_dir: str | Path, max_context: int | None = None, max_batch: int | None = None,
                 feature_layers: tuple[int, ...] = ()):
        checkpoint = load_checkpoint(checkpoint_dir)
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        shape = checkpoint.shape
        context = min(max_context or DEFAULT_MAX_CONTEXT, shape.max_position_embeddings)
        limits = EngineLimits(max_context=context, **{**DEFAULT_LIMITS, "max_batch": max_batch or DEFAULT_LIMITS["max_batch"]})
        self.info = EngineInfo(
            backend="torch", path=str(checkpoint.path), vocab_size=shape.vocab_size, max_context=context,
            eos_token_ids=checkpoint.eos_token_ids, bos_token_id=checkpoint.bos_token_id,
            tokenizer_fingerprint=tokenizer_fingerprint(checkpoint.tokenizer), limits=limits,
            feature_layers=tuple(feature_layers))
        self.pool = KVPool(*shape.kv_shape, limits.max_batch, limits.max_cache_entries)

    def new_cache(self, capacity: int) -> PooledCache:
        return self.pool.allocate(capacity)

    def return_features(self, layers: tuple[int, ...]) -> None:
        """From now on, rows carry these layers' hidden states (for a feature draft)."""
        self.info = replace(self.info, feature_layers=tuple(layers))

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        return [rows.logits for rows in self.forward_rows(steps)]

    def forward_rows(self, steps: Sequence[Step]) -> list[Rows]:
        """Each step runs as a forward of its own. torch's matrix kernels pick their
        summation order by the number of rows, and attention over a padded batch sums
        over the padded width, so in one batched forward a sequence's logits would depend
        on the sequences sharing it; alone, they depend on its own tokens only."""
        layers = self.info.feature_layers

        def forward(kv, tokens, positions, past, counts, mask):
            return self.model.forward_packed(kv, tokens, positions, past, counts, mask, layers)
        return [forward_alone(self.pool, step, forward) for step in steps]

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        return [verified_on_host(rows.logits, item, rows.hidden)
                for rows, item in zip(self.forward_rows([item.step for item in steps]), steps)]

    def plan_branches(self, scores, draft_tokens, fanout, context_length):
        return plan_branches(scores, draft_tokens, fanout, context_length)


def torch_draft(draft_dir: str | Path, target: TorchEngine):
    """The draft in `draft_dir` for `target`: a feature draft (an EAGLE-3 head) or a
    checkpoint, with the acceptance its folder's report measured."""
    draft = TorchFeatureDraft(draft_dir, target) if is_feature_head(draft_dir) else TorchEngine(draft_dir)
    draft.info = replace(draft.info, acceptance=measured_acceptance(draft_dir))
    return draft


class TorchFeatureDraft(OneSequenceForms):
    """A feature draft (an EAGLE-3 head, `feature_head`) for `target`, a `TorchEngine`,
    which from then on returns the head's feature layers with its rows. The head shares
    the target's embeddings and tokenizer, and reads the target's features, projected
    (`project`), or its own predictions."""

    def __init__(self, head_dir: str | Path, target: TorchEngine):
        self.head = load_feature_head(head_dir, target.model.shape, target.model.model.embed_tokens.weight)
        target.return_features(self.head.shape.feature_layers)
        self.tokenizer = target.tokenizer
        self.hidden_size = self.head.shape.hidden_size  # of the features it reads
        self.info = replace(target.info, path=str(head_dir), feature_layers=(), reads_features=True)
        limits = self.info.limits
        assert limits is not None  # a `TorchEngine`'s info always has them
        self.pool = KVPool(*self.head.shape.kv_shape, limits.max_batch, limits.max_cache_entries)

    def new_cache(self, capacity: int) -> PooledCache:
        return self.pool.allocate(capacity)

    @torch.inference_mode()
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features `[n, feature_width]` as the head reads them `[n, hidden]`."""
        return self.head.project(features)

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        return [rows.logits for rows in self.forward_rows(steps)]

    def forward_rows(self, steps: Sequence[Step]) -> list[Rows]:
        """Each step alone, as the target's; rows carry the head's own predicted features."""
        return [forward_alone(self.pool, step, self._forward(step)) for step in steps]

    def _forward(self, step: Step):
        hidden = step.hidden
        if hidden is None:  # a step that brings no features (a calibration forward)
            hidden = torch.zeros(len(step.tokens), self.head.shape.hidden_size)
        return lambda kv, tokens, positions, *rest: self.head.forward_packed(kv, tokens, hidden[None], positions,
                                                                             *rest)

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        raise TypeError("a feature draft drafts for its target; it does not verify")

    def plan_branches(self, scores, draft_tokens, fanout, context_length):
        return plan_branches(scores, draft_tokens, fanout, context_length)
