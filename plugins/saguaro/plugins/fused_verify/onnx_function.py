"""FusedVerify as an ONNX local function of standard ops (the ONNX Runtime implementation).

The graph carries one custom-domain node, `saguaro::FusedVerify`, whose body is the
function below; ONNX Runtime inlines it, TensorRT's builder strips it and maps the node
to the registered plugin (`tensorrt_plugin.py`). The body follows `reference.py` op for
op, so both branches live in the graph: an `If` on `temperature < GREEDY_TEMPERATURE`
picks greedy or sampling, and the top-k / top-p filters are `If`s too, so a plain sampling round does not
pay for the full-vocabulary sorts they need.

Inputs: target_logits `[K+1, V]` float, draft_tokens `[K]` int64, draft_probs `[K, V]`
float, uniforms `[K+1]` float, temperature `[]` float, top_k `[]` int64, top_p `[]` float.
Outputs: accepted `[]` int64, bonus `[]` int64.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from saguaro.plugins.fused_verify.signature import SIGNATURE
from saguaro.plugins.probs import GREEDY_TEMPERATURE, NUCLEUS_WIDTHS
from saguaro.plugins.signature import value_infos

DOMAIN = SIGNATURE.namespace
INPUTS = SIGNATURE.input_names
OUTPUTS = SIGNATURE.output_names
# Declared so a node may carry them; the body ignores them (they are for TensorRT's parser).
NODE_ATTRIBUTES = SIGNATURE.node_attributes


class GraphBody:
    """Nodes of one graph body under construction; `op` returns the output name(s).

    Names get a per-body prefix because an `If` branch shares the value namespace of the
    graph around it (ONNX requires names to be unique across nested scopes).
    """

    def __init__(self, prefix: str, opset: int):
        self.prefix, self.opset = prefix, opset
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, **attributes):
        if isinstance(outputs, int):
            names = [f"{self.prefix}{len(self.nodes)}_{op_type}_{i}" for i in range(outputs)]
        else:
            names = list(outputs)
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attributes))
        return names[0] if len(names) == 1 else names

    def const(self, value, dtype=np.float32) -> str:
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype))
        return self.op("Constant", value=tensor)

    def reduce(self, op_type: str, x: str, axes: list[int] | None, keepdims: int) -> str:
        """Reductions other than ReduceSum take `axes` as an input only from opset 18."""
        if axes is None:
            return self.op(op_type, x, keepdims=keepdims)
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.op(op_type, x, self.const(axes, np.int64), keepdims=keepdims)
        return self.op(op_type, x, axes=axes, keepdims=keepdims)

    def first_rows(self, x: str, count: str) -> str:
        """`x[:count]` along axis 0; `count` is a `[1]` int64 tensor."""
        zero = self.const([0], np.int64)
        return self.op("Slice", x, zero, count, zero)

    def graph(self, name: str, outputs: list[tuple[str, int]]) -> onnx.GraphProto:
        """This body as an `If` branch producing `outputs` (name, element type)."""
        infos = [helper.make_tensor_value_info(n, t, None) for n, t in outputs]
        return helper.make_graph(self.nodes, name, [], infos)


def leading_true_count(g: GraphBody, flags: str) -> str:
    """Scalar int64: how many leading entries of bool `[K]` are True (K when all are).

    The index of the first False in `flags ‖ [False]`; ArgMax returns the first maximum.
    """
    stop = g.op("Concat", g.op("Not", flags), g.const([True], np.bool_), axis=0)
    return g.op("ArgMax", g.op("Cast", stop, to=TensorProto.FLOAT), axis=0, keepdims=0)


def vocab_size(g: GraphBody, rows: str) -> str:
    """`[1]` int64: the last dimension of `rows`."""
    return g.op("Shape", rows, start=-1)


def if_else(g: GraphBody, condition: str, then_body: GraphBody, then_out: str,
            else_out: str, element_type: int) -> str:
    """`then_out` computed in `then_body` when `condition`, else the outer value `else_out`."""
    other = GraphBody(then_body.prefix + "else_", g.opset)
    other.op("Identity", else_out, outputs=[other.prefix + "out"])
    return g.op("If", condition,
                then_branch=then_body.graph(then_body.prefix + "then", [(then_out, element_type)]),
                else_branch=other.graph(other.prefix + "graph", [(other.prefix + "out", element_type)]))


def filters_on(g: GraphBody, top_k: str, top_p: str, vocab: str) -> tuple[str, str]:
    """Bool scalars: top-k filters (0 < top_k < V), top-p filters (top_p < 1)."""
    vocab_scalar = g.op("Squeeze", vocab, g.const([0], np.int64))
    top_k_on = g.op("And", g.op("Greater", top_k, g.const(0, np.int64)), g.op("Less", top_k, vocab_scalar))
    return top_k_on, g.op("Less", top_p, g.const(1.0))


def top_k_filter(g: GraphBody, scaled: str, top_k: str, active: str) -> str:
    """Mask logits below the k-th largest with -inf when `active` (0 < top_k < V)."""
    body = GraphBody(g.prefix + "topk_", g.opset)
    k = body.op("Reshape", top_k, body.const([1], np.int64))
    largest, _ = body.op("TopK", scaled, k, outputs=2, axis=-1)
    kth_largest = body.reduce("ReduceMin", largest, [-1], keepdims=1)
    below = body.op("Less", scaled, kth_largest)
    masked = body.op("Where", below, body.const(-np.inf), scaled)
    return if_else(g, active, body, masked, scaled, TensorProto.FLOAT)


def top_p_filter(g: GraphBody, probs: str, top_p: str, vocab: str, active: str) -> str:
    """Nucleus filter when `active` (top_p < 1): keep the smallest prefix (by probability)
    whose mass reaches top_p, sorting only the head of each row (`probs.top_p_filter`)."""
    body = GraphBody(g.prefix + "topp_", g.opset)
    filtered = nucleus(body, probs, top_p, vocab, NUCLEUS_WIDTHS)
    return if_else(g, active, body, filtered, probs, TensorProto.FLOAT)


def nucleus(g: GraphBody, probs: str, top_p: str, vocab: str, widths: tuple[int, ...]) -> str:
    """The nucleus from the first `widths[0]` tokens of every row (at most V) when they hold
    top_p of the mass, else from the next width's, and so on; the last sorts the whole row."""
    width = vocab if not widths else g.op("Min", vocab, g.const([widths[0]], np.int64))
    sorted_probs, order = g.op("TopK", probs, width, outputs=2, axis=-1)
    cumulative = g.op("CumSum", sorted_probs, g.const(-1, np.int64))
    kept = g.op("Where", g.op("GreaterOrEqual", g.op("Sub", cumulative, sorted_probs), top_p),
                g.const(0.0), sorted_probs)
    head = g.op("ScatterElements", g.op("ConstantOfShape", g.op("Shape", probs)), order, kept, axis=-1)
    filtered = g.op("Div", head, g.reduce("ReduceSum", head, [-1], keepdims=1))
    if not widths:
        return filtered
    last = g.op("Slice", cumulative, g.const([-1], np.int64), g.const([np.iinfo(np.int64).max], np.int64),
                g.const([-1], np.int64))
    short = g.op("Less", g.reduce("ReduceMin", last, None, keepdims=0), top_p)  # some row's head holds less
    wider = GraphBody(f"{g.prefix}w{widths[0]}_", g.opset)
    return if_else(g, short, wider, nucleus(wider, probs, top_p, vocab, widths[1:]), filtered, TensorProto.FLOAT)


