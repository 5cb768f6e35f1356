"""The TensorRT side: plugin nodes stripped for the parser, profiles, registrations, builds.

What needs TensorRT itself (registering with `tensorrt.plugin`, building and running an
engine on a GPU) is in `test_gpu.py` (`scripts/gpu_check.sh`); here the ONNX-side
preparation, the builder's calls and flags, the precisions' exports and BranchDraft's
shape expressions, against a stand-in of TensorRT 10.8 to 11.x (`fake_tensorrt.py`).
"""
import json
from unittest import mock

import numpy as np
import onnx
import pytest
from fake_tensorrt import ExpressionBuilder, StaleExpressionBuilder, fake_tensorrt, input_desc
from onnx import TensorProto, helper

from saguaro.compiler import builder, tensorrt_builder
from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import BuildConfig, ConfigError, config_from_dict
from saguaro.compiler.tensorrt_builder import TensorRTBuildOptions, profile_shapes, strip_plugin_functions
from saguaro.plugins.branch_draft import PLUGIN_VERSION as BRANCH_VERSION
from saguaro.plugins.branch_draft import onnx_function as branch_onnx
from saguaro.plugins.branch_draft import tensorrt_plugin as branch_trt
from saguaro.plugins.branch_draft.signature import SIGNATURE as BRANCH_DRAFT
from saguaro.plugins.fused_verify import PLUGIN_VERSION as VERIFY_VERSION
from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify import tensorrt_plugin as verify_trt
from saguaro.plugins.signature import onnx_type
from saguaro.plugins.tensorrt_registry import check_plugin_version, check_tensorrt_version

try:
    import tensorrt  # noqa: F401
    HAVE_TENSORRT = True
except ImportError:
    HAVE_TENSORRT = False


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def both_plugins_model() -> onnx.ModelProto:
    """One graph using both plugin nodes next to an ordinary op and a non-plugin function."""
    verify = verify_onnx.standalone_model()
    branch = branch_onnx.standalone_model()
    helper_function = helper.make_function("local", "Twice", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])],
                                           [helper.make_opsetid("", 17)])
    nodes = [*verify.graph.node, *branch.graph.node,
             helper.make_node("Twice", ["uniforms"], ["doubled"], domain="local")]
    inputs = list(verify.graph.input) + [i for i in branch.graph.input if i.name != "draft_tokens"]
    outputs = list(verify.graph.output) + list(branch.graph.output) + [
        helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["rows"])]
    graph = helper.make_graph(nodes, "both", inputs, outputs)
    return helper.make_model(graph, functions=[*verify.functions, *branch.functions, helper_function],
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("saguaro", 1),
                                            helper.make_opsetid("local", 1)])


def test_stripped_model_passes_the_checker_and_keeps_plugin_attributes():
    model = both_plugins_model()
    onnx.checker.check_model(model, full_check=True)
    stripped = strip_plugin_functions(model)
    onnx.checker.check_model(stripped, full_check=True)
    assert [f.name for f in stripped.functions] == ["Twice"]
    plugin_nodes = {n.op_type: attributes(n) for n in stripped.graph.node if n.domain == "saguaro"}
    assert plugin_nodes["FusedVerify"] == {"plugin_namespace": b"saguaro", "plugin_version": VERIFY_VERSION.encode()}
    assert plugin_nodes["BranchDraft"] == {"plugin_namespace": b"saguaro", "plugin_version": BRANCH_VERSION.encode(),
                                           "max_branches": branch_onnx.STANDALONE_MAX_BRANCHES}
    assert len(model.functions) == 3  # the input model is left as it was


def test_strip_adds_the_plugin_domain_import():
    model = verify_onnx.standalone_model()
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 17))
    stripped = strip_plugin_functions(model)
    assert {o.domain for o in stripped.opset_import} == {"", "saguaro"}
    onnx.checker.check_model(stripped)


