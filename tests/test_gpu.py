"""The GPU path, on a GPU: what `scripts/gpu_check.sh` runs on a lent machine.

Every test here needs CUDA (marked `gpu`), and TensorRT for most (`tensorrt`); each skips
with its reason elsewhere. The checks, each a test:

- the TensorRT in use is a supported version and registers both plugins;
- TensorRT builds every graph of the TensorRT backend (target forward and verify, draft
  forward and branch_draft; the fifth graph, kv_gather, is by design no TensorRT engine:
  the commit is the in-place OpenAI Triton gather between engine calls), with the I/O
  the exported ONNX declares;
- the FusedVerify and BranchDraft plugins inside engines equal the reference ops (K = 0
  and B = 0 included: empty tensors, null-free bindings, data-dependent shapes);
- the OpenAI Triton kernels, compiled for this device (TRITON_INTERPRET=0), equal the
  reference ops;
- TensorRT engines match the ONNX Runtime engines (logits, verify outcome, branch plan),
  which needs fp32 to be fp32: the manifest says TF32 was cleared;
- SSD on TensorRT engines is token-identical to the target alone (greedy), with hits;
- fp16 engines keep an fp16 cache, score as the fp16 model does, and run SSD.
"""
import importlib.util
import json
import os

import onnx
import pytest
import torch
from test_export_ort import PROMPT, assert_same_logits, engine_config, prefilled
from verify_rounds import random_round

from saguaro.compiler import tensorrt_builder
from saguaro.compiler.builder import build_engines, graphs_built
from saguaro.plugins.branch_draft import onnx_function as branch_onnx
from saguaro.plugins.branch_draft.reference import gather_kv, plan_branches
from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.torch_engine import TorchEngine

NO_TENSORRT = "needs TensorRT (GPU machines: scripts/gpu_check.sh installs it from a wheel folder, docs/gpu.md)"
# decided at collection, so that no fixture (model pair, engine builds) runs for nothing
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_tensorrt = [pytest.mark.tensorrt,
                  pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason=NO_TENSORRT)]


def with_tensorrt(test):
    for mark in needs_tensorrt:
        test = mark(test)
    return test


def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def need_tensorrt():
    need_cuda()
    return pytest.importorskip("tensorrt", reason=NO_TENSORRT)


@pytest.fixture(scope="module")
def trt_engines(tiny_pair, tmp_path_factory):
    need_tensorrt()
    out = tmp_path_factory.mktemp("gpu") / "tensorrt"
    build_engines(engine_config(tiny_pair, backend="tensorrt"), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def trt_fp16_engines(tiny_pair, tmp_path_factory):
    need_tensorrt()
    out = tmp_path_factory.mktemp("gpu") / "tensorrt-fp16"
    build_engines(engine_config(tiny_pair, precision="fp16", backend="tensorrt"), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def ort_engines(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "onnxruntime"
    build_engines(engine_config(tiny_pair), out, show_progress=False)
    return load_engine_pair(out)


def standalone_graph(model: onnx.ModelProto, dims: dict, folder, name: str):
    """A plugin's standalone model built by TensorRT, behind the runtime's own runner."""
    trt = need_tensorrt()
    from saguaro.runtime.engines.tensorrt_engine import TensorRTGraph

    path = folder / f"{name}.onnx"
    onnx.save(model, path)
    plan = tensorrt_builder.build_engine(path, folder / f"{name}.plan", {"dims": dims})
    return TensorRTGraph.load(trt, trt.Runtime(trt.Logger(trt.Logger.WARNING)), plan)


@pytest.fixture(scope="module")
def verify_graph(tmp_path_factory):
    dims = {"rows": (1, 4, 9), "drafts": (0, 3, 8), "vocab": (50, 50, 50)}
    return standalone_graph(verify_onnx.standalone_model(), dims, tmp_path_factory.mktemp("verify"), "verify")


@pytest.fixture(scope="module")
def branch_graph(tmp_path_factory):
    dims = {"rows": (1, 5, 9), "drafts": (0, 4, 8), "vocab": (64, 64, 64)}
    return standalone_graph(branch_onnx.standalone_model(), dims, tmp_path_factory.mktemp("branch"), "branch_draft")


@with_tensorrt
def test_tensorrt_is_supported_and_registers_both_plugins():
    trt = need_tensorrt()
    from saguaro.plugins.tensorrt_plugins import register_plugins
    from saguaro.plugins.tensorrt_registry import check_tensorrt_version

    check_tensorrt_version(trt.__version__)
    register_plugins()
    registry = trt.get_plugin_registry()
    for name in ("FusedVerify", "BranchDraft"):
        assert registry.get_creator(name, "1", "saguaro") is not None, name


@with_tensorrt
def test_tensorrt_builds_every_graph(trt_engines, tiny_pair):
    manifest = json.loads((trt_engines / "manifest.json").read_text())
    config = engine_config(tiny_pair, backend="tensorrt")
    for role in ("target", "draft"):
        graphs = manifest["models"][role]["graphs"]
        assert set(graphs) == set(graphs_built(config, role))
        for stem, files in graphs.items():
            assert (trt_engines / files["engine"]).stat().st_size > 0, (role, stem)
    target, draft = load_engine_pair(trt_engines)
    plan = draft.graphs["branch_draft"]
    assert {n for n in plan.names} >= set(branch_onnx.PLAN_OUTPUTS)
    assert plan.dtype("window_mask") == torch.bool and plan.dtype("depth") == torch.int64


@with_tensorrt
@pytest.mark.parametrize("k", [0, 3, 8])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.8, 0, 0.9), (1.2, 5, 1.0)])
def test_fused_verify_plugin_matches_reference(verify_graph, k, temperature, top_k, top_p):
    graph = verify_graph
    generator = torch.Generator().manual_seed(k)
    for case in range(4):
        logits, drafts, q, uniforms = random_round(generator, k, 50, drafts_are_argmax=case % 2 == 0)
        feeds = {"target_logits": logits, "draft_tokens": drafts, "draft_probs": q, "uniforms": uniforms,
                 "temperature": torch.tensor(temperature), "top_k": torch.tensor(top_k),
                 "top_p": torch.tensor(top_p)}
        inputs = {name: value.cuda().contiguous() for name, value in feeds.items()}
        outputs = {name: torch.zeros((), dtype=torch.int64, device="cuda") for name in ("accepted", "bonus")}
        graph.run(inputs, outputs)
        expected = fused_verify(logits, drafts, q, uniforms, temperature, top_k, top_p)
        assert (int(outputs["accepted"]), int(outputs["bonus"])) == tuple(int(v) for v in expected)


