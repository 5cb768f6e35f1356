"""The tensorrt_llm target: SSD's draft side as the user drafter of a TensorRT-LLM `LLM`.

On CPU the `LLM` is a stand-in (`fake_tensorrt_llm.py`) with TensorRT-LLM's calling
sequence and acceptance rules around a torch target; the draft is a real ONNX Runtime
engine from a real `backend: tensorrt_llm` build. What is checked: the build and the
manifest, the `LLM`'s arguments, what the drafter hands over each iteration (K tokens,
draft logits only where TensorRT-LLM's rejection sampling recomputes the exact q),
greedy output token-identical to the target alone (in-process and through pickling, as
TensorRT-LLM's worker process gets the drafter), concurrent requests, cancellation, fixed
knobs, and the mapping of sampling parameters both ways. With TensorRT-LLM installed (GPU
machines) the last test runs the real thing.
"""
import dataclasses
import importlib.util
import json
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import fake_tensorrt_llm
import pytest
import torch
from checkpoints import make_checkpoint
from test_lossless_sampling import PROMPT, VOCAB, chi_square_rejects, exact_law

from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import BuildConfig, ConfigError, config_from_dict
from saguaro.runtime.core.contracts import Draft, RequestTarget, VerifyResult
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.decoding.tensorrt_llm_loop import TensorRTLLMTarget, draft_logits, round_outcome, sampling_arguments
from saguaro.runtime.engines.tensorrt_llm_api import check_tensorrt_llm_version, import_tensorrt_llm, request_sampling
from saguaro.runtime.engines.tensorrt_llm_settings import TensorRTLLMSettings
from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.pipeline import Pipeline, RequestError

TWO_TOKEN_SAMPLES = 1200  # seeded generations of the first two tokens (16 outcomes)
PROMPTS = [[0, 5, 9, 14, 3, 22, 7], [0, 11, 6, 18], [0, 40, 41, 42, 43, 44, 45, 46, 47]]
OPTIONS = DecodeOptions(mode="ssd", num_draft_tokens=3, fanout=(2,), max_tokens=24)


def trtllm_config(pair, **settings) -> BuildConfig:
    return BuildConfig(name="trtllm", target=pair / "target", draft=pair / "draft", backend="tensorrt_llm",
                       max_draft_tokens=4, max_branches=8, max_context=96,
                       tensorrt_llm=TensorRTLLMSettings(draft_backend="onnxruntime", **settings))