def test_strip_rejects_a_plugin_node_tensorrt_could_not_map():
    model = verify_onnx.standalone_model()
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != "plugin_namespace"]
    del node.attribute[:]
    node.attribute.extend(kept)
    with pytest.raises(ValueError, match="plugin_namespace"):
        strip_plugin_functions(model)


def test_plugin_versions_are_the_one_tensorrt_plugin_registers():
    """`tensorrt.plugin` registers every creator as version "1"; the parser looks up the node's."""
    for version in (VERIFY_VERSION, BRANCH_VERSION):
        check_plugin_version(version)
    with pytest.raises(RuntimeError, match="version"):
        check_plugin_version("2")


def test_profile_shapes_from_named_dimensions():
    model = branch_onnx.standalone_model()
    shapes = profile_shapes(model, {"rows": (1, 5, 9), "vocab": (64, 64, 64), "drafts": (0, 4, 8)})
    assert shapes == {"scores": ((1, 64), (5, 64), (9, 64)), "draft_tokens": ((0,), (4,), (8,)),
                      "fanout": ((1,), (5,), (9,))}
    with pytest.raises(ValueError, match="vocab"):
        profile_shapes(model, {"rows": (1, 5, 9), "drafts": (0, 4, 8)})


def test_build_options_from_a_config_section():
    options = TensorRTBuildOptions.from_mapping(
        {"dims": {"batch": [1, 1, 4]}, "precision": "fp16", "workspace_gib": 0.5})
    assert options.dim_ranges == {"batch": (1, 1, 4)} and options.precision == "fp16"
    assert options.workspace_bytes == 1 << 29
    with pytest.raises(ValueError):
        TensorRTBuildOptions(precision="fp8")
    with pytest.raises(ValueError):
        TensorRTBuildOptions(dim_ranges={"batch": (4, 1, 8)})


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the error shown when TensorRT is missing")
def test_missing_tensorrt_says_how_to_install_it(tmp_path):
    for register in (verify_trt.register, branch_trt.register):
        with pytest.raises(ImportError, match="pypi.nvidia.com"):
            register()
    with pytest.raises(ImportError, match="pypi.nvidia.com"):
        tensorrt_builder.build_engine(tmp_path / "model.onnx", tmp_path / "model.plan", {})


@pytest.mark.parametrize("version, flags", [("10.8.0.43", 1 << 1), ("10.14.1.48", 1 << 1), ("11.0.0", 0),
                                            ("11.4.0.106", 0)])
def test_build_engine_drives_the_builder_api(tmp_path, version, flags):
    """On 10.x the network is created STRONGLY_TYPED (by name: the flag is 1 there); on 11
    every network is strongly typed and the deprecated flag (0 there) is not passed. TF32,
    on in every new builder config, is cleared; no precision flag is set."""
    onnx_path = tmp_path / "branch.onnx"
    onnx.save(branch_onnx.standalone_model(), onnx_path)
    trt = fake_tensorrt(version)
    options = TensorRTBuildOptions(dim_ranges={"rows": (1, 5, 9), "vocab": (64, 64, 64), "drafts": (0, 4, 8)})
    with mock.patch.object(tensorrt_builder, "import_tensorrt", return_value=trt), \
            mock.patch.object(tensorrt_builder, "register_plugins") as register:
        tensorrt_builder.build_engine(onnx_path, tmp_path / "out" / "branch.plan", options)
    register.assert_called_once()
    trt.Builder.return_value.create_network.assert_called_once_with(flags)
    parsed_bytes, parsed_path = trt.OnnxParser.return_value.parse.call_args.args
    parsed = onnx.load_from_string(parsed_bytes)
    assert len(parsed.functions) == 0 and parsed_path == str(onnx_path)
    profile = trt.Builder.return_value.create_optimization_profile.return_value
    profile.set_shape.assert_any_call("scores", (1, 64), (5, 64), (9, 64))
    _, builder_config = trt.Builder.return_value.build_serialized_network.call_args.args
    assert builder_config.flags == set(), "TF32 must be cleared, and nothing else set"
    assert builder_config.profiles == [profile]
    assert (tmp_path / "out" / "branch.plan").read_bytes() == b"plan-bytes"


