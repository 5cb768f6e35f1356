"""The q that verification uses is, bit for bit, the q the draft sampled its token from.

Losslessness rests on it: the acceptance test min(1, p/q) and the residual max(p - q, 0)
must use the very distribution the draft token was drawn from. A q rounded on its way
(to bfloat16, say) biases the output by about its rounding, which no chi-square of a few
thousand samples sees. So this records every distribution the draft samples from, and
every (draft token, q row) that reaches the verification op inside each engine, and
requires each of the latter to be one of the former exactly.
"""
from collections import defaultdict

import pytest
import torch

from saguaro.runtime.core import logprobs, sampling
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline

RUNS = [  # options, sampling: filters, Saguaro rescaling, branch hits and misses
    (dict(mode="speculative", num_draft_tokens=3), SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=2)),
    (dict(mode="ssd", num_draft_tokens=4, fanout=(3,), saguaro_factor=0.5), SamplingParams(temperature=0.8, seed=5)),
    (dict(mode="ssd", num_draft_tokens=2, budget=6), SamplingParams(temperature=1.1, top_p=0.8, seed=8)),
]


class RecordingSession:
    """Stands in front of an engine's fused_verify session and keeps what it is fed."""

    def __init__(self, session, verified):
        self.session, self.verified = session, verified

    def run(self, outputs, feeds):
        self.verified.extend(zip(torch.from_numpy(feeds["draft_tokens"]).tolist(),
                                 torch.from_numpy(feeds["draft_probs"].copy())))
        return self.session.run(outputs, feeds)


@pytest.fixture(params=["torch", "onnxruntime"])
def recorded(request, monkeypatch, tiny_pair, tiny_engines):
    """A pipeline whose draft distributions (token -> q rows sampled from) and verified
    (token, q row) pairs are recorded."""
    pipeline = (Pipeline.load(tiny_pair / "target", tiny_pair / "draft") if request.param == "torch"
                else Pipeline.load(engines=tiny_engines))
    sampled, verified = defaultdict(list), []
    draw = sampling.sample_from

    def recording_draw(probs, uniforms):
        tokens = draw(probs, uniforms)
        for row, token in zip(probs.reshape(-1, probs.shape[-1]), tokens.reshape(-1).tolist()):
            sampled[token].append(row.clone())
        return tokens

    monkeypatch.setattr(sampling, "sample_from", recording_draw)
    if request.param == "torch":
        verify = logprobs.fused_verify  # the torch engine verifies on the host (`verified_on_host`)

        def recording_verify(logits, draft_tokens, draft_probs, *rest):
            if draft_probs is not None:
                verified.extend(zip(draft_tokens.tolist(), draft_probs.clone()))
            return verify(logits, draft_tokens, draft_probs, *rest)

        monkeypatch.setattr(logprobs, "fused_verify", recording_verify)
    else:
        sessions = pipeline.target.sessions
        sessions["fused_verify"] = RecordingSession(sessions["fused_verify"], verified)
    yield pipeline, sampled, verified
    pipeline.close()


def test_verification_uses_exactly_the_q_each_draft_was_sampled_from(recorded):
    pipeline, sampled, verified = recorded
    prompt = pipeline.encode("The with statement")
    hits = 0
    for options, params in RUNS:
        generation = pipeline.generate(prompt, DecodeOptions(**options, max_tokens=40, eos_token_id=-1), params)
        hits += generation.stats.cache_hits
    assert len(verified) > 50 and hits > 0, "the runs must verify drafts, pre-speculated ones among them"
    strangers = [token for token, q in verified if not any(torch.equal(q, row) for row in sampled[token])]
    assert not strangers, f"{len(strangers)} of {len(verified)} verified drafts carry a q they were not drawn from"
