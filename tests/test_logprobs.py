"""Log-probabilities of the committed tokens come from the target's own distribution:
whichever round (accepted draft or bonus, hit or miss) committed a token, its reported
log-probability equals the one a plain forward of the target over the finished text gives
at that position, at the request's temperature, top-k and top-p (the raw softmax when
greedy)."""
from __future__ import annotations

import pytest
import torch

from saguaro.plugins.probs import logits_to_probs
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipeline(tiny_pair):
    return Pipeline.load(target=tiny_pair / "target", draft=tiny_pair / "draft")


def target_logprobs(pipeline, prompt: list[int], output: list[int], sampling: SamplingParams) -> list[float]:
    """What one forward of the target over prompt + output says of each output token."""
    engine = pipeline.target
    cache = engine.new_cache(len(prompt) + len(output) + 1)
    ids = prompt + output
    logits = engine.forward(cache, torch.tensor(ids), torch.arange(len(ids)))[len(prompt) - 1:-1]
    if sampling.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
    else:
        logp = torch.log(logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p))
    cache.release()
    return logp[torch.arange(len(output)), torch.tensor(output)].tolist()


@pytest.mark.parametrize("mode, k, sampling", [
    ("ssd", 4, SamplingParams()),
    ("speculative", 2, SamplingParams(temperature=0.8, top_k=20, seed=5)),
    ("ssd", 3, SamplingParams(temperature=1.0, top_p=0.9, seed=11)),
    ("autoregressive", 0, SamplingParams(temperature=0.7, seed=3)),
])
def test_reported_log_probabilities_are_the_targets(pipeline, mode, k, sampling):
    prompt = pipeline.encode("the with statement")
    logprobs: list[float] = []
    request = pipeline.request(prompt, DecodeOptions(mode=mode, num_draft_tokens=k, max_tokens=24, eos_token_id=-1),
                               sampling, logprobs=logprobs)
    generation = pipeline.generate_batch([request])[0]
    assert len(logprobs) == len(generation.output_ids) == 24
    assert generation.stats.rounds < 24 or k == 0  # drafts were accepted: not only bonus tokens
    expected = target_logprobs(pipeline, prompt, generation.output_ids, request.sampling)
    assert logprobs == pytest.approx(expected, abs=2e-4)


def test_without_a_list_nothing_is_computed_and_the_output_is_the_same(pipeline):
    prompt = pipeline.encode("lazy dog")
    options = DecodeOptions(max_tokens=12, eos_token_id=-1)
    plain = pipeline.generate(prompt, options, SamplingParams())
    logprobs: list[float] = []
    with_logprobs = pipeline.generate_batch([pipeline.request(prompt, options, SamplingParams(), logprobs=logprobs)])[0]
    assert plain.output_ids == with_logprobs.output_ids and len(logprobs) == 12