def logits_to_probs(g: GraphBody, logits: str, temperature: str, top_k: str, top_p: str) -> tuple[str, str]:
    """`plugins.probs.logits_to_probs`: temperature, then top-k, then top-p; and a bool
    scalar, whether either filter ran (the rows' mass then lies on few tokens)."""
    vocab = vocab_size(g, logits)
    top_k_on, top_p_on = filters_on(g, top_k, top_p, vocab)
    scaled = top_k_filter(g, g.op("Div", logits, temperature), top_k, top_k_on)
    probs = g.op("Softmax", scaled, axis=-1)
    return top_p_filter(g, probs, top_p, vocab, top_p_on), g.op("Or", top_k_on, top_p_on)


def sample_from(g: GraphBody, row: str, uniform: str, vocab: str, filtered: str) -> str:
    """`plugins.probs.sample_from` for one row `[V]`: the first index whose CDF exceeds
    u * total. `filtered` (a bool scalar): a top-k or top-p filter left the row's mass on
    a few tokens, whose CDF alone is summed (`NonZero`): adding a zero changes no float,
    so their partial sums are the whole row's at those tokens, and the first past the
    threshold is the same token (on SmolLM2's 49,152 tokens the CDF of the whole row was
    a third of a sampled K = 0 call)."""
    last = g.op("Squeeze", g.op("Sub", vocab, g.const([1], np.int64)), g.const([0], np.int64))
    few = GraphBody(g.prefix + "few_", g.opset)
    tokens = few.op("Squeeze", few.op("NonZero", few.op("Greater", row, few.const(0.0))), few.const([0], np.int64))
    first, none = first_past(few, few.op("Gather", row, tokens, axis=0), uniform)
    few.op("Where", none, last, few.op("Gather", tokens, first, axis=0), outputs=[few.prefix + "token"])
    every = GraphBody(g.prefix + "every_", g.opset)
    first, none = first_past(every, row, uniform)
    every.op("Where", none, last, first, outputs=[every.prefix + "token"])
    return g.op("If", filtered, then_branch=few.graph(few.prefix + "graph", [(few.prefix + "token", TensorProto.INT64)]),
                else_branch=every.graph(every.prefix + "graph", [(every.prefix + "token", TensorProto.INT64)]))


