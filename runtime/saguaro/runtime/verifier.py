"""The target side: prefill, then one verification forward per round.

The target's cache holds every committed token but the last, so a round feeds
`[last, d_1..d_K]` (K+1 inputs, K+1 logits rows) at consecutive positions and keeps
`last, d_1..d_a` afterwards; the bonus token is the next round's `last`.
"""
from __future__ import annotations

import torch

from saguaro.runtime.contracts import Draft, VerifyResult
from saguaro.runtime.sampling import SamplingParams, verification_uniforms


class Verifier:
    def __init__(self, engine, prompt_ids: list[int], sampling: SamplingParams):
        self.engine, self.sampling = engine, sampling
        self.cache = engine.new_cache(engine.info.max_context)
        if len(prompt_ids) > 1:
            engine.forward(self.cache, torch.tensor(prompt_ids[:-1]), torch.arange(len(prompt_ids) - 1))

    def verify(self, ids: list[int], draft: Draft, num_tokens: int) -> VerifyResult:
        """Verify the first `num_tokens` drafts after the committed `ids`."""
        start = len(ids) - 1
        drafts = draft.tokens[:num_tokens]
        tokens = torch.cat((torch.tensor([ids[-1]]), drafts))
        positions = torch.arange(start, start + num_tokens + 1)
        first_new = len(ids)  # the position of the first token this round commits
        uniforms = verification_uniforms(self.sampling, positions[1:], first_new)
        probs = None if draft.probs is None else draft.probs[:num_tokens]
        accepted, bonus = self.engine.verify(self.cache, tokens, positions, drafts, probs,
                                             uniforms, self.sampling)
        self.cache.truncate(start + 1 + accepted)  # roll back the rejected drafts
        return VerifyResult(accepted, bonus)