@with_tensorrt
@pytest.mark.parametrize("k, fanout", [(3, [2, 1, 0, 3]), (0, [2]), (2, [0, 0, 0]), (4, [4, 4, 4, 2, 2])])
def test_branch_draft_plugin_matches_reference(branch_graph, k, fanout):
    from saguaro.runtime.engines.tensorrt_engine import output_allocator

    graph = branch_graph
    scores = torch.randn(k + 1, 64, generator=torch.Generator().manual_seed(k))
    drafts, fanout = scores[:k].argmax(-1), torch.tensor(fanout)
    inputs = {"scores": scores.cuda(), "draft_tokens": drafts.cuda(), "fanout": fanout.cuda(),
              "context_length": torch.tensor(7, device="cuda")}
    allocator = output_allocator(graph.trt)
    graph.run(inputs, {}, {name: allocator for name in branch_onnx.PLAN_OUTPUTS})
    expected = plan_branches(scores, drafts, fanout, 7)
    for name in branch_onnx.PLAN_OUTPUTS:
        got = allocator.tensor(name, graph.dtype(name)).cpu()
        assert torch.equal(got, getattr(expected, name)), name


def test_triton_kernels_compiled_for_this_device_match_reference():
    need_cuda()
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        pytest.skip("TRITON_INTERPRET is set: the kernels would not be compiled (scripts/gpu_check.sh unsets it)")
    from saguaro.plugins.branch_draft import triton_kernel as branch_triton
    from saguaro.plugins.fused_verify import triton_kernel as verify_triton

    generator = torch.Generator().manual_seed(0)
    for k in (0, 1, 5):
        for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.8, 0, 0.9), (1.0, 7, 1.0)):
            logits, drafts, q, uniforms = random_round(generator, k, 997, drafts_are_argmax=k % 2 == 0)
            got = verify_triton.fused_verify(logits.cuda(), drafts.cuda(), q.cuda(), uniforms.cuda(),
                                             temperature, top_k, top_p)
            want = fused_verify(logits, drafts, q, uniforms, temperature, top_k, top_p)
            assert tuple(int(v) for v in got) == tuple(int(v) for v in want)
        scores, fanout = torch.randn(k + 1, 997, generator=generator), torch.tensor([2] * (k + 1))
        drafts = scores[:k].argmax(-1)
        plan = branch_triton.plan_branches(scores.cuda(), drafts.cuda(), fanout.cuda(), 11)
        want = plan_branches(scores, drafts, fanout, 11)
        for name in branch_onnx.PLAN_OUTPUTS:
            assert torch.equal(getattr(plan, name).cpu(), getattr(want, name)), name
    cache = torch.randn(2, 3, 40, 64, generator=generator)
    sources = torch.tensor([20, 23, 26])
    expected = cache.clone()
    gather_kv(expected, 9, sources)
    on_device = cache.cuda()
    branch_triton.gather_kv(on_device, 9, sources)
    assert torch.equal(on_device[..., :12, :].cpu(), expected[..., :12, :])


