"""BranchDraft and the KV gather as ONNX local functions of standard ops.

`saguaro::BranchDraft` (the ONNX Runtime implementation of `reference.plan_branches`),
with the inputs and outputs of `signature.SIGNATURE`: scores `[K+1, V]` float,
draft_tokens `[K]` int64, fanout `[K+1]` int64, context_length `[]` int64 in; depth
`[B]`, token `[B]`, rank `[B]`, positions `[K, B]` (int64), window_mask
`[K*B, K + K*B]` int32, and the 0-d int32 extents B, K*B, K + K*B out, with
B = sum(fanout). ONNX Runtime handles the data-dependent B natively (NonZero); for
TensorRT the node's `max_branches` attribute bounds it (see `tensorrt_plugin.py`).
`plan_nodes` is what a graph holds: the node, then a Cast of its int32 mask to the bool
`window_mask` the engines use.

`saguaro::GatherKV`: cache `[..., S, D]` (the export's `[layers, batch, heads, S, D]`),
start `[]` int64, source_indices `[n]` int64 -> the compacted cache `[..., start + n, D]`:
entries `[0, start)` then the entries at `source_indices`, in order. That is
`reference.gather_kv` followed by truncation to the live length, in the functional
(past in, present out) form the ONNX Runtime engine's concat-style KV cache uses.

`GraphBody` (the small node-list builder) is shared with FusedVerify's function.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from saguaro.plugins.branch_draft.signature import GATHER_NAME, GATHER_SIGNATURE, SIGNATURE
from saguaro.plugins.fused_verify.onnx_function import GraphBody
from saguaro.plugins.signature import value_infos

DOMAIN = SIGNATURE.namespace
INPUTS = SIGNATURE.input_names
OUTPUTS = SIGNATURE.output_names
# What a graph around the node exposes: the plan, with the mask as bool.
PLAN_OUTPUTS = ("depth", "token", "rank", "positions", "window_mask")
SIZE_OUTPUTS = tuple(spec.name for spec in SIGNATURE.outputs if spec.size_tensor)
STANDALONE_MAX_BRANCHES = 64  # the standalone model's bound; a built graph gets its engines' max_branches
NODE_ATTRIBUTES = SIGNATURE.node_attributes

GATHER_INPUTS = GATHER_SIGNATURE.input_names
GATHER_OUTPUTS = GATHER_SIGNATURE.output_names


def arange(g: GraphBody, count: str) -> str:
    """`[count]` int64 0..count-1 from a `[1]` int64 count."""
    end = g.op("Squeeze", count, g.const([0], np.int64))
    return g.op("Range", g.const(0, np.int64), end, g.const(1, np.int64))


def mask_draft_tokens(g: GraphBody, scores: str, draft_count: str) -> str:
    """`scores` with entry (j, d_{j+1}) set to -inf for j < K: a rejection's bonus differs."""
    rows = arange(g, draft_count)
    column = g.const([1], np.int64)
    indices = g.op("Concat", g.op("Unsqueeze", rows, column), g.op("Unsqueeze", "draft_tokens", column), axis=1)
    minus_inf = g.op("Expand", g.const(-np.inf), draft_count)
    return g.op("ScatterND", scores, indices, minus_inf)


def candidate_keys(g: GraphBody, scores: str, draft_count: str) -> tuple[str, str, str]:
    """`reference.candidate_keys`: (depth, token, rank) of the top-F_j tokens at each depth j.

    NonZero walks the `[K+1, widest]` keep-mask in row-major order, which is the
    reference's order (by depth, then rank).
    """
    masked = mask_draft_tokens(g, scores, draft_count)
    widest = g.op("Max", g.reduce("ReduceMax", "fanout", [0], keepdims=1), g.const([1], np.int64))
    _, top_tokens = g.op("TopK", masked, widest, outputs=2, axis=-1)
    ranks = arange(g, widest)
    keep = g.op("Less", g.op("Unsqueeze", ranks, g.const([0], np.int64)),
                g.op("Unsqueeze", "fanout", g.const([1], np.int64)))
    kept = g.op("NonZero", keep)
    depth = g.op("Gather", kept, g.const(0, np.int64), axis=0)
    rank = g.op("Gather", kept, g.const(1, np.int64), axis=0)
    token = g.op("GatherND", top_tokens, g.op("Transpose", kept, perm=[1, 0]))
    return depth, token, rank


