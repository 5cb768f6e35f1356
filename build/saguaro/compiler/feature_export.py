"""The ONNX Runtime graphs of a feature draft (an EAGLE-3 head, `runtime.feature_head`),
written with `fused_export`'s writers: the head's one decoder layer is a target layer in
every op but what goes into it.

    model    Gather(embed) -> RMSNorm ; RMSNorm(hidden) -> Concat (2 x hidden wide)
             -> packed QKV -> GroupQueryAttention -> o projection
             -> SkipSimplifiedLayerNormalization (the residual: the feature itself)
             -> gate, up -> SiLU * up -> down -> SkipSimplifiedLayerNormalization
             (its sum: hidden_out) -> lm_head over the draft vocabulary (the
             engine spreads those scores over the target vocabulary: `scored_tokens`)
    project  the target's joined features -> fc -> the head's hidden width

The head's embedding table is the target's (`embed_tokens`), held in the head's graph.

I/O of `model`: `fused_export`'s inputs, plus `hidden` [B, S, hidden] float32 (for the
token at p, the feature of p - 1) and one layer of past K/V -> logits [B, S,
draft_vocab_size] float32 (the metadata's `SCORED_TOKENS_KEY` names each row's token),
`hidden_out` [B, S, hidden] float32, present_key.0, present_value.0. `project`: `features`
[N, feature_width] float32 -> `projected` [N, hidden] float32. Both graphs are quantised
as the models' are (`quantization.quantize`: int8 / int4 MatMulNBits, w8a8 MatMulInteger).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from saguaro.compiler.fused_export import (
    attention,
    attention_bias,
    attention_inputs,
    finished_model,
    graph_inputs,
    kv_value,
    lm_head,
    logits_output,
    mlp,
    rope_caches,
    save_model,
    scored_rows,
    skip_norm,
    weight_constant,
    with_scored_tokens,
)
from saguaro.compiler.graph_writer import GraphWriter
from saguaro.compiler.quantization import quantize
from saguaro.runtime.models.feature_head import FeatureHead
from saguaro.runtime.models.llama import LlamaShape

HIDDEN_INPUT, HIDDEN_OUTPUT = "hidden", "hidden_out"
FEATURES_INPUT, PROJECTED_OUTPUT = "features", "projected"
LAYER = "model.layers.0"


def layer_shape(head: FeatureHead) -> LlamaShape:
    """The head's layer as the writers see a model: one layer scoring a part of the vocabulary."""
    return dataclasses.replace(head.shape.layer_shape(), output_vocab=head.shape.draft_vocab_size)


def layer_state(head: FeatureHead) -> dict:
    """The head's weights under the names the writers read (its `midlayer` as layer 0)."""
    state = head.state_dict()
    renamed = {f"{LAYER}.{name.removeprefix('midlayer.')}": tensor for name, tensor in state.items()
               if name.startswith("midlayer.")}
    return {**renamed, "model.embed_tokens.weight": head.embed_tokens, "model.norm.weight": state["norm.weight"],
            "lm_head.weight": state["lm_head.weight"], "output_rows": head.output_rows}


def layer_input(g: GraphWriter, head: FeatureHead, state: dict) -> tuple[str, str, str]:
    """The q/k/v input `[input_layernorm(embedding) ; hidden_norm(feature)]`, the residual
    stream it starts (the feature, or its norm with `norm_before_residual`), and the table."""
    eps = head.shape.rms_norm_eps
    embed = weight_constant(g, state, "model.embed_tokens.weight")
    embeddings = g.node("Gather", [embed, "input_ids"], ["/embeddings"])[0]
    embedded, _ = skip_norm(g, embeddings, None, weight_constant(g, state, f"{LAYER}.input_layernorm.weight"), eps,
                            "/head/embedding_norm")
    feature, _ = skip_norm(g, HIDDEN_INPUT, None, weight_constant(g, state, f"{LAYER}.hidden_norm.weight"), eps,
                           "/head/feature_norm")
    x = g.node("Concat", [embedded, feature], ["/head/layer_input"], axis=-1)[0]
    return x, feature if head.shape.norm_before_residual else HIDDEN_INPUT, embed


def head_graph(head: FeatureHead, precision: str, max_positions: int) -> onnx.ModelProto:
    """The head's model graph at fp32 (see the module docstring); `quantize` does the rest."""
    shape, state, eps = layer_shape(head), layer_state(head), head.shape.rms_norm_eps
    g = GraphWriter()
    rope_caches(g, shape, max_positions)
    at = attention_inputs(g, attention_bias(g))
    x, residual, embed = layer_input(g, head, state)
    attended = attention(g, shape, state, 0, x, at)
    x, hidden = skip_norm(g, residual, attended, weight_constant(g, state, f"{LAYER}.post_attention_layernorm.weight"),
                          eps, "/l0/post_norm")
    x, hidden_out = skip_norm(g, hidden, mlp(g, state, 0, x), weight_constant(g, state, "model.norm.weight"), eps,
                              "/final_norm")
    g.node("Identity", [lm_head(g, shape, state, scored_rows(g, x), embed, precision)], ["logits"])
    g.node("Identity", [hidden_out], [HIDDEN_OUTPUT])
    float32 = TensorProto.FLOAT
    inputs = [*graph_inputs(shape),
              helper.make_tensor_value_info(HIDDEN_INPUT, float32, ["batch", "seq", shape.hidden_size]),
              kv_value("past_key.0", shape), kv_value("past_value.0", shape)]
    outputs = [logits_output(shape),
               helper.make_tensor_value_info(HIDDEN_OUTPUT, float32, ["batch", "seq", shape.hidden_size]),
               kv_value("present_key.0", shape), kv_value("present_value.0", shape)]
    return finished_model(g, "model", inputs, outputs)


def project_graph(head: FeatureHead) -> onnx.ModelProto:
    """`fc`: the target's joined features as the head reads them."""
    g = GraphWriter()
    g.node("Identity", [g.linear(FEATURES_INPUT, head.fc.weight, "fc")], [PROJECTED_OUTPUT])
    float32 = TensorProto.FLOAT
    return finished_model(g, "project",
                          [helper.make_tensor_value_info(FEATURES_INPUT, float32, ["rows", head.shape.feature_width])],
                          [helper.make_tensor_value_info(PROJECTED_OUTPUT, float32, ["rows", head.shape.hidden_size])])


def export_head(head: FeatureHead, folder: Path, precision: str, max_positions: int) -> dict[str, Path]:
    """The head's `model` and `project` graphs at `precision` in `folder`; stem -> path."""
    model = with_scored_tokens(quantize(head_graph(head, precision, max_positions), precision),
                               head.shape.draft_vocab_size, head.output_rows)
    return {"model": save_model(model, folder / "model.onnx"),
            "project": save_model(quantize(project_graph(head), precision), folder / "project.onnx")}