@with_tensorrt
def test_tensorrt_engines_match_onnxruntime(trt_engines, ort_engines):
    manifest = json.loads((trt_engines / "manifest.json").read_text())
    assert manifest["tensorrt"]["builder_flags"] == {"TF32": False}  # fp32 matmuls, not 10-bit mantissas
    compiled = load_engine_pair(trt_engines)
    for trt_engine, ort_engine in zip(compiled, ort_engines):
        (_, got), (_, want) = prefilled(trt_engine, PROMPT), prefilled(ort_engine, PROMPT)
        assert_same_logits(got, want)
    drafts, uniforms = torch.tensor([3, 4, 5]), torch.rand(4)
    tokens, positions = torch.tensor([PROMPT[-1], 3, 4, 5]), torch.arange(len(PROMPT), len(PROMPT) + 4)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8)):
        probs = None if sampling.greedy else torch.softmax(torch.randn(3, compiled[0].info.vocab_size), -1)
        outcomes = [engine.verify(engine.new_cache(64), tokens, positions, drafts, probs, uniforms, sampling)
                    for engine in (compiled[0], ort_engines[0])]
        assert outcomes[0] == outcomes[1]
    empty = torch.zeros(0, dtype=torch.int64)  # K = 0: empty inputs bound to real memory
    outcomes = [engine.verify(engine.new_cache(64), tokens[:1], positions[:1], empty, None, uniforms[:1],
                              SamplingParams()) for engine in (compiled[0], ort_engines[0])]
    assert outcomes[0] == outcomes[1]
    for fanout in (torch.tensor([2, 1, 0, 2]), torch.tensor([0, 0, 0, 0])):  # B = 0 too
        scores = torch.randn(4, compiled[1].info.vocab_size)
        got, want = (engine.plan_branches(scores, drafts, fanout, 10) for engine in (compiled[1], ort_engines[1]))
        for name in branch_onnx.PLAN_OUTPUTS:
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@with_tensorrt
@pytest.mark.parametrize("options", [DecodeOptions(mode="ssd", num_draft_tokens=4, fanout=(3,), max_tokens=32),
                                     DecodeOptions(mode="ssd", num_draft_tokens=3, budget=6, max_tokens=32),
                                     DecodeOptions(mode="speculative", num_draft_tokens=5, max_tokens=32)],
                         ids=["ssd fanout 3", "ssd budget 6", "speculative"])
def test_ssd_on_tensorrt_engines_equals_the_target_alone(trt_engines, tiny_pair, options):
    from saguaro.runtime.pipeline import Pipeline

    pipeline = Pipeline.load(engines=trt_engines)
    reference = TorchEngine(tiny_pair / "target")
    options = DecodeOptions(**{**options.__dict__, "eos_token_id": -1})
    hits = 0
    for prompt in (PROMPT, PROMPT[:4], [PROMPT[0]]):
        generation = pipeline.generate(prompt, options, SamplingParams())
        alone = Pipeline(reference, reference).generate(
            prompt, DecodeOptions(mode="autoregressive", max_tokens=32, eos_token_id=-1), SamplingParams())
        assert generation.output_ids == alone.output_ids
        hits += generation.stats.cache_hits
    assert hits > 0 or options.mode == "speculative"


@with_tensorrt
def test_fp16_engines_keep_an_fp16_cache_and_score_as_the_fp16_model(trt_fp16_engines, tiny_pair):
    from saguaro.runtime.models.checkpoint import load_checkpoint
    from saguaro.runtime.pipeline import Pipeline

    manifest = json.loads((trt_fp16_engines / "manifest.json").read_text())
    assert manifest["tensorrt"]["export_dtype"] == "float16"
    target, draft = load_engine_pair(trt_fp16_engines)
    assert target.cache_dtype == draft.cache_dtype == torch.float16 and target.logits_dtype == torch.float32
    _, got = prefilled(target, PROMPT)
    model = load_checkpoint(tiny_pair / "target").model.half()  # on the CPU, as the engines' reference
    with torch.no_grad():
        want = model.forward_sequence(torch.tensor(PROMPT)).float()
    assert (got - want).abs().max() < 2e-2 * max(1.0, float(want.abs().max()))
    options = DecodeOptions(mode="ssd", num_draft_tokens=4, fanout=(3,), max_tokens=32, eos_token_id=-1)
    generation = Pipeline.load(engines=trt_fp16_engines).generate(PROMPT, options, SamplingParams())
    assert len(generation.output_ids) == 32 and generation.stats.cache_hits + generation.stats.cache_misses > 0