def branch_positions(g: GraphBody, depth: str, draft_count: str) -> str:
    """`[K, B]`: context_length + depth_b + s."""
    steps = g.op("Unsqueeze", arange(g, draft_count), g.const([1], np.int64))
    start = g.op("Add", "context_length", g.op("Unsqueeze", depth, g.const([0], np.int64)))
    return g.op("Add", start, steps)


def step_and_branch_of_rows(g: GraphBody, draft_count: str, branches: str) -> tuple[str, str]:
    """For rows r = s*B + b of the `[K*B, ...]` layout: `[K*B]` s and `[K*B]` b."""
    grid = g.op("Concat", draft_count, branches, axis=0)
    rows = g.op("Mul", draft_count, branches)
    steps = g.op("Expand", g.op("Unsqueeze", arange(g, draft_count), g.const([1], np.int64)), grid)
    branch = g.op("Expand", g.op("Unsqueeze", arange(g, branches), g.const([0], np.int64)), grid)
    # allowzero: a computed size of 0 (K or B zero) means 0, not "copy the input's dimension"
    return g.op("Reshape", steps, rows, allowzero=1), g.op("Reshape", branch, rows, allowzero=1)


def tree_mask(g: GraphBody, depth: str, draft_count: str) -> str:
    """`reference.tree_mask` for K steps: drafts before the branch's depth, then its own chain."""
    branches = g.op("Shape", depth)
    sees_drafts = g.op("Less", g.op("Unsqueeze", arange(g, draft_count), g.const([0], np.int64)),
                       g.op("Unsqueeze", depth, g.const([1], np.int64)))
    repeats = g.op("Concat", draft_count, g.const([1], np.int64), axis=0)
    draft_part = g.op("Tile", sees_drafts, repeats)
    step, branch = step_and_branch_of_rows(g, draft_count, branches)
    row, col = g.const([1], np.int64), g.const([0], np.int64)
    same_branch = g.op("Equal", g.op("Unsqueeze", branch, row), g.op("Unsqueeze", branch, col))
    earlier_step = g.op("LessOrEqual", g.op("Unsqueeze", step, col), g.op("Unsqueeze", step, row))
    return g.op("Concat", draft_part, g.op("And", same_branch, earlier_step), axis=1)


def extents(g: GraphBody, depth: str, draft_count: str) -> tuple[str, str, str]:
    """The 0-d int32 extents B, K*B and K + K*B (TensorRT's size tensors)."""
    branches = g.op("Shape", depth)
    rows = g.op("Mul", draft_count, branches)
    cols = g.op("Add", draft_count, rows)
    return tuple(g.op("Cast", g.op("Squeeze", extent, g.const([0], np.int64)), to=TensorProto.INT32)
                 for extent in (branches, rows, cols))


def function_proto(opset: int = 17) -> onnx.FunctionProto:
    """`reference.plan_branches` as a local function in domain `saguaro`."""
    g = GraphBody("bd_", opset)
    scores = g.op("Cast", "scores", to=TensorProto.FLOAT)
    draft_count = g.op("Shape", "draft_tokens")
    depth, token, rank = candidate_keys(g, scores, draft_count)
    g.op("Identity", depth, outputs=["depth"])
    g.op("Identity", token, outputs=["token"])
    g.op("Identity", rank, outputs=["rank"])
    g.op("Identity", branch_positions(g, depth, draft_count), outputs=["positions"])
    g.op("Cast", tree_mask(g, depth, draft_count), to=TensorProto.INT32, outputs=["window_mask"])
    for name, extent in zip(SIZE_OUTPUTS, extents(g, depth, draft_count)):
        g.op("Identity", extent, outputs=[name])
    return helper.make_function(DOMAIN, SIGNATURE.name, list(INPUTS), list(OUTPUTS), g.nodes,
                                [helper.make_opsetid("", opset)], attributes=list(NODE_ATTRIBUTES))


def make_node(inputs: list[str], outputs: list[str], max_branches: int, name: str | None = None) -> onnx.NodeProto:
    """The custom-domain node, naming all eight outputs; `max_branches` bounds B for
    TensorRT's data-dependent shapes."""
    return SIGNATURE.make_node(inputs, outputs, name, max_branches=max_branches)