@pytest.fixture(scope="module")
def trtllm_engines(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("trtllm") / "engines"
    build_engines(trtllm_config(tiny_pair), out, show_progress=False)
    return out


@pytest.fixture
def fake_llm(monkeypatch, request):
    """The stand-in `LLM`, with the API surface of one admitted version: the newest by
    default, any of `fake_tensorrt_llm.VARIANTS` by indirect parametrisation."""
    fake_tensorrt_llm.install(monkeypatch, getattr(request, "param", fake_tensorrt_llm.DEFAULT_VARIANT))
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    yield fake_tensorrt_llm.LLM
    for llm in fake_tensorrt_llm.LLM.instances:
        llm.shutdown()


EVERY_VARIANT = pytest.mark.parametrize("fake_llm", sorted(fake_tensorrt_llm.VARIANTS), indirect=True)
BOTH_SAMPLING_CONFIGS = pytest.mark.parametrize("fake_llm", ["1.2", "scalar-config"], indirect=True)


@pytest.fixture(scope="module")
def reference_target(tiny_pair):
    return TorchEngine(tiny_pair / "target")


def target_alone(reference, prompt, max_tokens):
    return Pipeline(reference, reference).generate(
        prompt, DecodeOptions(mode="autoregressive", max_tokens=max_tokens, eos_token_id=-1), SamplingParams()).output_ids


# --- build, manifest, configuration ----------------------------------------------------

def test_build_makes_only_the_draft_and_records_the_target_checkpoint(trtllm_engines, tiny_pair):
    manifest = json.loads((trtllm_engines / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt_llm"
    assert manifest["models"]["target"]["graphs"] == {}
    assert manifest["models"]["target"]["checkpoint"] == str((tiny_pair / "target").resolve())
    assert set(manifest["models"]["draft"]["graphs"]) == {"model", "branch_draft"}
    assert all(files["engine"].endswith(".onnx") for files in manifest["models"]["draft"]["graphs"].values())
    assert manifest["build"]["tensorrt_llm"] == {"draft_backend": "onnxruntime", "max_batch_size": 8,
                                                 "kv_cache_free_gpu_memory_fraction": 0.5, "single_process": True}
    assert not (trtllm_engines / "target").exists()


@pytest.mark.parametrize("section, message", [
    ({"draft_backend": "tvm"}, "draft_backend='tvm' is not one of onnxruntime, tensorrt"),
    ({"max_batch_size": 0}, "max_batch_size=0 must be an integer >= 1"),
    ({"kv_cache_free_gpu_memory_fraction": 1.5}, r"must be in \(0, 1\]"),
    ({"single_process": "yes"}, "single_process must be true or false"),
    ({"max_batch": 2}, "tensorrt_llm: unknown key 'max_batch'"),
])
def test_bad_tensorrt_llm_sections_name_the_problem(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"name": "t", "target": "a", "draft": "b", "backend": "tensorrt_llm",
                          "tensorrt_llm": section}, where="cfg.yaml")


def test_precision_is_the_draft_backends():
    config = config_from_dict({"name": "t", "target": "a", "draft": "b", "backend": "tensorrt_llm",
                               "precision": "int8", "tensorrt_llm": {"draft_backend": "onnxruntime"}})
    assert config.draft_backend == "onnxruntime" and config.precision == "int8"
    with pytest.raises(ConfigError, match="not supported by backend tensorrt"):
        config_from_dict({"name": "t", "target": "a", "draft": "b", "backend": "tensorrt_llm", "precision": "int8"})


def test_a_changed_target_checkpoint_is_refused(trtllm_engines, tmp_path):
    from saguaro.runtime.decoding.tensorrt_llm_loop import check_target_checkpoint
    from saguaro.runtime.engines.manifest import ManifestError

    manifest = json.loads((trtllm_engines / "manifest.json").read_text())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ManifestError, match="changed since the build"):
        check_target_checkpoint(tmp_path, manifest)
    with pytest.raises(ManifestError, match="missing"):
        check_target_checkpoint(tmp_path / "gone", manifest)


# --- the pieces of the mapping ---------------------------------------------------------

@pytest.mark.parametrize("form", ["list", "scalar"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(seed=7),
                                      SamplingParams(temperature=0.8, seed=3),
                                      SamplingParams(temperature=1.2, top_k=5, top_p=0.9, seed=11)])
def test_sampling_parameters_map_to_tensorrt_llm_and_back(sampling, form):
    """Both forms a request's sampling config has: one-element lists with `random_seed`
    (`0.8[0]`), scalars with `seed` (the seed must not be dropped)."""
    arguments = sampling_arguments(sampling, 16, 2)
    params = fake_tensorrt_llm.SamplingParams(**arguments)  # the real class's keywords and checks
    request = fake_tensorrt_llm.LlmRequest(1, 1, [0, 1], params, sampling_form=form)
    assert request_sampling(request.sampling_config) == sampling
    assert params.greedy == sampling.greedy and params.end_id == 2 and params.max_tokens == 16


def test_a_sampling_config_of_an_unknown_form_is_refused_naming_the_version(monkeypatch):
    fake_tensorrt_llm.install(monkeypatch, "1.2")
    with pytest.raises(RuntimeError, match=r"TensorRT-LLM 1.2.1: a request's sampling_config has no \['top_p'\]"):
        request_sampling(types.SimpleNamespace(temperature=0.5, top_k=None))
    with pytest.raises(ValueError, match="holds 2 values; the SSD drafter drafts for one beam"):
        request_sampling(types.SimpleNamespace(temperature=[0.5, 0.7], top_k=None, top_p=None))


def test_never_stopping_early_ignores_eos():
    assert sampling_arguments(SamplingParams(), 8, -1)["ignore_eos"] is True
    assert "end_id" not in sampling_arguments(SamplingParams(), 8, None)


def test_tensorrt_llm_greedy_rules_are_read_as_greedy():
    for config in ({"temperature": None, "top_k": None, "top_p": None}, {"temperature": [0.9], "top_k": [1]},
                   {"temperature": [0.9], "top_p": [0.0]}, {"temperature": [0.0], "top_k": None, "top_p": None}):
        config.setdefault("top_k", None)
        config.setdefault("top_p", None)
        assert request_sampling(types.SimpleNamespace(**config)).greedy


def test_round_outcomes_are_read_from_the_appended_tokens():
    proposal = Draft(torch.tensor([7, 8, 9]), None, torch.zeros(3, 4))
    assert round_outcome([1, 2], proposal, [1, 2, 7, 8, 5]) == VerifyResult(2, 5)
    assert round_outcome([1, 2], proposal, [1, 2, 4]) == VerifyResult(0, 4)
    assert round_outcome([1, 2], proposal, [1, 2, 7, 8, 9, 3]) == VerifyResult(3, 3)
    assert round_outcome([1, 2], proposal, [1, 2, 7, 6, 5]) is None  # not what a verification appends
    assert round_outcome([1, 2], proposal, [1, 3, 4]) is None
    assert round_outcome([1, 2], proposal, [1, 2]) is None


def test_draft_logits_only_where_tensorrt_llm_recomputes_the_same_q():
    q = torch.softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)), -1)
    draft = Draft(torch.tensor([1, 2, 3]), q, torch.zeros(3, 11))
    logits = draft_logits(draft, SamplingParams(temperature=0.7))
    assert torch.allclose(torch.softmax(logits / 0.7, -1), q, atol=1e-6)
    assert draft_logits(draft, SamplingParams(temperature=0.7, top_p=0.9)) is None
    assert draft_logits(draft, SamplingParams(temperature=0.7, top_k=4)) is None
    assert draft_logits(Draft(draft.tokens, None, draft.logits), SamplingParams()) is None


