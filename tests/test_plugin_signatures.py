"""The plugins' signatures against both of their forms, on any machine.

TensorRT's ONNX parser maps a plugin node to the registered plugin only if the node names
exactly the plugin's outputs (onnx-tensorrt >= 10.6), and plugins cannot take or give
bool / uint8 tensors. Here the `tensorrt.plugin` registrations run against a recording
stand-in (`fake_tensorrt.py`), so what they declare is compared with the one signature the
ONNX side is built from; the exported graphs themselves are checked in
`test_exported_graphs.py`.
"""
import inspect
import typing

import numpy as np
import pytest
import torch
from fake_tensorrt import SizeTensorDesc, fake_tensorrt, input_desc

from saguaro.compiler.tensorrt_builder import PLUGIN_SIGNATURES, check_plugin_node
from saguaro.plugins.branch_draft import onnx_function as branch_onnx
from saguaro.plugins.branch_draft import tensorrt_plugin as branch_trt
from saguaro.plugins.branch_draft.reference import plan_branches
from saguaro.plugins.branch_draft.signature import SIGNATURE as BRANCH_DRAFT
from saguaro.plugins.branch_draft.signature import output_shapes
from saguaro.plugins.branch_draft.triton_kernel import launch_plan_outputs
from saguaro.plugins.fused_verify import onnx_function as verify_onnx
from saguaro.plugins.fused_verify import tensorrt_plugin as verify_trt
from saguaro.plugins.fused_verify.signature import SIGNATURE as FUSED_VERIFY
from saguaro.plugins.signature import UNSUPPORTED_PLUGIN_TYPES, PluginSignature, TensorSpec

REGISTRATIONS = {"FusedVerify": verify_trt, "BranchDraft": branch_trt}
# symbolic extents of each plugin's inputs
INPUT_EXTENTS = {"target_logits": ["rows", "vocab"], "draft_tokens": ["drafts"], "draft_probs": ["drafts", "vocab"],
                 "uniforms": ["rows"], "scores": ["rows", "vocab"], "fanout": ["rows"]}
TORCH_TYPES = {"int64": torch.int64, "int32": torch.int32}


def registered(module):
    """The shape and implementation functions a plugin module registers, on a fake TensorRT."""
    trt = fake_tensorrt()
    module._define_plugin(trt, trt.plugin)
    plugin_id = module.PLUGIN_ID
    return trt, trt.plugin.shape_functions[plugin_id], trt.plugin.implementations[plugin_id]


def test_every_tensorrt_plugin_is_registered_and_every_registration_has_a_signature():
    assert {name for name, s in PLUGIN_SIGNATURES.items() if s.tensorrt} == set(REGISTRATIONS)
    assert not PLUGIN_SIGNATURES["GatherKV"].tensorrt


@pytest.mark.parametrize("name", sorted(name for name, s in PLUGIN_SIGNATURES.items() if s.tensorrt))
def test_no_plugin_takes_or_gives_bool_or_uint8(name):
    signature = PLUGIN_SIGNATURES[name]
    for spec in (*signature.inputs, *signature.outputs):
        assert not set(spec.dtypes) & set(UNSUPPORTED_PLUGIN_TYPES), (name, spec)


def test_a_signature_with_a_bool_plugin_output_is_refused():
    with pytest.raises(ValueError, match="int32"):
        PluginSignature("Bad", "saguaro", "1", inputs=(), outputs=(TensorSpec("mask", ("bool",), 2),))
    PluginSignature("OnnxOnly", "saguaro", "1", inputs=(), outputs=(TensorSpec("mask", ("bool",), 2),),
                    tensorrt=False)


@pytest.mark.parametrize("name", sorted(REGISTRATIONS))
def test_registration_declares_the_signature(name):
    """Parameter names (inputs, then attributes), output count, types, ranks and which
    outputs are size tensors: all as the signature says."""
    signature = PLUGIN_SIGNATURES[name]
    trt, shapes, launch = registered(REGISTRATIONS[name])
    parameters = list(inspect.signature(shapes).parameters)
    assert parameters == [*signature.input_names, *signature.attributes]
    descs = [input_desc(trt, spec.dtype, INPUT_EXTENTS.get(spec.name, [])) for spec in signature.inputs]
    declared = trt.plugin.layer(REGISTRATIONS[name].PLUGIN_ID, descs,
                                **{attribute: 16 for attribute in signature.attributes})
    assert len(declared) == len(signature.outputs)
    for spec, desc in zip(signature.outputs, declared):
        assert desc.dtype == getattr(trt, spec.dtype), spec.name
        assert spec.dtype not in UNSUPPORTED_PLUGIN_TYPES
        assert isinstance(desc, SizeTensorDesc) == spec.size_tensor, spec.name
        if not spec.size_tensor:
            assert len(desc.shape_expr) == spec.rank, spec.name
    returned = typing.get_args(inspect.signature(shapes).return_annotation)
    assert len(returned) == len(signature.outputs)
    launch_parameters = list(inspect.signature(launch).parameters)
    assert launch_parameters == [*signature.input_names, *signature.attributes, "outputs", "stream"]
    assert len(typing.get_args(inspect.signature(launch).parameters["outputs"].annotation)) == len(signature.outputs)