def test_a_new_builder_config_has_tf32_on_as_in_tensorrt():
    """What the stand-in must model for the test above to mean anything (NvInfer.h:
    kTF32 "Enabled by default", 10.8 to 11.1)."""
    for version in ("10.8.0", "11.1.0"):
        trt = fake_tensorrt(version)
        config = trt.Builder(trt.Logger()).create_builder_config()
        assert config.get_flag(trt.BuilderFlag.TF32)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_the_manifest_says_how_the_engines_compute(precision):
    entry = tensorrt_builder.manifest_entry(precision)
    assert entry == {"precision": precision, "export_dtype": tensorrt_builder.EXPORT_DTYPES[precision],
                     "strongly_typed": True, "builder_flags": {"TF32": False}}


def weights_model(elem_type: int) -> onnx.ModelProto:
    weight = helper.make_tensor("w", elem_type, [2, 2], [1.0, 0.0, 0.0, 1.0])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "forward",
                              [helper.make_tensor_value_info("x", elem_type, [1, 2])],
                              [helper.make_tensor_value_info("y", elem_type, [1, 2])], [weight])
    return helper.make_model(graph)


@pytest.mark.parametrize("precision, elem_type", [("fp32", TensorProto.FLOAT), ("fp16", TensorProto.FLOAT16),
                                                  ("bf16", TensorProto.BFLOAT16)])
def test_an_engine_is_built_only_from_a_graph_exported_in_its_precision(precision, elem_type):
    tensorrt_builder.check_graph_precision(weights_model(elem_type), precision)
    other = "fp16" if precision == "fp32" else "fp32"
    with pytest.raises(ValueError, match=f"a {other} engine needs them exported as"):
        tensorrt_builder.check_graph_precision(weights_model(elem_type), other)
    tensorrt_builder.check_graph_precision(branch_onnx.standalone_model(), other)  # no weights: any


def test_a_plugin_input_of_a_type_outside_its_signature_is_refused_before_tensorrt():
    model = verify_onnx.standalone_model()
    logits = next(i for i in model.graph.input if i.name == "target_logits")
    for elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):  # half-precision logits are fine
        logits.type.tensor_type.elem_type = elem_type
        strip_plugin_functions(model)
    logits.type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(ValueError, match="input target_logits .* is double; the FusedVerify plugin takes "
                                         "float32 or float16 or bfloat16"):
        strip_plugin_functions(model)


@pytest.mark.parametrize("version", ["10.8.0.43", "10.16.1", "11.0.0", "11.4.2.1"])
def test_supported_tensorrt_versions(version):
    check_tensorrt_version(version)


@pytest.mark.parametrize("version", ["10.7.0", "9.3.0", "12.0.0"])
def test_unsupported_tensorrt_versions_are_refused_with_the_range(version):
    with pytest.raises(ImportError, match=r">= 10.8, < 12"):
        check_tensorrt_version(version)


# --- BranchDraft's shape expressions on every TensorRT version admitted -----------------

SHAPE_PASS_VERSIONS = ["10.8.0.43", "10.14.1.48", "10.15.1.29", "11.4.0.106"]
BRANCH_EXTENTS = {"scores": ["rows", "vocab"], "draft_tokens": ["drafts"], "fanout": ["rows"], "context_length": []}


def branch_inputs(trt, scores_dtype: str = "float32") -> list:
    return [input_desc(trt, scores_dtype if spec.name == "scores" else spec.dtype, BRANCH_EXTENTS[spec.name])
            for spec in BRANCH_DRAFT.inputs]