# --- against the stand-in LLM ------------------------------------------------------------

@EVERY_VARIANT
def test_the_llm_gets_the_drafter_and_its_arguments(fake_llm, trtllm_engines, tiny_pair):
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    assert isinstance(pipeline.target, RequestTarget) and isinstance(pipeline.target, TensorRTLLMTarget)
    (llm,) = fake_llm.instances
    arguments = llm.arguments
    assert arguments["model"] == str((tiny_pair / "target").resolve())
    assert arguments["max_seq_len"] == 96 and arguments["max_batch_size"] == 8
    assert arguments["kv_cache_config"].enable_block_reuse is False
    spec = arguments["speculative_config"]
    assert spec.max_draft_len == 3 and type(spec.drafter).__name__ == "TensorRTLLMDrafter"
    assert isinstance(spec.drafter, fake_llm.variant.drafter)
    assert spec.drafter.pad_to() == 3  # the installed base class pads every draft to K
    assert llm.in_process and llm.drafter is spec.drafter


@EVERY_VARIANT
def test_greedy_ssd_through_tensorrt_llm_equals_the_target_alone(fake_llm, trtllm_engines, reference_target):
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    options = DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1})
    streamed = []
    for prompt in PROMPTS:
        generation = pipeline.generate(prompt, options, SamplingParams(), on_tokens=streamed.append)
        assert generation.output_ids == target_alone(reference_target, prompt, 24)
        stats = generation.stats
        assert generation.finish_reason == "length" and stats.tokens == 24
        assert sum(stats.accepted_histogram) == stats.rounds and stats.rounds < 24  # drafts were accepted
        assert stats.cache_hits + stats.cache_misses > 0 and stats.branches_drafted > 0  # from the drafter
    assert sum(len(chunk) for chunk in streamed) == 24 * len(PROMPTS)
    (llm,) = fake_llm.instances
    handed = [entry for call in llm.prepare_calls for entry in call]
    assert handed and all(len(entry["drafts"]) == 3 and entry["logits"] is None for entry in handed)
    assert all(0 <= token < pipeline.target.info.vocab_size for entry in handed for token in entry["drafts"])


def test_rounds_match_the_runtimes_own_ssd_loop_round_for_round(fake_llm, trtllm_engines, tiny_pair):
    """TensorRT-LLM samples the first token in its prefill, as the runtime's own loop does,
    so SSD through it is the runtime's own SSD loop: same accepted lengths round by round,
    same cache hits and misses (same draft engine, same fan-out), same text."""
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    local_target = TorchEngine(tiny_pair / "target")
    local_target.info = dataclasses.replace(local_target.info, max_context=pipeline.target.info.max_context)
    options = DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1})
    for prompt in PROMPTS:
        through = pipeline.generate(prompt, options, SamplingParams())
        local = Pipeline(local_target, pipeline.draft).generate(prompt, options, SamplingParams())
        assert through.output_ids == local.output_ids
        assert through.stats.accepted_histogram == local.stats.accepted_histogram
        assert (through.stats.cache_hits, through.stats.cache_misses) == (local.stats.cache_hits,
                                                                          local.stats.cache_misses)
        assert through.stats.cache_hits > 0


