"""BranchDraft and the KV gather as ONNX local functions of standard ops.

`saguaro::BranchDraft` (the ONNX Runtime implementation of `reference.plan_branches`):
inputs scores `[K+1, V]` float, draft_tokens `[K]` int64, fanout `[K+1]` int64,
context_length `[]` int64; outputs depth `[B]`, token `[B]`, rank `[B]` (int64),
positions `[K, B]` int64, window_mask `[K*B, K + K*B]` bool, with B = sum(fanout).
ONNX Runtime handles the data-dependent B natively (NonZero); for TensorRT the node's
`max_branches` attribute bounds it (see `tensorrt_plugin.py`).

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

from saguaro.plugins.branch_draft import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from saguaro.plugins.fused_verify.onnx_function import GraphBody

DOMAIN = PLUGIN_NAMESPACE
INPUTS = ("scores", "draft_tokens", "fanout", "context_length")
OUTPUTS = ("depth", "token", "rank", "positions", "window_mask")
# TensorRT needs a static bound on B = sum(fanout) to size the data-dependent outputs.
DEFAULT_MAX_BRANCHES = 64
NODE_ATTRIBUTES = ("plugin_namespace", "plugin_version", "max_branches")

GATHER_NAME = "GatherKV"
GATHER_INPUTS = ("cache", "start", "source_indices")
GATHER_OUTPUTS = ("compacted",)


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
    g.op("Identity", tree_mask(g, depth, draft_count), outputs=["window_mask"])
    return helper.make_function(DOMAIN, PLUGIN_NAME, list(INPUTS), list(OUTPUTS), g.nodes,
                                [helper.make_opsetid("", opset)], attributes=list(NODE_ATTRIBUTES))


def make_node(inputs: list[str], outputs: list[str], name: str | None = None,
              max_branches: int = DEFAULT_MAX_BRANCHES) -> onnx.NodeProto:
    """The custom-domain node; `max_branches` bounds B for TensorRT's data-dependent shapes."""
    if len(inputs) != len(INPUTS) or len(outputs) != len(OUTPUTS):
        raise ValueError(f"{PLUGIN_NAME} takes inputs {INPUTS} and gives outputs {OUTPUTS}")
    return helper.make_node(PLUGIN_NAME, inputs, outputs, name=name or PLUGIN_NAME, domain=DOMAIN,
                            plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION,
                            max_branches=max_branches)


def standalone_model(opset: int = 17) -> onnx.ModelProto:
    """A model holding only the BranchDraft node and its function."""
    int64 = TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["rows", "vocab"]),
        helper.make_tensor_value_info("draft_tokens", int64, ["drafts"]),
        helper.make_tensor_value_info("fanout", int64, ["rows"]),
        helper.make_tensor_value_info("context_length", int64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("depth", int64, ["branches"]),
        helper.make_tensor_value_info("token", int64, ["branches"]),
        helper.make_tensor_value_info("rank", int64, ["branches"]),
        helper.make_tensor_value_info("positions", int64, ["drafts", "branches"]),
        helper.make_tensor_value_info("window_mask", TensorProto.BOOL, ["mask_rows", "mask_cols"]),
    ]
    graph = helper.make_graph([make_node(list(INPUTS), list(OUTPUTS))], PLUGIN_NAME, inputs, outputs)
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
                                attributes=["plugin_namespace", "plugin_version"])


def make_gather_node(inputs: list[str], outputs: list[str], name: str | None = None) -> onnx.NodeProto:
    return helper.make_node(GATHER_NAME, inputs, outputs, name=name or GATHER_NAME, domain=DOMAIN,
                            plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)


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