@pytest.mark.parametrize("version", SHAPE_PASS_VERSIONS)
def test_branch_draft_makes_no_constant_while_shapes_are_fake(version):
    """TensorRT asks a plugin layer for its output types (fake shapes), then its shapes.
    Before 10.15 the second layer's types pass runs with the first shape pass's builder
    still referenced after TensorRT destroyed it: a constant made then is a use after
    free. Two layers, every version: types right, bounds right, no stale builder."""
    trt = fake_tensorrt(version)
    branch_trt._define_plugin(trt, trt.plugin)
    for _ in range(2):
        declared = dict(zip(BRANCH_DRAFT.output_names,
                            trt.plugin.layer(branch_trt.PLUGIN_ID, branch_inputs(trt), max_branches=16)))
    types = trt.plugin.output_types(branch_trt.PLUGIN_ID, [getattr(trt, s.dtype) for s in BRANCH_DRAFT.inputs],
                                    [s.rank for s in BRANCH_DRAFT.inputs], max_branches=16)
    assert types == [getattr(trt, spec.dtype) for spec in BRANCH_DRAFT.outputs]
    env = {"drafts": 4, "rows": 5, "vocab": 64}
    bounds = {name: (declared[name].opt.value(env), declared[name].upper_bound.value(env))
              for name in branch_trt.SIZE_TENSORS}
    assert bounds == {"branches": (8, 16), "mask_rows": (32, 64), "mask_cols": (36, 68)}


@pytest.mark.parametrize("version, stale", [("10.8.0.43", True), ("10.14.1.48", True), ("10.15.1.29", False),
                                            ("11.4.0.106", False)])
def test_the_stand_in_has_the_stale_builder_of_tensorrt_before_10_15(version, stale):
    """What the test above relies on: a shape function that turns an int into an
    expression in every pass (as BranchDraft's did) fails on a second layer before 10.15
    (tensorrt.plugin resets the builder only from release/10.15 on)."""
    trt = fake_tensorrt(version)

    @trt.plugin.register("test::IntBound")
    def int_bound(x, bound: int):
        return (trt.plugin.size_tensor(trt.plugin.ShapeExpr(bound), trt.plugin.ShapeExpr(bound)),)

    x = input_desc(trt, "int64", ["n"])
    trt.plugin.layer("test::IntBound", [x], bound=4)  # no builder has existed yet: fake, harmless
    if stale:
        with pytest.raises(StaleExpressionBuilder):
            trt.plugin.layer("test::IntBound", [x], bound=4)
    else:
        trt.plugin.layer("test::IntBound", [x], bound=4)


def test_size_tensor_expressions_take_no_arithmetic_as_in_tensorrt():
    trt = fake_tensorrt("10.8.0")
    trt.plugin.builder = ExpressionBuilder()
    size = trt.plugin.size_tensor(trt.plugin.ShapeExpr(2), trt.plugin.ShapeExpr(8))
    with pytest.raises(ValueError, match="size tensor"):
        size.expr() * 2
    with pytest.raises(ValueError, match="size tensor"):
        trt.plugin.ShapeExpr(3) + size.expr()
    with pytest.raises(TypeError):
        2 * trt.plugin.ShapeExpr(3)  # no reflected operators in tensorrt.plugin
    assert (trt.plugin.ShapeExpr(3) * 4).value({}) == 12


def test_branch_draft_takes_half_precision_scores_and_refuses_other_types():
    trt = fake_tensorrt("10.16.1")
    branch_trt._define_plugin(trt, trt.plugin)
    for dtype in ("float16", "bfloat16"):
        trt.plugin.layer(branch_trt.PLUGIN_ID, branch_inputs(trt, dtype), max_branches=8)
    inputs = branch_inputs(trt)
    inputs[2] = input_desc(trt, "int32", ["rows"])
    with pytest.raises(TypeError, match="fanout must be int64"):
        trt.plugin.layer(branch_trt.PLUGIN_ID, inputs, max_branches=8)


# --- a TensorRT engine directory built on CPU against the stand-in ------------------------