def test_a_drafter_pickled_into_a_worker_process_loads_the_draft_there(fake_llm, trtllm_engines, reference_target):
    pipeline = Pipeline.load(engines=trtllm_engines)
    target = pipeline.target
    target.settings = TensorRTLLMSettings(draft_backend="onnxruntime", single_process=False)
    prompt = PROMPTS[0]
    generation = pipeline.generate(prompt, DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1}),
                                   SamplingParams())
    (llm,) = fake_llm.instances
    assert not llm.in_process
    assert llm.drafter.ssd is not target.drafter and llm.drafter.ssd._draft_engine is not None
    assert generation.output_ids == target_alone(reference_target, prompt, 24)
    assert generation.stats.cache_hits == generation.stats.cache_misses == 0  # the worker's figures stay there
    assert sum(generation.stats.accepted_histogram) == generation.stats.rounds > 0


def test_concurrent_requests_are_batched_and_each_exact(fake_llm, trtllm_engines, reference_target):
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    options = DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1, "max_tokens": 16})
    results = {}

    def run(index):
        results[index] = pipeline.generate(PROMPTS[index], options, SamplingParams()).output_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for index, prompt in enumerate(PROMPTS):
        assert results[index] == target_alone(reference_target, prompt, 16)
    (llm,) = fake_llm.instances
    assert max(len(call) for call in llm.prepare_calls) > 1  # several requests in one iteration


@BOTH_SAMPLING_CONFIGS
def test_sampled_requests_hand_over_the_q_their_drafts_came_from(fake_llm, trtllm_engines):
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    options = DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1, "max_tokens": 12})
    generation = pipeline.generate(PROMPTS[1], options, SamplingParams(temperature=0.8, seed=5))
    assert len(generation.output_ids) == 12
    (llm,) = fake_llm.instances
    handed = [entry for call in llm.prepare_calls for entry in call]
    for entry in handed:
        q = torch.softmax(entry["logits"] / 0.8, -1)  # what TensorRT-LLM recomputes
        assert entry["logits"].shape == (3, pipeline.target.info.vocab_size)
        assert torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)
        assert all(float(q[i, token]) > 0 for i, token in enumerate(entry["drafts"]))
    calls = len(llm.prepare_calls)
    pipeline.generate(PROMPTS[1], options, SamplingParams(temperature=0.8, top_p=0.9, seed=5))
    assert all(entry["logits"] is None for call in llm.prepare_calls[calls:] for entry in call)


@pytest.fixture(scope="module")
def enumerable_engines(tmp_path_factory):
    """A pair over the chi-square test's vocabulary (`test_lossless_sampling.py`), built for tensorrt_llm."""
    root = tmp_path_factory.mktemp("enumerable-trtllm")
    make_checkpoint(root / "target", vocab_size=VOCAB, hidden=32, seed=0, logit_scale=12.0)
    make_checkpoint(root / "draft", vocab_size=VOCAB, hidden=16, heads=1, kv_heads=1, seed=1, logit_scale=12.0)
    config = BuildConfig(name="enum", target=root / "target", draft=root / "draft", backend="tensorrt_llm",
                         max_draft_tokens=2, max_branches=4, max_context=16,
                         tensorrt_llm=TensorRTLLMSettings(draft_backend="onnxruntime"))
    build_engines(config, root / "engines", show_progress=False)
    return root / "engines"


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["rejection sampling", "exact match of samples"])
def test_sampled_output_through_tensorrt_llm_is_the_targets_law(fake_llm, enumerable_engines, sampling):
    """TensorRT-LLM's acceptance with the drafter's logits (rejection sampling) or without
    them (matching the target's own samples) leaves the target's law: chi-square over the
    first two tokens, as for the runtime's own loops. A wrong mapping of q to draft logits
    (say log q without the temperature) biases the first case and fails."""
    options = DecodeOptions(mode="ssd", num_draft_tokens=1, fanout=(2,), max_tokens=2, eos_token_id=-1)
    pipeline = Pipeline.load(engines=enumerable_engines, options=options)
    law = exact_law(TorchEngine(pipeline.target.checkpoint), sampling, depth=2)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)

    def sample(seed):
        run = dataclasses.replace(sampling, seed=seed)
        return pipeline.generate(PROMPT, options, run).output_ids

    with ThreadPoolExecutor(16) as pool:
        for x, y in pool.map(sample, range(TWO_TOKEN_SAMPLES)):
            counts[x, y] += 1
    rejects, statistic = chi_square_rejects(counts, law)
    assert not rejects, f"chi-square {statistic:.1f}: not the target's law"
    (llm,) = fake_llm.instances
    handed = [entry for call in llm.prepare_calls for entry in call]
    assert all((entry["logits"] is not None) == (sampling.top_p == 1) for entry in handed)