def first_past(g: GraphBody, values: str, uniform: str) -> tuple[str, str]:
    """The first index of `values` `[n]` (>= 0) whose running sum exceeds u times their
    total, and whether none does (u * total rounded up to the total: the reference then
    takes the vocabulary's last token). The sum never falls, so the indices at or below
    the threshold are a prefix and the first past it is ArgMax's first maximum over a
    byte per index (a sum of int64 flags had been a third of a sampled K = 0 call)."""
    cdf = g.op("CumSum", values, g.const(0, np.int64))
    total = g.op("Slice", cdf, g.const([-1], np.int64), g.const([np.iinfo(np.int64).max], np.int64))
    above = g.op("Cast", g.op("Greater", cdf, g.op("Mul", uniform, total)), to=TensorProto.UINT8)
    none = g.op("Equal", g.reduce("ReduceMax", above, None, keepdims=0), g.const(0, np.uint8))
    return g.op("ArgMax", above, axis=0, keepdims=0), none


def greedy_branch(opset: int, logits: str, draft_count: str) -> onnx.GraphProto:
    """Accept while the target's argmax equals the draft; bonus = argmax of the next row."""
    g = GraphBody("greedy_", opset)
    choices = g.op("ArgMax", logits, axis=-1, keepdims=0)
    matches = g.op("Equal", g.first_rows(choices, draft_count), "draft_tokens")
    accepted = leading_true_count(g, matches)
    g.op("Identity", accepted, outputs=["greedy_accepted"])
    g.op("Gather", choices, accepted, axis=0, outputs=["greedy_bonus"])
    return g.graph("greedy", [("greedy_accepted", TensorProto.INT64), ("greedy_bonus", TensorProto.INT64)])


def residual_row(g: GraphBody, probs: str, draft_probs: str, vocab: str, accepted: str) -> str:
    """`max(p - q, 0)` of the first row not accepted (q padded by a zero row, so after K
    accepted drafts it is p); p where that residual is empty. Only the row the bonus comes
    from: each is computed on its own, so it is the same row as among all K + 1 (which had
    cost a verify of K = 4 four rows of 49,152 for nothing).

    Left unnormalised: sampling by inverse CDF scales by the row total anyway.
    """
    zero_row = g.op("ConstantOfShape", g.op("Concat", g.const([1], np.int64), vocab, axis=0),
                    value=numpy_helper.from_array(np.zeros(1, np.float32)))
    p = g.op("Gather", probs, accepted, axis=0)
    q = g.op("Gather", g.op("Concat", draft_probs, zero_row, axis=0), accepted, axis=0)
    residual = g.op("Relu", g.op("Sub", p, q))
    empty = g.op("LessOrEqual", g.reduce("ReduceSum", residual, None, keepdims=0), g.const(0.0))
    return g.op("Where", empty, p, residual)