@pytest.fixture(scope="module")
def tensorrt_builds(tiny_pair, tmp_path_factory):
    """The tiny pair built for backend tensorrt at each precision through the real pipeline
    (checks, export, plugin graphs, manifest), TensorRT itself the stand-in."""
    builds = {}
    for precision in ("fp32", "fp16", "bf16"):
        trt = fake_tensorrt("10.13.3.9")
        config = BuildConfig(name=f"trt-{precision}", target=tiny_pair / "target", draft=tiny_pair / "draft",
                             backend="tensorrt", precision=precision, max_draft_tokens=4, max_branches=8,
                             max_context=64)
        out = tmp_path_factory.mktemp("trt") / precision
        with mock.patch.object(builder, "import_tensorrt", return_value=trt), \
                mock.patch.object(tensorrt_builder, "import_tensorrt", return_value=trt), \
                mock.patch.object(tensorrt_builder, "register_plugins"):
            build_engines(config, out, show_progress=False)
        builds[precision] = (out, trt)
    return builds


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_tensorrt_builds_export_in_their_precision_with_tf32_off(tensorrt_builds, precision):
    out, trt = tensorrt_builds[precision]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tensorrt"] == tensorrt_builder.manifest_entry(precision)
    dtype = TensorProto.DataType.Name(onnx_type(tensorrt_builder.EXPORT_DTYPES[precision])).lower()
    for role, stem in (("target", "forward"), ("target", "verify"), ("draft", "forward")):
        signature = manifest["models"][role]["signatures"][stem]
        kinds = {v["name"]: v["dtype"] for v in (*signature["inputs"], *signature["outputs"])}
        assert kinds["past_keys"] == kinds["present_values"] == dtype, (role, stem)
        assert kinds["logits"] == "float"  # the model's logits leave in float32 at any precision
    builds = trt.Builder.return_value.build_serialized_network.call_args_list
    assert len(builds) == 4  # target forward and verify, draft forward and branch_draft
    assert all(not config.get_flag(trt.BuilderFlag.TF32) for _, config in (call.args for call in builds))


def test_an_fp16_export_computes_what_the_fp16_model_computes(tensorrt_builds, tiny_pair):
    """ONNX Runtime runs the fp16 graph on CPU (it has no bf16 kernels): its logits are
    the fp16 torch model's, and its cache stays fp16 from step to step."""
    import onnxruntime
    import torch

    from saguaro.runtime.models.checkpoint import load_checkpoint

    out, _ = tensorrt_builds["fp16"]
    model = load_checkpoint(tiny_pair / "target").model.half()
    session = onnxruntime.InferenceSession(str(out / "target" / "forward.onnx"), providers=["CPUExecutionProvider"])
    tokens = torch.tensor([[0, 5, 9, 14, 3]])
    layers, heads, dim = model.shape.kv_shape
    empty = torch.zeros(layers, 1, heads, 0, dim, dtype=torch.float16)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    feeds = {"input_ids": tokens, "position_ids": torch.arange(5)[None], "attention_mask": mask,
             "past_keys": empty, "past_values": empty}
    logits, keys, _ = session.run(None, {name: value.numpy() for name, value in feeds.items()})
    with torch.no_grad():
        want, _, _ = model.forward_concat(*feeds.values())
    assert keys.dtype == np.float16
    assert np.abs(logits - want.numpy()).max() < 2e-2 * max(1.0, float(want.abs().max()))
    assert (logits.argmax(-1) == want.numpy().argmax(-1)).all()


@pytest.mark.parametrize("backend, given, expected", [("tensorrt", None, "fp16"), ("tensorrt", "auto", "fp16"),
                                                      ("tensorrt", "bf16", "bf16"), ("onnxruntime", None, "fp32"),
                                                      ("onnxruntime", "auto", "fp32")])
def test_a_config_without_a_precision_gets_its_backends_default(backend, given, expected):
    raw = {"name": "t", "target": "a", "draft": "b", "backend": backend}
    if given is not None:
        raw["precision"] = given
    assert config_from_dict(raw).precision == expected


def test_bf16_is_a_gpu_precision_only():
    with pytest.raises(ConfigError, match="precision='bf16' is not supported by backend onnxruntime"):
        config_from_dict({"name": "t", "target": "a", "draft": "b", "precision": "bf16"})