def test_other_decoding_knobs_than_the_started_ones_are_refused(fake_llm, trtllm_engines):
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    with pytest.raises(RequestError, match="num_draft_tokens=3 .*asks for 4"):
        pipeline.generate(PROMPTS[0], DecodeOptions(num_draft_tokens=4, fanout=(1,)), SamplingParams())
    with pytest.raises(RequestError, match="fanout"):
        pipeline.generate(PROMPTS[0], DecodeOptions(num_draft_tokens=3, fanout=(1,)), SamplingParams())


def test_cancellation_aborts_the_request(fake_llm, trtllm_engines):
    pipeline = Pipeline.load(engines=trtllm_engines, options=OPTIONS)
    seen = []
    generation = pipeline.generate(PROMPTS[0], DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1}),
                                   SamplingParams(), on_tokens=seen.extend, cancelled=lambda: len(seen) >= 4)
    (llm,) = fake_llm.instances
    assert generation.finish_reason == "cancelled" and len(generation.output_ids) < 24
    assert llm.aborted == [1 + 100]  # the stand-in's first client id


def test_missing_tensorrt_llm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorrt_llm", None)
    with pytest.raises(ImportError, match="pip install 'tensorrt-llm>=1.0,<1.3'"):
        import_tensorrt_llm()


@pytest.mark.parametrize("version", ["1.0.0", "1.1.0", "1.2.0rc2", "1.2.0rc6.post2", "1.2.1"])
def test_supported_tensorrt_llm_versions(version):
    check_tensorrt_llm_version(version)


@pytest.mark.parametrize("version", ["0.21.0", "1.3.0rc0", "2.0.0"])
def test_a_tensorrt_llm_outside_the_range_is_refused_naming_it(monkeypatch, version):
    fake_tensorrt_llm.install(monkeypatch, fake_tensorrt_llm.Variant(version, fake_tensorrt_llm.DraftLenDrafter,
                                                                     "list"))
    with pytest.raises(ImportError, match=f"TensorRT-LLM {version} is not supported.*tensorrt-llm>=1.0,<1.3"):
        import_tensorrt_llm()


def test_a_drafter_constructor_of_unknown_form_is_refused_naming_the_version(monkeypatch):
    fake_tensorrt_llm.install(monkeypatch, fake_tensorrt_llm.Variant("1.2.1", fake_tensorrt_llm.UnknownDrafter,
                                                                     "list"))
    with pytest.raises(RuntimeError, match=r"TensorRT-LLM 1.2.1: Drafter.__init__\(spec_config, max_draft_len\) "
                                           "is none of the forms"):
        import_tensorrt_llm()


@pytest.mark.parametrize("variant", sorted(fake_tensorrt_llm.VARIANTS))
def test_every_admitted_drafter_form_is_built_with_the_draft_length(monkeypatch, variant):
    """Each form's base class constructed the way it wants, padding a short draft to K
    (the `max_concurrency`-only form reads an attribute the base never sets)."""
    fake_tensorrt_llm.install(monkeypatch, variant)
    api = import_tensorrt_llm()
    drafter = api.Drafter(types.SimpleNamespace(k=5))
    request = fake_tensorrt_llm.LlmRequest(1, 1, [0], fake_tensorrt_llm.SamplingParams(), py_draft_tokens=[7, 8])
    drafter.pad_draft_tokens_for_cuda_graph(fake_tensorrt_llm.ScheduledRequests(generation_requests=[request]))
    assert request.py_draft_tokens == [7, 8, 0, 0, 0]


# --- the real TensorRT-LLM (GPU machines) -------------------------------------------------

@pytest.mark.gpu
@pytest.mark.tensorrt_llm
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None,
                    reason="TensorRT-LLM installs on CUDA GPU machines only (pip install tensorrt_llm)")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT-LLM needs a CUDA GPU")
def test_real_tensorrt_llm_greedy_equals_the_target_alone(tiny_pair, tmp_path, reference_target):
    out = tmp_path / "engines"
    build_engines(trtllm_config(tiny_pair, max_batch_size=2), out, show_progress=False)
    pipeline = Pipeline.load(engines=out, options=OPTIONS)
    try:
        options = DecodeOptions(**{**OPTIONS.__dict__, "eos_token_id": -1, "max_tokens": 16})
        for prompt in PROMPTS:
            assert pipeline.generate(prompt, options, SamplingParams()).output_ids == \
                target_alone(reference_target, prompt, 16)
    finally:
        pipeline.target.close()
