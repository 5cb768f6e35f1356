"""Every graph the build exports, checked the ways a CPU can check what TensorRT will get.

- `onnx.checker` full check, and shape inference in strict mode with type checks and
  data propagation, on every graph of both backends' exports;
- every plugin node names exactly its signature's inputs and outputs, with the element
  types and ranks the signature gives (what TensorRT's parser and the plugin require),
  and no node reaching TensorRT is an op without a plugin;
- every graph TensorRT builds runs under ONNX Runtime at each corner (min, opt, max) of
  the optimisation profile the build gives it (`builder.tensorrt_options`), with outputs
  of the expected shapes (and the branch plan equal to the reference op's).
"""
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from saguaro.compiler import builder
from saguaro.compiler.config import BuildConfig
from saguaro.compiler.tensorrt_builder import PLUGIN_SIGNATURES, check_plugin_node, profile_shapes, strip_plugin_functions
from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.plugins.signature import dtype_of

CORNERS = ("min", "opt", "max")
MAX_BRANCHES, MAX_DRAFT_TOKENS = 16, 8


def export_config(pair: Path, backend: str) -> BuildConfig:
    return BuildConfig(name=f"graphs-{backend}", target=pair / "target", draft=pair / "draft", backend=backend,
                       max_draft_tokens=MAX_DRAFT_TOKENS, max_branches=MAX_BRANCHES, max_context=64, max_batch=2)


@pytest.fixture(scope="module")
def exported(tiny_pair, tmp_path_factory) -> dict[tuple[str, str, str], Path]:
    """(backend, role, graph) -> the ONNX file the build exports for it (fp32)."""
    out, graphs = tmp_path_factory.mktemp("exported"), {}
    for backend in ("onnxruntime", "tensorrt"):
        config = export_config(tiny_pair, backend)
        for role in ("target", "draft"):
            source = builder.inspect_checkpoint(role, tiny_pair / role)
            paths = builder.export_model(config, source, out / backend / role, out / backend / "work")
            graphs.update({(backend, role, stem): path for stem, path in paths.items()})
    return graphs


def test_each_backend_exports_its_graphs(exported, tiny_pair):
    """A fused model graph and the role's plugin graph for ONNX Runtime; forward, verify and
    branch_draft for TensorRT. Both commit a branch in place, without a kv_gather graph."""
    for backend in ("onnxruntime", "tensorrt"):
        names = {(role, stem) for b, role, stem in exported if b == backend}
        config = export_config(tiny_pair, backend)
        assert names == {(role, stem) for role in ("target", "draft") for stem in builder.graphs_built(config, role)}
        assert len(names) == 4


def inferred(path: Path) -> onnx.ModelProto:
    """The full checker, then strict shape inference (raises on any inconsistency)."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    graph = model.graph
    return {v.name: v.type.tensor_type for v in (*graph.input, *graph.value_info, *graph.output)}


def test_every_graph_passes_the_full_checker_and_strict_inference(exported):
    for (backend, _, _), path in exported.items():
        inferred(path)  # raises on failure
        if backend != "tensorrt":
            continue
        stripped = strip_plugin_functions(onnx.load(str(path)))  # weights inline
        onnx.checker.check_model(stripped, full_check=True)  # what TensorRT's parser gets


def test_every_plugin_node_matches_its_signature(exported):
    seen = set()
    for (backend, role, stem), path in exported.items():
        model = inferred(path)
        types = value_types(model)
        for node in model.graph.node:
            if node.domain != "saguaro":
                continue
            signature = PLUGIN_SIGNATURES[node.op_type]
            seen.add(node.op_type)
            if backend == "tensorrt":
                check_plugin_node(node)  # raises if TensorRT could not build it
            assert len(node.input) == len(signature.inputs) and len(node.output) == len(signature.outputs)
            for kind, names, specs in (("input", node.input, signature.inputs),
                                       ("output", node.output, signature.outputs)):
                for name, spec in zip(names, specs):
                    tensor_type = types[name]
                    assert dtype_of(tensor_type.elem_type) in spec.dtypes, (stem, kind, spec.name)
                    assert len(tensor_type.shape.dim) == spec.rank, (stem, kind, spec.name)
    assert seen == set(PLUGIN_SIGNATURES) - {"GatherKV"}  # every engine commits a branch in place


# --- ONNX Runtime at the optimisation profile's corners -------------------------------

def corner_branches(corner: str) -> int:
    return {"min": 1, "opt": MAX_BRANCHES // 2, "max": MAX_BRANCHES}[corner]


def spread(total: int, slots: int) -> np.ndarray:
    """`slots` non-negative counts summing to `total`, front-loaded like a real fan-out."""
    counts = np.full(slots, total // slots, dtype=np.int64)
    counts[: total % slots] += 1
    return counts


def feeds_for(session: ort.InferenceSession, shapes: dict[str, tuple], corner: str, vocab: int,
              temperature: float, generator: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of the profile's `corner` shapes, with values a real call would have."""
    shape = {name: ranges[CORNERS.index(corner)] for name, ranges in shapes.items()}
    feeds = {}
    for graph_input in session.get_inputs():
        name, dims = graph_input.name, shape.get(graph_input.name, ())
        if name == "input_ids":
            feeds[name] = generator.integers(0, vocab, dims)
        elif name == "position_ids":
            batch, n = dims
            past = shape["past_keys"][3]
            feeds[name] = np.broadcast_to(np.arange(past, past + n), (batch, n)).copy()
        elif name == "attention_mask":
            batch, n, total = dims
            feeds[name] = np.broadcast_to(np.tril(np.ones((n, total), bool), total - n), dims).copy()
        elif name in ("past_keys", "past_values", "scores"):
            feeds[name] = generator.standard_normal(dims, dtype=np.float32)
        elif name == "draft_tokens":
            feeds[name] = generator.integers(0, vocab, dims)
        elif name == "draft_probs":
            logits = generator.standard_normal(dims, dtype=np.float32)
            feeds[name] = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
        elif name == "uniforms":
            feeds[name] = generator.random(dims, dtype=np.float32)
        elif name == "fanout":
            feeds[name] = spread(corner_branches(corner), dims[0])
        else:
            scalars = {"temperature": np.float32(temperature), "top_k": np.int64(0), "top_p": np.float32(0.9),
                       "context_length": np.int64(10)}
            feeds[name] = np.array(scalars[name])
    return feeds


