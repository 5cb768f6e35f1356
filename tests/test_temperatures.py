"""Tiny temperatures decode greedily, in every place that would divide by T, and never
give NaN probabilities (1e-39 used to overflow the softmax, and inverse-CDF sampling
then returned token 0 for ever)."""
import math

import pytest
import torch
from test_plugin_onnx import run_verify, session
from verify_rounds import random_round

from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify import triton_kernel
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.plugins.probs import GREEDY_TEMPERATURE, logits_to_probs
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline

TINY = [1e-39, 1e-30, 1e-12, GREEDY_TEMPERATURE / 2, math.nextafter(GREEDY_TEMPERATURE, 0)]


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_logits_to_probs_refuses_a_greedy_temperature_by_name():
    with pytest.raises(ValueError, match=r"temperature 1e-39 is below"):
        logits_to_probs(torch.randn(5), 1e-39)


@pytest.mark.parametrize("logit_scale", [1.0, 1e3, 1e6])
def test_the_smallest_sampling_temperature_gives_finite_probabilities(logit_scale):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * logit_scale
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.9)]:
        probs = logits_to_probs(logits, GREEDY_TEMPERATURE, top_k, top_p)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def verify_forms():
    """Every form of FusedVerify, as `(logits, drafts, q, uniforms, T) -> (accepted, bonus)`."""
    onnx_session = session(verify_onnx.standalone_model())

    def reference(*args):
        return tuple(int(x) for x in fused_verify(*args))

    def kernel(*args):
        return tuple(int(x) for x in triton_kernel.fused_verify(*args))

    return {"reference": reference, "onnx": lambda *args: run_verify(onnx_session, *args), "triton": kernel}


@pytest.mark.parametrize("form", ["reference", "onnx", "triton"])
def test_every_verification_form_is_greedy_below_the_threshold(form):
    verify = verify_forms()[form]
    generator = torch.Generator().manual_seed(7)
    for k in (0, 1, 3):
        logits, drafts, q, uniforms = random_round(generator, k, 11, drafts_are_argmax=k == 3)
        greedy = tuple(int(x) for x in fused_verify(logits, drafts, None, uniforms, 0.0))
        for temperature in TINY[:3]:
            assert verify(logits, drafts, q, uniforms, temperature) == greedy, (form, k, temperature)
        # at the threshold itself (a power of two: float32 holds it) every form samples
        sampled = tuple(int(x) for x in fused_verify(logits, drafts, q, uniforms, GREEDY_TEMPERATURE))
        assert verify(logits, drafts, q, uniforms, GREEDY_TEMPERATURE) == sampled, (form, k)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_tiny_temperature_generates_the_greedy_text(backend, tiny_pair, tiny_engines):
    pipeline = (Pipeline.load(tiny_pair / "target", tiny_pair / "draft") if backend == "torch"
                else Pipeline.load(engines=tiny_engines))
    prompt = pipeline.encode("The with statement")
    try:
        for mode in ("autoregressive", "speculative", "ssd"):
            options = DecodeOptions(mode=mode, num_draft_tokens=3, max_tokens=16, eos_token_id=-1)
            greedy = pipeline.generate(prompt, options, SamplingParams()).output_ids
            tiny = pipeline.generate(prompt, options, SamplingParams(temperature=1e-39, seed=3)).output_ids
            assert tiny == greedy and set(tiny) != {0}, mode
    finally:
        pipeline.close()
