"""The TensorRT export: the Llama forward traced to standard ONNX ops (TensorRT parses and
fuses those itself), and the plugin graphs assembled around it. ONNX Runtime engines use
`fused_export` instead; `branch_draft_model` serves both backends.

TensorRT engines are a few graphs rather than one graph with many outputs, so each holds
exactly the work of one kind of call:

  forward       (both models) the model: logits + present K/V; prefill, decode steps and
                tree steps (any query length, explicit mask).
  verify        (target) forward + a `FusedVerify` node: the round's outcome (accepted,
                bonus) without [K+1, V] logits leaving the engine; `logits` remains an
                output for debugging only (the engine never fetches it). Batch 1.
  branch_draft  (draft) the `BranchDraft` node alone: branch keys, positions, tree mask.
                No weights; it runs once per round between the glue and the tree steps.

Forward I/O (the layout of `runtime.llama.Llama.forward_concat`):
  input_ids, position_ids [batch, n] int64; attention_mask [batch, n, past + n] bool;
  past_keys, past_values [layers, batch, kv_heads, past, head_dim] in the model's dtype
  -> logits [batch, n, vocab] float32; present_keys, present_values [.., past + n, ..].
The two target graphs share one external weights file on disk (`weights.bin`).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from saguaro.plugins.branch_draft import onnx_function as branch_draft_onnx
from saguaro.plugins.fused_verify import onnx_function as fused_verify_onnx
from saguaro.runtime.models.llama import Llama

FORWARD_INPUTS = ("input_ids", "position_ids", "attention_mask", "past_keys", "past_values")
FORWARD_OUTPUTS = ("logits", "present_keys", "present_values")
VERIFY_INPUTS = ("draft_tokens", "draft_probs", "uniforms", "temperature", "top_k", "top_p")
VERIFY_OUTPUTS = ("accepted", "bonus")
BRANCH_INPUTS = ("scores", "draft_tokens", "fanout", "context_length")
BRANCH_OUTPUTS = ("depth", "token", "rank", "positions", "window_mask")
WEIGHTS_FILE = "weights.bin"

# Symbolic dimension names: the ORT and TensorRT backends read shapes by these names.
FORWARD_AXES = {
    "input_ids": {0: "batch", 1: "n"}, "position_ids": {0: "batch", 1: "n"},
    "attention_mask": {0: "batch", 1: "n", 2: "total"},
    "past_keys": {1: "batch", 3: "past"}, "past_values": {1: "batch", 3: "past"},
    "logits": {0: "batch", 1: "n"},
    "present_keys": {1: "batch", 3: "total"}, "present_values": {1: "batch", 3: "total"},
}


class _ForwardConcat(torch.nn.Module):
    """`torch.onnx.export` traces `forward`; this points it at the export form."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, past_keys, past_values):
        return self.model.forward_concat(input_ids, position_ids, attention_mask, past_keys, past_values)


def example_forward_inputs(model: Llama, batch: int = 2, n: int = 3, past: int = 5):
    """Distinct sizes per axis, so the tracer cannot mistake one dynamic axis for another.
    The cache is in the weights' dtype (a half-precision model keeps a half-precision cache)."""
    layers, heads, dim = model.shape.kv_shape
    dtype = model.lm_head.weight.dtype
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past).expand(batch, n, past + n)
    return (torch.zeros(batch, n, dtype=torch.int64),
            torch.arange(past, past + n).expand(batch, n).contiguous(), mask.contiguous(),
            torch.zeros(layers, batch, heads, past, dim, dtype=dtype),
            torch.zeros(layers, batch, heads, past, dim, dtype=dtype))


def export_forward(model: Llama, path: Path, opset: int) -> onnx.ModelProto:
    """Export `forward_concat` (TorchScript exporter: no onnxscript needed, and with torch
    2.13 it gives a plain graph of standard ops that matches torch to ~1e-7)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python ints in shapes
        torch.onnx.export(_ForwardConcat(model.eval()), example_forward_inputs(model), str(path),
                          dynamo=False, opset_version=opset, do_constant_folding=True,
                          input_names=list(FORWARD_INPUTS), output_names=list(FORWARD_OUTPUTS),
                          dynamic_axes=FORWARD_AXES)
    proto = onnx.load(str(path))
    proto.graph.name = "forward"
    onnx.checker.check_model(proto)
    return proto


def _value(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _add_plugin(model: onnx.ModelProto, function: onnx.FunctionProto) -> None:
    """Attach a plugin's local function (what ORT runs) and import its domain."""
    if not any(f.name == function.name and f.domain == function.domain for f in model.functions):
        model.functions.append(function)
    if not any(o.domain == function.domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(function.domain, 1))