def check_outputs(stem: str, feeds: dict, outputs: dict, vocab: int) -> None:
    if stem in ("forward", "verify"):
        batch, n = feeds["input_ids"].shape
        total = feeds["attention_mask"].shape[2]
        assert outputs["logits"].shape == (batch, n, vocab) and np.isfinite(outputs["logits"]).all()
        for name in ("present_keys", "present_values"):
            assert outputs[name].shape[1] == batch and outputs[name].shape[3] == total
    if stem == "verify":
        assert 0 <= int(outputs["accepted"]) <= len(feeds["draft_tokens"]) and 0 <= int(outputs["bonus"]) < vocab
    if stem == "branch_draft":
        want = plan_branches(torch.from_numpy(feeds["scores"]), torch.from_numpy(feeds["draft_tokens"]),
                             torch.from_numpy(feeds["fanout"]), int(feeds["context_length"]))
        for name in ("depth", "token", "rank", "positions", "window_mask"):
            assert np.array_equal(outputs[name], getattr(want, name).numpy()), name
        assert want.branches == int(feeds["fanout"].sum())


@pytest.mark.parametrize("corner", CORNERS)
def test_tensorrt_graphs_run_at_their_profile_corners(exported, tiny_pair, corner):
    config = export_config(tiny_pair, "tensorrt")
    generator = np.random.default_rng(CORNERS.index(corner))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for (backend, role, stem), path in exported.items():
        if backend != "tensorrt":
            continue
        vocab = builder.inspect_checkpoint(role, tiny_pair / role).shape.vocab_size
        model = onnx.load(str(path), load_external_data=False)
        shapes = profile_shapes(model, builder.tensorrt_options(config, vocab, stem).dim_ranges)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for temperature in ((0.0, 0.8) if stem == "verify" else (0.0,)):
            feeds = feeds_for(session, shapes, corner, vocab, temperature, generator)
            for name, ranges in shapes.items():
                assert feeds[name].shape == ranges[CORNERS.index(corner)], (stem, name)
            outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
            check_outputs(stem, feeds, outputs, vocab)


def test_profiles_cover_every_call_the_runtime_makes(tiny_pair):
    """Past + query never exceeds the cache, every query (prefill, K+1 verify, a tree step
    of all branches) fits, and a verify's query length is its K+1."""
    config = export_config(tiny_pair, "tensorrt")
    forward = builder.tensorrt_options(config, 512, "forward").dim_ranges
    verify = builder.tensorrt_options(config, 512, "verify").dim_ranges
    cache = config.max_cache_entries
    assert forward["past"][2] >= cache - 1 and forward["total"][2] >= cache
    assert forward["n"][2] >= max(config.max_context - 1, MAX_BRANCHES, MAX_DRAFT_TOKENS + 1)
    assert verify["n"] == verify["k_plus_1"] == (1, MAX_DRAFT_TOKENS + 1, MAX_DRAFT_TOKENS + 1)
    for dims in (forward, verify):
        for corner in range(3):
            assert dims["total"][corner] == dims["past"][corner] + dims["n"][corner]