def sampling_branch(opset: int, logits: str, draft_count: str) -> onnx.GraphProto:
    """Leviathan et al.: accept d_j when u_j * q_j(d_j) < p_j(d_j); bonus from the residual."""
    g = GraphBody("sampling_", opset)
    probs, filtered = logits_to_probs(g, logits, "temperature", "top_k", "top_p")
    vocab = vocab_size(g, probs)
    draft_probs = g.op("Cast", "draft_probs", to=TensorProto.FLOAT)
    draft_index = g.op("Unsqueeze", "draft_tokens", g.const([1], np.int64))
    axis_1 = g.const([1], np.int64)
    p_draft = g.op("Squeeze", g.op("GatherElements", g.first_rows(probs, draft_count), draft_index, axis=1), axis_1)
    q_draft = g.op("Squeeze", g.op("GatherElements", draft_probs, draft_index, axis=1), axis_1)
    u_accept = g.first_rows("uniforms", draft_count)
    accepted = leading_true_count(g, g.op("Less", g.op("Mul", u_accept, q_draft), p_draft))
    u_bonus = g.op("Gather", "uniforms", g.op("Squeeze", draft_count, g.const([0], np.int64)), axis=0)
    row = residual_row(g, probs, draft_probs, vocab, accepted)
    g.op("Identity", accepted, outputs=["sampling_accepted"])
    g.op("Identity", sample_from(g, row, u_bonus, vocab, filtered), outputs=["sampling_bonus"])
    return g.graph("sampling", [("sampling_accepted", TensorProto.INT64), ("sampling_bonus", TensorProto.INT64)])


def function_proto(opset: int = 17) -> onnx.FunctionProto:
    """The op as a local function in domain `saguaro`, built from standard ops of `opset`."""
    g = GraphBody("fv_", opset)
    logits = g.op("Cast", "target_logits", to=TensorProto.FLOAT)
    draft_count = g.op("Shape", "draft_tokens")
    is_greedy = g.op("Less", "temperature", g.const(GREEDY_TEMPERATURE))  # never a division by a tiny T
    g.op("If", is_greedy, outputs=list(OUTPUTS),
         then_branch=greedy_branch(opset, logits, draft_count),
         else_branch=sampling_branch(opset, logits, draft_count))
    return helper.make_function(DOMAIN, SIGNATURE.name, list(INPUTS), list(OUTPUTS), g.nodes,
                                [helper.make_opsetid("", opset)], attributes=list(NODE_ATTRIBUTES))


def make_node(inputs: list[str], outputs: list[str], name: str | None = None) -> onnx.NodeProto:
    """The custom-domain node; `plugin_namespace` / `plugin_version` let TensorRT find the plugin."""
    return SIGNATURE.make_node(inputs, outputs, name)


# Symbolic shapes of the standalone model's inputs and outputs.
STANDALONE_DIMS = {"target_logits": ["rows", "vocab"], "draft_tokens": ["drafts"], "draft_probs": ["drafts", "vocab"],
                   "uniforms": ["rows"], "temperature": [], "top_k": [], "top_p": [], "accepted": [], "bonus": []}


def standalone_model(opset: int = 17) -> onnx.ModelProto:
    """A model holding only the node and its function: the op runs on its own in ONNX Runtime."""
    inputs, outputs = (value_infos(specs, STANDALONE_DIMS) for specs in (SIGNATURE.inputs, SIGNATURE.outputs))
    graph = helper.make_graph([make_node(list(INPUTS), list(OUTPUTS))], SIGNATURE.name, inputs, outputs)
    return helper.make_model(graph, functions=[function_proto(opset)],
                             opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)])