def test_fused_verify_refuses_input_types_outside_its_signature():
    trt, shapes, _ = registered(verify_trt)
    descs = {spec.name: input_desc(trt, spec.dtype, INPUT_EXTENTS.get(spec.name, [])) for spec in FUSED_VERIFY.inputs}
    shapes(**{**descs, "target_logits": input_desc(trt, "float16", ["rows", "vocab"])})  # fp16 logits are fine
    with pytest.raises(TypeError, match="draft_tokens"):
        shapes(**{**descs, "draft_tokens": input_desc(trt, "int32", ["drafts"])})


@pytest.mark.parametrize("drafts, max_branches", [(4, 16), (0, 8), (1, 1)])
def test_branch_draft_shapes_follow_the_signature_extents(drafts, max_branches):
    """At the size tensors' bounds the declared shapes are `output_shapes(K, max_branches)`,
    and the bounds B <= max_branches, K*B, K + K*B are what the plugin promises TensorRT."""
    trt, _, _ = registered(branch_trt)
    descs = [input_desc(trt, spec.dtype, INPUT_EXTENTS.get(spec.name, [])) for spec in BRANCH_DRAFT.inputs]
    declared = dict(zip(BRANCH_DRAFT.output_names, trt.plugin.layer(branch_trt.PLUGIN_ID, descs,
                                                                    max_branches=max_branches)))
    env = {"drafts": drafts, "rows": drafts + 1, "vocab": 50}
    expected = output_shapes(drafts, max_branches)
    for spec in BRANCH_DRAFT.outputs:
        desc = declared[spec.name]
        if spec.size_tensor:
            assert desc.upper_bound.value(env) == {"branches": max_branches, "mask_rows": drafts * max_branches,
                                                   "mask_cols": drafts + drafts * max_branches}[spec.name]
        else:
            assert tuple(extent.value(env) for extent in desc.shape_expr) == expected[spec.name], spec.name


@pytest.mark.parametrize("k, fanout", [(3, [2, 1, 0, 2]), (0, [3]), (2, [0, 0, 0])])
def test_branch_draft_plugin_body_fills_the_signature_outputs(k, fanout):
    """The body the TensorRT plugin runs (`launch_plan_outputs`, OpenAI Triton kernels on
    the CPU interpreter here) writes all eight outputs in signature order and types."""
    scores = torch.randn(k + 1, 23, generator=torch.Generator().manual_seed(k))
    drafts, fanout = scores[:k].argmax(-1), torch.tensor(fanout)
    buffers = []

    def output(index, shape, dtype):
        assert dtype == BRANCH_DRAFT.outputs[index].dtype
        buffers.append(torch.full(shape, -7, dtype=TORCH_TYPES[dtype]))
        return buffers[-1]

    launch_plan_outputs(scores, drafts, fanout, torch.tensor([5]), 16, output)
    got = dict(zip(BRANCH_DRAFT.output_names, buffers))
    expected = plan_branches(scores, drafts, fanout, 5)
    for name in ("depth", "token", "rank", "positions"):
        assert torch.equal(got[name], getattr(expected, name)), name
    assert torch.equal(got["window_mask"], expected.window_mask.to(torch.int32))
    b = int(fanout.sum())
    assert [int(got[name]) for name in ("branches", "mask_rows", "mask_cols")] == [b, k * b, k + k * b]
    with pytest.raises(ValueError, match="max_branches"):
        launch_plan_outputs(scores, drafts, fanout + 5, torch.tensor([5]), b, output)


def test_onnx_nodes_name_every_signature_output():
    for model in (verify_onnx.standalone_model(), branch_onnx.standalone_model()):
        for node in model.graph.node:
            if node.domain == "saguaro":
                check_plugin_node(node)
                assert len(node.output) == len(PLUGIN_SIGNATURES[node.op_type].outputs)


def test_a_node_naming_fewer_outputs_than_its_plugin_is_refused_before_tensorrt():
    """What onnx-tensorrt >= 10.6 rejects ("Node has more output tensors than TRT expected")."""
    node = branch_onnx.make_node(list(branch_onnx.INPUTS), list(branch_onnx.OUTPUTS), branch_onnx.STANDALONE_MAX_BRANCHES)
    del node.output[5:]
    with pytest.raises(ValueError, match="names 5 outputs; the plugin has 8"):
        check_plugin_node(node)
    node.output.extend(["", "", ""])  # empty names do not count for the parser either
    with pytest.raises(ValueError, match="names 5 outputs"):
        check_plugin_node(node)
    with pytest.raises(ValueError, match="every one named"):
        BRANCH_DRAFT.make_node(list(branch_onnx.INPUTS), list(branch_onnx.PLAN_OUTPUTS), max_branches=4)


def test_gather_kv_never_reaches_tensorrt():
    node = branch_onnx.make_gather_node(["cache", "start", "source_indices"], ["compacted"])
    with pytest.raises(ValueError, match="no TensorRT plugin"):
        check_plugin_node(node)


def test_plugin_output_buffer_types_have_array_interface_strings():
    """Every type a plugin output can have maps to a `__cuda_array_interface__` type string."""
    from saguaro.plugins.tensorrt_registry import DeviceBuffer

    for name in REGISTRATIONS:
        for spec in PLUGIN_SIGNATURES[name].outputs:
            interface = DeviceBuffer(256, (2,), spec.dtype).__cuda_array_interface__
            assert np.dtype(interface["typestr"]) == np.dtype(spec.dtype)