def assemble_verify(forward: onnx.ModelProto, opset: int, vocab_size: int) -> onnx.ModelProto:
    """The target's verify graph: forward, row 0 of the batch, then `FusedVerify`."""
    verify = onnx.ModelProto()
    verify.CopyFrom(forward)
    graph = verify.graph
    graph.name = "verify"
    graph.input.extend([
        _value("draft_tokens", TensorProto.INT64, ["k"]),
        _value("draft_probs", TensorProto.FLOAT, ["k", vocab_size]),
        _value("uniforms", TensorProto.FLOAT, ["k_plus_1"]),
        _value("temperature", TensorProto.FLOAT, []),
        _value("top_k", TensorProto.INT64, []),
        _value("top_p", TensorProto.FLOAT, []),
    ])
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(0, dtype=np.int64), "verify_batch_row"))
    graph.node.append(helper.make_node("Gather", ["logits", "verify_batch_row"], ["target_logits"], axis=0))
    graph.node.append(fused_verify_onnx.make_node(
        ["target_logits", *VERIFY_INPUTS], list(VERIFY_OUTPUTS)))
    debug_logits = [o for o in graph.output if o.name == "logits"]
    presents = [o for o in graph.output if o.name != "logits"]
    del graph.output[:]
    graph.output.extend([_value("accepted", TensorProto.INT64, []), _value("bonus", TensorProto.INT64, []),
                         *presents, *debug_logits])
    _add_plugin(verify, fused_verify_onnx.function_proto(opset))
    return verify


def branch_draft_model(opset: int, max_branches: int) -> onnx.ModelProto:
    """The draft's plan graph: the `BranchDraft` node (all eight outputs named, as TensorRT's
    parser requires) and the Cast of its int32 mask to bool; nothing else."""
    nodes = branch_draft_onnx.plan_nodes(list(BRANCH_INPUTS), list(BRANCH_OUTPUTS), max_branches)
    graph = helper.make_graph(
        nodes, "branch_draft",
        [_value("scores", TensorProto.FLOAT, ["k_plus_1", "vocab"]),
         _value("draft_tokens", TensorProto.INT64, ["k"]),
         _value("fanout", TensorProto.INT64, ["k_plus_1"]),
         _value("context_length", TensorProto.INT64, [])],
        [_value("depth", TensorProto.INT64, ["branches"]), _value("token", TensorProto.INT64, ["branches"]),
         _value("rank", TensorProto.INT64, ["branches"]),
         _value("positions", TensorProto.INT64, ["k", "branches"]),
         _value("window_mask", TensorProto.BOOL, ["tree", "window"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    _add_plugin(model, branch_draft_onnx.function_proto(opset))
    return model


def save_sharing_weights(models: dict[str, onnx.ModelProto], folder: Path) -> dict[str, Path]:
    """Save graphs that hold the same initializers (forward and verify) with one external
    weights file: the first model writes it, the others only reference it."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for index, (stem, model) in enumerate(models.items()):
        path = folder / f"{stem}.onnx"
        if index == 0:
            (folder / WEIGHTS_FILE).unlink(missing_ok=True)  # onnx appends to an existing file
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=WEIGHTS_FILE, size_threshold=1024)
            written = onnx.load(str(path), load_external_data=False)
            references = {t.name: t for t in written.graph.initializer}
        else:
            _point_at_written_weights(model, references)
            onnx.save_model(model, str(path))
        paths[stem] = path
    return paths


def _point_at_written_weights(model: onnx.ModelProto, references: dict[str, onnx.TensorProto]) -> None:
    for tensor in model.graph.initializer:
        written = references.get(tensor.name)
        if written is not None and written.data_location == TensorProto.EXTERNAL:
            tensor.CopyFrom(written)
