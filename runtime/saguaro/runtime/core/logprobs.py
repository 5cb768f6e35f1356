"""The target's log-probability of each token a round commits, for requests that ask.

Verification keeps the target's logits inside the engine and lets only the outcome
`(accepted, bonus)` out; a request that asks for log-probabilities (tensorrtllm_backend's
`return_log_probs`, OpenAI's `logprobs`) also gets, for each committed token, its log
probability under the distribution verification used: the target's at the request's
temperature, top-k and top-p when sampling (what the output is distributed as), its plain
softmax when greedy (as TensorRT-LLM reports greedy log-probabilities). Row i of a
round's logits scores the i-th committed token: the accepted drafts, then the bonus.
`verified_on_host` makes a round's outcome, with them, from logits on the host.
"""
from __future__ import annotations

import torch

from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.plugins.probs import logits_to_probs
from saguaro.runtime.core.contracts import VerifyResult, VerifyStep
from saguaro.runtime.core.sampling import SamplingParams


def token_logprobs(logits: torch.Tensor, tokens: list[int], sampling: SamplingParams) -> tuple[float, ...]:
    """log p(tokens[i]) under row i of `logits` (`[>= len(tokens), V]`)."""
    rows = logits[:len(tokens)].float()
    if sampling.greedy:
        logp = torch.log_softmax(rows, dim=-1)
    else:
        logp = torch.log(logits_to_probs(rows, sampling.temperature, sampling.top_k, sampling.top_p))
    picked = logp[torch.arange(len(tokens), device=rows.device), torch.tensor(tokens, device=rows.device)]
    return tuple(float(value) for value in picked.cpu())


def committed_tokens(draft_tokens: torch.Tensor, accepted: int, bonus: int) -> list[int]:
    return [int(token) for token in draft_tokens[:accepted]] + [int(bonus)]


def verify_result(accepted: int, bonus: int, logits: torch.Tensor, step: VerifyStep,
                  hidden: torch.Tensor | None = None) -> VerifyResult:
    """A round's outcome, with the log-probabilities its `VerifyStep` asked for and, from
    a target with feature layers, the hidden states of its committed positions."""
    kept = None if hidden is None else hidden[:accepted + 1]
    if not step.logprobs:
        return VerifyResult(accepted, bonus, hidden=kept)
    return VerifyResult(accepted, bonus, token_logprobs(logits, committed_tokens(step.draft_tokens, accepted, bonus),
                                                       step.sampling), kept)


def verified_on_host(logits: torch.Tensor, step: VerifyStep, hidden: torch.Tensor | None = None) -> VerifyResult:
    """The outcome of `step` from its rows of target `logits`, by the reference op on the
    host (an engine whose graphs end at the logits; the prefill's first token)."""
    s = step.sampling
    accepted, bonus = fused_verify(logits, step.draft_tokens, step.draft_probs, step.uniforms,
                                   s.temperature, s.top_k, s.top_p)
    return verify_result(int(accepted), int(bonus), logits, step, hidden)
