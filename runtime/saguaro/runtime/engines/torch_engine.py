"""The eager PyTorch engine: the reference every compiled engine is tested against."""
from __future__ import annotations

from pathlib import Path

from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.runtime.checkpoint import load_checkpoint, tokenizer_fingerprint
from saguaro.runtime.contracts import EngineInfo, causal_mask
from saguaro.runtime.kv_cache import KVCache


class TorchEngine:
    """A Hugging Face Llama checkpoint run by `llama.Llama` over a `KVCache`."""

    def __init__(self, checkpoint_dir: str | Path):
        checkpoint = load_checkpoint(checkpoint_dir)
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.info = EngineInfo(
            backend="torch", path=str(checkpoint.path), vocab_size=checkpoint.shape.vocab_size,
            max_context=checkpoint.shape.max_position_embeddings,
            eos_token_ids=checkpoint.eos_token_ids, bos_token_id=checkpoint.bos_token_id,
            tokenizer_fingerprint=tokenizer_fingerprint(checkpoint.tokenizer))

    def new_cache(self, capacity: int) -> KVCache:
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
