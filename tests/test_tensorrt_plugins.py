"""The TensorRT side: plugin nodes stripped for the parser, profiles, registrations, builds.

What needs TensorRT itself (registering with `tensorrt.plugin`, building and running an
engine on a GPU) is in `test_gpu.py` (`scripts/gpu_check.sh`); here the ONNX-side
preparation and the builder's calls, against a stand-in of TensorRT 10.x and 11.x.
"""
from unittest import mock

import onnx
import pytest
from onnx import TensorProto, helper

from fake_tensorrt import fake_tensorrt
from saguaro.compiler import builder, tensorrt_builder
from saguaro.compiler.config import BuildConfig, ConfigError
from saguaro.compiler.tensorrt_builder import TensorRTBuildOptions, profile_shapes, strip_plugin_functions
from saguaro.plugins.branch_draft import PLUGIN_VERSION as BRANCH_VERSION
from saguaro.plugins.branch_draft import onnx_function as branch_onnx
from saguaro.plugins.branch_draft import tensorrt_plugin as branch_trt
from saguaro.plugins.fused_verify import PLUGIN_VERSION as VERIFY_VERSION
from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify import tensorrt_plugin as verify_trt
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
                                           "max_branches": branch_onnx.DEFAULT_MAX_BRANCHES}
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
    assert options.workspace_bytes == 1 << 29 and options.strongly_typed
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


@pytest.mark.parametrize("version, flags", [("10.8.0.43", 1 << 1), ("11.0.0", 0)])
def test_build_engine_drives_the_builder_api(tmp_path, version, flags):
    """On 10.x the network is created STRONGLY_TYPED (by name: the flag is 1 there); on 11
    every network is strongly typed and the deprecated flag (0 there) is not passed."""
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
    trt.Builder.return_value.create_builder_config.return_value.set_flag.assert_not_called()
    assert (tmp_path / "out" / "branch.plan").read_bytes() == b"plan-bytes"


def test_weak_typing_flags_only_where_tensorrt_still_has_them():
    weak_fp16 = TensorRTBuildOptions(precision="fp16", strongly_typed=False)
    trt, config = fake_tensorrt("10.9.0"), mock.MagicMock()
    tensorrt_builder.apply_precision(trt, config, weak_fp16)
    config.set_flag.assert_called_once_with(trt.BuilderFlag.FP16)
    assert tensorrt_builder.network_flags(trt, weak_fp16) == 0
    trt, config = fake_tensorrt("11.1.0"), mock.MagicMock()  # weak typing removed
    with pytest.raises(RuntimeError, match="no weak typing"):
        tensorrt_builder.apply_precision(trt, config, weak_fp16)
    config.set_flag.assert_not_called()
    tensorrt_builder.check_precision_support(trt, TensorRTBuildOptions(precision="fp32"))


def test_fp16_on_tensorrt_11_is_refused_before_any_export(tiny_pair):
    config = BuildConfig(name="fp16", target=tiny_pair / "target", draft=tiny_pair / "draft",
                         backend="tensorrt", precision="fp16")
    with mock.patch.object(builder, "import_tensorrt", return_value=fake_tensorrt("11.0.0")):
        with pytest.raises(ConfigError, match="precision=fp16.*no weak typing"):
            builder.check_backend(config)
    with mock.patch.object(builder, "import_tensorrt", return_value=fake_tensorrt("10.16.0")):
        builder.check_backend(config)


@pytest.mark.parametrize("version", ["10.8.0.43", "10.16.1", "11.0.0", "11.4.2.1"])
def test_supported_tensorrt_versions(version):
    check_tensorrt_version(version)


@pytest.mark.parametrize("version", ["10.7.0", "9.3.0", "12.0.0"])
def test_unsupported_tensorrt_versions_are_refused_with_the_range(version):
    with pytest.raises(ImportError, match=r">= 10.8, < 12"):
        check_tensorrt_version(version)
