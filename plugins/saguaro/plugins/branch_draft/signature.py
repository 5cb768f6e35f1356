"""BranchDraft's and GatherKV's signatures (see `saguaro.plugins.signature`).

B = sum(fanout) is data-dependent, so on TensorRT the outputs have data-dependent shapes
with a size tensor per extent (`tensorrt.plugin` forbids arithmetic on size-tensor
expressions, so the mask's extents K*B and K + K*B get size tensors of their own). Those
three are outputs of the plugin, so the ONNX node names them too; the graph leaves them
dangling. The tree mask leaves the op as int32 (plugins cannot give bool tensors, and
TensorRT's int8 is a quantized type) and the graph casts it to bool after the node, on
every backend alike.

GatherKV is an ONNX-only op: TensorRT engines commit a branch in place between engine
calls instead (see `tensorrt_plugin.py`).
"""
from __future__ import annotations

from saguaro.plugins.branch_draft import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from saguaro.plugins.signature import FLOAT_TYPES, PluginSignature, TensorSpec

SIGNATURE = PluginSignature(
    name=PLUGIN_NAME, namespace=PLUGIN_NAMESPACE, version=PLUGIN_VERSION,
    inputs=(TensorSpec("scores", FLOAT_TYPES, 2),       # [K+1, V]
            TensorSpec("draft_tokens", ("int64",), 1),  # [K]
            TensorSpec("fanout", ("int64",), 1),        # [K+1]
            TensorSpec("context_length", ("int64",), 0)),
    outputs=(TensorSpec("depth", ("int64",), 1),        # [B]
             TensorSpec("token", ("int64",), 1),        # [B]
             TensorSpec("rank", ("int64",), 1),         # [B]
             TensorSpec("positions", ("int64",), 2),    # [K, B]
             TensorSpec("window_mask", ("int32",), 2),  # [K*B, K + K*B], 0 or 1
             TensorSpec("branches", ("int32",), 0, size_tensor=True),   # B
             TensorSpec("mask_rows", ("int32",), 0, size_tensor=True),  # K*B
             TensorSpec("mask_cols", ("int32",), 0, size_tensor=True)),  # K + K*B
    # TensorRT needs a static bound on B to size the data-dependent outputs.
    attributes=("max_branches",),
)


def output_shapes(num_drafts: int, branches: int) -> dict[str, tuple[int, ...]]:
    """Each output's shape for K drafts and B branches (the size tensors are 0-d)."""
    k, b = num_drafts, branches
    return {"depth": (b,), "token": (b,), "rank": (b,), "positions": (k, b), "window_mask": (k * b, k + k * b),
            "branches": (), "mask_rows": (), "mask_cols": ()}


def extent_values(num_drafts: int, branches: int) -> dict[str, int]:
    """What the size tensors hold: B, K*B and K + K*B."""
    k, b = num_drafts, branches
    return {"branches": b, "mask_rows": k * b, "mask_cols": k + k * b}


GATHER_NAME = "GatherKV"
GATHER_SIGNATURE = PluginSignature(
    name=GATHER_NAME, namespace=PLUGIN_NAMESPACE, version=PLUGIN_VERSION,
    inputs=(TensorSpec("cache", FLOAT_TYPES, 5),        # [layers, batch, heads, S, D]
            TensorSpec("start", ("int64",), 0),
            TensorSpec("source_indices", ("int64",), 1)),
    outputs=(TensorSpec("compacted", FLOAT_TYPES, 5),),  # [layers, batch, heads, start + n, D]
    tensorrt=False,
)