def plan_nodes(inputs: list[str], outputs: list[str], max_branches: int,
               name: str = SIGNATURE.name) -> list[onnx.NodeProto]:
    """The node and the Cast of its int32 mask: `outputs` names the `PLAN_OUTPUTS`, the mask
    among them bool; the extents get names of their own and stay inside the graph."""
    if len(outputs) != len(PLAN_OUTPUTS):
        raise ValueError(f"a branch plan gives {PLAN_OUTPUTS}, got {outputs}")
    *plan, mask = outputs
    node_outputs = [*plan, f"{mask}_int32", *(f"{name}_{extent}" for extent in SIZE_OUTPUTS)]
    return [make_node(inputs, node_outputs, max_branches, name),
            helper.make_node("Cast", [f"{mask}_int32"], [mask], name=f"{name}_mask_to_bool", to=TensorProto.BOOL)]


# Symbolic shapes of the standalone model's inputs and outputs.
STANDALONE_DIMS = {"scores": ["rows", "vocab"], "draft_tokens": ["drafts"], "fanout": ["rows"], "context_length": [],
                   "depth": ["branches"], "token": ["branches"], "rank": ["branches"],
                   "positions": ["drafts", "branches"], "window_mask": ["mask_rows", "mask_cols"]}


def standalone_model(opset: int = 17) -> onnx.ModelProto:
    """A model holding only the plan nodes (BranchDraft and its mask Cast) and the function."""
    inputs = value_infos(SIGNATURE.inputs, STANDALONE_DIMS)
    outputs = [helper.make_tensor_value_info(name, TensorProto.BOOL if name == "window_mask" else TensorProto.INT64,
                                             STANDALONE_DIMS[name]) for name in PLAN_OUTPUTS]
    graph = helper.make_graph(plan_nodes(list(INPUTS), list(PLAN_OUTPUTS), STANDALONE_MAX_BRANCHES), SIGNATURE.name,
                              inputs, outputs)
    return helper.make_model(graph, functions=[function_proto(opset)],
                             opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)])


def gather_function_proto(opset: int = 17) -> onnx.FunctionProto:
    """`saguaro::GatherKV`: keep `cache[..., :start, :]`, then append `cache[..., source_indices, :]`."""
    g = GraphBody("gkv_", opset)
    start = g.op("Reshape", "start", g.const([1], np.int64))
    entries_axis = g.const([-2], np.int64)
    prefix = g.op("Slice", "cache", g.const([0], np.int64), start, entries_axis)
    committed = g.op("Gather", "cache", "source_indices", axis=-2)
    g.op("Concat", prefix, committed, axis=-2, outputs=list(GATHER_OUTPUTS))
    return helper.make_function(DOMAIN, GATHER_NAME, list(GATHER_INPUTS), list(GATHER_OUTPUTS), g.nodes,
                                [helper.make_opsetid("", opset)],
                                attributes=list(GATHER_SIGNATURE.node_attributes))


def make_gather_node(inputs: list[str], outputs: list[str], name: str | None = None) -> onnx.NodeProto:
    return GATHER_SIGNATURE.make_node(inputs, outputs, name)


def gather_standalone_model(opset: int = 17) -> onnx.ModelProto:
    """A model holding only the GatherKV node and its function (float32 caches)."""
    cache_dims = ["layers", "batch", "heads", "entries", "head_dim"]
    inputs = [
        helper.make_tensor_value_info("cache", TensorProto.FLOAT, cache_dims),
        helper.make_tensor_value_info("start", TensorProto.INT64, []),
        helper.make_tensor_value_info("source_indices", TensorProto.INT64, ["committed"]),
    ]
    outputs = [helper.make_tensor_value_info("compacted", TensorProto.FLOAT,
                                             ["layers", "batch", "heads", "live", "head_dim"])]
    node = make_gather_node(list(GATHER_INPUTS), list(GATHER_OUTPUTS))
    graph = helper.make_graph([node], GATHER_NAME, inputs, outputs)
    return helper.make_model(graph, functions=[gather_function_proto(opset)],
                             opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)])
