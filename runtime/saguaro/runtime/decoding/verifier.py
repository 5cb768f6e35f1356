"""The target side of one sequence: prefill, then one verification step per round.

The target's cache holds every committed token but the last, so a round feeds
`[last, d_1..d_K]` (K+1 inputs, K+1 logits rows) at consecutive positions and keeps
`last, d_1..d_a` afterwards; the bonus token is the next round's `last`.
"""
from __future__ import annotations

import torch

from saguaro.runtime.core.contracts import Draft, Step, VerifyResult, VerifyStep, target_cache_capacity
from saguaro.runtime.core.sampling import SamplingParams, verification_uniforms


class Verifier:

    def __init__(self, engine, sampling: SamplingParams, num_draft_tokens: int):
        self.sampling = sampling
        self.cache = engine.new_cache(target_cache_capacity(engine.info.max_context, num_draft_tokens))

    def prefill(self, prompt_ids: list[int]) -> Step | None:
        if len(prompt_ids) < 2:
            return None
        # kept for its KV entries (and a feature draft's features): no logits are read
        return Step(self.cache, torch.tensor(prompt_ids[:-1]), torch.arange(len(prompt_ids) - 1), last_only=True)

    def round(self, ids: list[int], draft: Draft, num_tokens: int, logprobs: bool = False) -> VerifyStep:
        """Verification of the first `num_tokens` drafts after the committed `ids`
        (`logprobs`: the target's log-probabilities of the committed tokens too)."""
        start = len(ids) - 1
        drafts = draft.tokens[:num_tokens]
        tokens = torch.tensor([ids[-1], *drafts.tolist()])  # one small tensor: a cat costs twice as much
        positions = torch.arange(start, start + num_tokens + 1)
        uniforms = verification_uniforms(self.sampling, positions[1:], first_new=len(ids))
        probs = None if draft.probs is None else draft.probs[:num_tokens]
        return VerifyStep(Step(self.cache, tokens, positions), drafts, probs, uniforms, self.sampling, logprobs)

    def keep(self, ids: list[int], outcome: VerifyResult) -> None:
        self.cache.truncate(len(ids) + outcome.accepted)  # roll back the rejected drafts
