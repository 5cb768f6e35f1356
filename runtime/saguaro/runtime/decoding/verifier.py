"""The target side of one sequence: prefill, which scores the first token, then one
verification step per round.

The target's cache holds every committed token but the last, so a round feeds
`[last, d_1..d_K]` (K+1 inputs, K+1 logits rows) at consecutive positions and keeps
`last, d_1..d_a` afterwards; the bonus token is the next round's `last`. The prefill feeds
the whole prompt and its last row scores the first token (as TensorRT-LLM's context phase
and vLLM's prefill do), drawn as a round without drafts draws its bonus: the first token
goes out with the prefill, not a round later.
"""
from __future__ import annotations

import numpy as np
import torch

from saguaro.runtime.core.contracts import Draft, Step, VerifyResult, VerifyStep, target_cache_capacity
from saguaro.runtime.core.logprobs import verified_on_host
from saguaro.runtime.core.sampling import SamplingParams, verification_uniforms

# never written: a round's drafts and uniforms are read only
NO_DRAFTS, GREEDY_UNIFORMS = torch.empty(0, dtype=torch.int64), torch.zeros(1)


class Verifier:

    def __init__(self, engine, sampling: SamplingParams, num_draft_tokens: int):
        self.sampling = sampling
        self.cache = engine.new_cache(target_cache_capacity(engine.info.max_context, num_draft_tokens))
        # a round without drafts feeds `[last]` at one position: tensors kept from round to
        # round, written through numpy views (`_undrafted`)
        self._last_view, self._position_view = np.zeros(1, np.int64), np.zeros(1, np.int64)
        self._last, self._position = torch.from_numpy(self._last_view), torch.from_numpy(self._position_view)

    def prefill(self, prompt_ids: list[int]) -> Step:
        """The prompt's forward: its KV entries, a feature draft's features, and its last
        row's logits, which score the first token (`first_token`)."""
        return Step(self.cache, torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), last_only=True)

    def first_token(self, prompt_ids: list[int], no_draft: Draft, logits: torch.Tensor,
                    logprobs: bool = False) -> VerifyResult:
        """The first token from the prefill's last row of `logits`: the bonus of a round
        that verifies no drafts, with that round's uniform (keyed at the token's position),
        so it is the token a one-token forward of the prompt's last token would have given."""
        return verified_on_host(logits[-1:].float(), self.round(prompt_ids, no_draft, 0, logprobs))

    def round(self, ids: list[int], draft: Draft, num_tokens: int, logprobs: bool = False) -> VerifyStep:
        """Verification of the first `num_tokens` drafts after the committed `ids`
        (`logprobs`: the target's log-probabilities of the committed tokens too)."""
        if not num_tokens and self.sampling.greedy:
            return self._undrafted(ids, logprobs)
        start = len(ids) - 1
        drafts = draft.tokens[:num_tokens]
        tokens = torch.tensor([ids[-1], *drafts.tolist()])  # one small tensor: a cat costs twice as much
        positions = torch.arange(start, start + num_tokens + 1)
        uniforms = verification_uniforms(self.sampling, positions[1:], first_new=len(ids))
        probs = None if draft.probs is None else draft.probs[:num_tokens]
        return VerifyStep(Step(self.cache, tokens, positions), drafts, probs, uniforms, self.sampling, logprobs)

    def _undrafted(self, ids: list[int], logprobs: bool) -> VerifyStep:
        """A greedy round with no drafts (an autoregressive step) without a torch call: each
        releases the GIL and waits to take it back, and in the server, beside the threads
        that send responses, building these tensors anew (four calls) had cost the
        scheduler's thread more than the batch's forward at 16 streams. The step is used
        within its round (packed into the batch's arrays) and not kept."""
        self._last_view[0], self._position_view[0] = ids[-1], len(ids) - 1
        step = Step(self.cache, self._last, self._position)
        return VerifyStep(step, NO_DRAFTS, None, GREEDY_UNIFORMS, self.sampling, logprobs)

    def keep(self, ids: list[int], outcome: VerifyResult) -> None:
        self.cache.truncate(len(ids) + outcome.accepted)  # roll back the rejected drafts
