"""The eager PyTorch engine: the reference every compiled engine is tested against."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.runtime.checkpoint import load_checkpoint, tokenizer_fingerprint
from saguaro.runtime.contracts import EngineInfo, EngineLimits, OneSequenceForms, Step, VerifyResult, VerifyStep
from saguaro.runtime.engines.batching import pack_steps
from saguaro.runtime.kv_cache import KVPool, PooledCache
from saguaro.runtime.logprobs import verify_result

# What a checkpoint run eagerly is sized for (a compiled engine's come from its build).
DEFAULT_LIMITS = dict(max_draft_tokens=8, max_branches=32, max_batch=8)
DEFAULT_MAX_CONTEXT = 4096  # or the model's own, if shorter: it bounds every KV slot (zeroed lazily by the OS)


class TorchEngine(OneSequenceForms):
    """A Hugging Face Llama checkpoint run by `llama.Llama` over a pool of KV slots."""

    def __init__(self, checkpoint_dir: str | Path, max_context: int | None = None, max_batch: int | None = None):
        checkpoint = load_checkpoint(checkpoint_dir)
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        shape = checkpoint.shape
        context = min(max_context or DEFAULT_MAX_CONTEXT, shape.max_position_embeddings)
        limits = EngineLimits(max_context=context, **{**DEFAULT_LIMITS, "max_batch": max_batch or DEFAULT_LIMITS["max_batch"]})
        self.info = EngineInfo(
            backend="torch", path=str(checkpoint.path), vocab_size=shape.vocab_size, max_context=context,
            eos_token_ids=checkpoint.eos_token_ids, bos_token_id=checkpoint.bos_token_id,
            tokenizer_fingerprint=tokenizer_fingerprint(checkpoint.tokenizer), limits=limits)
        self.pool = KVPool(*shape.kv_shape, limits.max_batch, limits.max_cache_entries)

    def new_cache(self, capacity: int) -> PooledCache:
        return self.pool.allocate(capacity)

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        """Each step runs as a forward of its own. torch's matrix kernels pick their
        summation order by the number of rows, and attention over a padded batch sums
        over the padded width, so in one batched forward a sequence's logits would depend
        on the sequences sharing it; alone, they depend on its own tokens only."""
        return [self._forward_one(step) for step in steps]

    def _forward_one(self, step: Step) -> torch.Tensor:
        packed = pack_steps([step])
        past = torch.from_numpy(packed.seqlens_k + 1 - packed.query_seqlens)
        slot = slice(packed.first_slot, packed.first_slot + 1)
        logits, _ = self.model.forward_packed(self.pool.tensor[:, :, slot], torch.from_numpy(packed.input_ids),
                                           torch.from_numpy(packed.position_ids), past,
                                           torch.from_numpy(packed.query_seqlens),
                                           torch.from_numpy(packed.attention_mask))
        step.cache.length += len(step.tokens)
        return logits[0]

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        rows = self.forward_batch([item.step for item in steps])
        outcomes = []
        for logits, item in zip(rows, steps):
            s = item.sampling
            accepted, bonus = fused_verify(logits, item.draft_tokens, item.draft_probs, item.uniforms,
                                           s.temperature, s.top_k, s.top_p)
            outcomes.append(verify_result(int(accepted), int(bonus), logits, item))
        return outcomes

    def plan_branches(self, scores, draft_tokens, fanout, context_length):
        return plan_branches(scores, draft_tokens, fanout, context_length)
