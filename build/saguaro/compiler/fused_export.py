"""The ONNX Runtime model graph: a Llama written node by node with ONNX Runtime's fused
CPU operators (no tracing), the way its own LLM exporters build it, keeping what SSD needs.

    Gather(embed) -> per layer:
        [Skip]SimplifiedLayerNormalization -> packed QKV projection
        -> GroupQueryAttention (RoPE inside, a KV buffer updated in place, per-token
           positions, an attention mask as a bias, ragged batches)
        -> o projection -> SkipSimplifiedLayerNormalization (its 4th output: the residual)
        -> gate, up -> QuickGelu(alpha=1) (= SiLU) * up -> down
    -> SkipSimplifiedLayerNormalization -> lm_head -> logits

One graph serves every call of a model: prefill, decode, a K+1 verify, a tree-masked
branch step, and a batch of sequences each with its own length, positions, mask and KV
slot. What it needs from SSD and how it is given:
  - tree steps: `position_ids` are arbitrary (a branch token sits at context + depth,
    whatever its cache index), and `attention_mask` (bool, by cache entry) becomes a
    -inf bias on top of GQA's causal rule; a tree mask is sub-causal, so that is exact;
  - KV commit / rollback: the cache is one preallocated buffer per layer that past and
    present both bind; GQA writes only the new entries, so rolling back is lowering a
    length, and a branch commit moves entries inside the buffer;
  - ragged batches: `query_seqlens` (new tokens per sequence, 0 for an idle row) and
    `seqlens_k` (entries after the step, minus one);
  - a token's logits do not depend on the other tokens of its forward (its sequence's
    other tokens, other sequences, the padded width): every op computes each row on its
    own, except GroupQueryAttention, which multiplies a sequence of one query by V with
    a matrix-vector kernel (another summation order than its kernel for several). So
    GQA never sees a one-token sequence: each gets a second, padding query whose K/V
    lands one entry past the cache's live length, where the next step overwrites it
    (`AttentionInputs`; `tests/test_row_independence.py` checks every precision).
The plugin ops stay separate weightless graphs that read this graph's logits (the
builder adds them), so the weights are held once.

I/O (B batch, S new tokens per row, C cache capacity, T = total_sequence_length):
  input_ids, position_ids [B, S] int64; seqlens_k [B] int32; total_sequence_length []
  int32; query_seqlens [B] int32; attention_mask [B, S, T] bool; scored_positions [B, P]
  int64 (the query positions whose logits each row returns: all S for a verify, the last
  for a prefill or a draft's sync); past_key.{i}, past_value.{i} [B, kv_heads, C, head_dim]
  float32
  -> logits [B, P, vocab] float32; present_key.{i}, present_value.{i} (same memory as past);
  for a target with a feature draft, `hidden_states` [B, S, len(feature_layers) * hidden]
  float32: the hidden states entering each feature layer (`llama.Features`), joined.

Precisions: the graph is written at fp32 (MatMul); `quantization` turns its constant-weight
MatMuls into int8 / int4 / w8a8 ones. The CPU provider has no bf16 kernels for MatMul,
MatMulNBits or GroupQueryAttention.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from saguaro.compiler.graph_writer import GraphWriter, as_array
from saguaro.compiler.quantization import QUANTIZED, quantize
from saguaro.runtime.engines.onnxruntime_engine import SCORED_INPUT, SCORED_TOKENS_KEY
from saguaro.runtime.models.llama import Features, LlamaShape, rope_inverse_frequencies

MS_DOMAIN = "com.microsoft"
OPSET = 23  # RMSNormalization
FEATURES_OUTPUT = "hidden_states"  # a target's, for a feature draft


def rope_tables(shape: LlamaShape, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin `[positions, head_dim / 2]`, from the torch reference's own frequencies."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * rope_inverse_frequencies(shape)[None]
    return freqs.cos().numpy(), freqs.sin().numpy()


def graph_inputs(shape: LlamaShape) -> list[onnx.ValueInfoProto]:
    int64, int32 = TensorProto.INT64, TensorProto.INT32
    return [helper.make_tensor_value_info("input_ids", int64, ["batch", "seq"]),
            helper.make_tensor_value_info("position_ids", int64, ["batch", "seq"]),
            helper.make_tensor_value_info("seqlens_k", int32, ["batch"]),
            helper.make_tensor_value_info("total_sequence_length", int32, []),
            helper.make_tensor_value_info("query_seqlens", int32, ["batch"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, ["batch", "seq", "total"]),
            helper.make_tensor_value_info(SCORED_INPUT, int64, ["batch", "scored"])]


def scored_rows(g: GraphWriter, x: str) -> str:
    """The rows of `x` `[B, S, hidden]` whose logits are asked for (`SCORED_INPUT`): a
    prefill and a draft's sync read none or their last row only, and an lm_head scoring
    49152 tokens at every prompt position had been a quarter of a prefill's time (SmolLM2,
    int8)."""
    indices = g.node("Unsqueeze", [SCORED_INPUT, g.constant("/scored/last_axis", np.array([-1], np.int64))],
                     ["/scored/indices"])[0]
    return g.node("GatherND", [x, indices], ["/scored/rows"], batch_dims=1)[0]


def kv_value(name: str, shape: LlamaShape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                         ["batch", shape.num_kv_heads, "capacity", shape.head_dim])


def attention_bias(g: GraphWriter) -> str:
    """The bool mask as an additive bias `[B, 1, S, T]`, computed once for every layer."""
    g.constant("/bias/zero", np.array(0.0, np.float32))
    g.constant("/bias/minus_inf", np.array(-np.inf, np.float32))
    g.constant("/bias/head_axis", np.array([1], np.int64))
    bias = g.node("Where", ["attention_mask", "/bias/zero", "/bias/minus_inf"], ["/bias/rows"])[0]
    return g.node("Unsqueeze", [bias, "/bias/head_axis"], ["/bias/attention_bias"])[0]


@dataclass(frozen=True)
class AttentionInputs:
    """What every layer's GroupQueryAttention reads, with each one-token sequence given a
    padding query (see the module docstring): its query count raised to 2, its cache
    length to past + 2, the batch's width to at least 2 rows, the total length and the
    bias one entry wider. Idle rows (no tokens) stay idle. Computed once per graph;
    each layer pads its packed QKV (`padded`) and cuts GQA's output back (`cut`)."""

    query_seqlens: str
    seqlens_k: str
    total_sequence_length: str
    position_ids: str
    bias: str
    pads: str     # Pad's pads for a [B, S, hidden] tensor: S padded up to 2 rows
    width: str    # [1] int64: S, the rows the graph was given

    def padded(self, g: GraphWriter, rows: str, name: str) -> str:
        """`[B, S, hidden]` rows with the padding query's row added where S is 1."""
        return g.node("Pad", [rows, self.pads], [name])[0]

    def cut(self, g: GraphWriter, rows: str, name: str) -> str:
        """GQA's `[B, S', hidden]` output back to the S rows the graph was given."""
        return g.node("Slice", [rows, "/gqa/no_rows", self.width, "/gqa/seq_axis"], [name])[0]


def attention_inputs(g: GraphWriter, bias: str) -> AttentionInputs:
    g.constant("/gqa/no_rows", np.array([0], np.int64))
    g.constant("/gqa/seq_axis", np.array([1], np.int64))
    query_seqlens, seqlens_k, total = padded_counts(g)
    added, width = added_rows(g)
    # [B, S] and [B, 1, S, T]: S up to 2 rows, T one column wider (no real row reads it:
    # GQA's causal rule keeps each row to its own entries), all padding zero
    g.constant("/gqa/one_column", np.array([1], np.int64))
    two_d = g.node("Concat", ["/gqa/no_rows"] * 3 + [added], ["/gqa/pads_2d"], axis=0)[0]
    four_d = g.node("Concat", ["/gqa/no_rows"] * 6 + [added, "/gqa/one_column"], ["/gqa/pads_4d"], axis=0)[0]
    three_d = g.node("Concat", ["/gqa/no_rows"] * 4 + [added, "/gqa/no_rows"], ["/gqa/pads_3d"], axis=0)[0]
    position_ids = g.node("Pad", ["position_ids", two_d], ["/gqa/position_ids"])[0]
    padded_bias = g.node("Pad", [bias, four_d], ["/gqa/bias"])[0]
    return AttentionInputs(query_seqlens, seqlens_k, total, position_ids, padded_bias, three_d, width)


def padded_counts(g: GraphWriter) -> tuple[str, str, str]:
    """Query counts and cache lengths with a padding query for each one-token sequence
    (idle rows, 0 tokens, stay as they are), and the total length one entry longer."""
    int32 = TensorProto.INT32
    g.constant("/gqa/one", np.array(1, np.int32))
    one_token = g.node("Equal", ["query_seqlens", "/gqa/one"], ["/gqa/one_token"])[0]
    extra = g.node("Cast", [one_token], ["/gqa/extra"], to=int32)[0]
    query_seqlens = g.node("Add", ["query_seqlens", extra], ["/gqa/query_seqlens"])[0]
    seqlens_k = g.node("Add", ["seqlens_k", extra], ["/gqa/seqlens_k"])[0]
    total = g.node("Add", ["total_sequence_length", "/gqa/one"], ["/gqa/total_sequence_length"])[0]
    return query_seqlens, seqlens_k, total


def added_rows(g: GraphWriter) -> tuple[str, str]:
    """`[1]` int64: the rows to add so the batch is at least 2 wide (1 or 0), and S."""
    g.constant("/gqa/two_rows", np.array([2], np.int64))
    shape = g.node("Shape", ["input_ids"], ["/gqa/input_shape"])[0]
    width = g.node("Gather", [shape, "/gqa/seq_axis"], ["/gqa/width"], axis=0)[0]
    missing = g.node("Sub", ["/gqa/two_rows", width], ["/gqa/missing"])[0]
    return g.node("Max", [missing, "/gqa/no_rows"], ["/gqa/added_rows"])[0], width


def optional(state: dict, name: str) -> torch.Tensor | None:
    return state.get(name)


def attention(g: GraphWriter, shape: LlamaShape, state: dict, layer: int, x: str, at: AttentionInputs) -> str:
    """Packed QKV into GroupQueryAttention; with per-head q/k norms (Qwen3) q, k and v go
    in apart, q and k normed per head first (RoPE stays inside the attention op). The
    QKV rows are padded to GQA's inputs (`AttentionInputs`) and its output cut back."""
    prefix = f"model.layers.{layer}.self_attn"
    qkv_weight = torch.cat([state[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
    qkv_bias = torch.cat([state[f"{prefix}.{p}_proj.bias"] for p in "qkv"]) if shape.qkv_bias else None
    qkv = g.linear(x, qkv_weight, f"{prefix}.qkv_proj", qkv_bias)
    qkv = at.padded(g, qkv, f"/l{layer}/qkv_padded")
    queries = [qkv, "", ""] if not shape.qk_norm else normed_q_k_v(g, shape, state, layer, qkv)
    inputs = [*queries, f"past_key.{layer}", f"past_value.{layer}", at.seqlens_k, at.total_sequence_length,
              "cos_cache", "sin_cache", at.position_ids, at.bias,
              "", "", "", "", "", at.query_seqlens]  # head_sink, k/v scales, q/k norm weights: unused
    padded = g.node("GroupQueryAttention", inputs, [f"/l{layer}/attention_padded", f"present_key.{layer}",
                                                    f"present_value.{layer}"],
                    domain=MS_DOMAIN, num_heads=shape.num_heads, kv_num_heads=shape.num_kv_heads, do_rotary=1,
                    causal=1, scale=float(shape.head_dim) ** -0.5)[0]
    out = at.cut(g, padded, f"/l{layer}/attention")
    return g.linear(out, state[f"{prefix}.o_proj.weight"], f"{prefix}.o_proj",
                    optional(state, f"{prefix}.o_proj.bias"))


def normed_q_k_v(g: GraphWriter, shape: LlamaShape, state: dict, layer: int, qkv: str) -> list[str]:
    """Split the packed projection and RMS-norm each head of q and k over head_dim."""
    prefix, d = f"model.layers.{layer}.self_attn", shape.head_dim
    sizes = [shape.num_heads * d, shape.num_kv_heads * d, shape.num_kv_heads * d]
    split = g.constant(f"/l{layer}/qkv_sizes", np.array(sizes, np.int64))
    q, k, v = g.node("Split", [qkv, split], [f"/l{layer}/q", f"/l{layer}/k", f"/l{layer}/v"], axis=-1)
    heads = g.constant(f"/l{layer}/by_head", np.array([0, 0, -1, d], np.int64))
    flat = g.constant(f"/l{layer}/flat_heads", np.array([0, 0, -1], np.int64))
    normed = []
    for name, tensor in (("q_norm", q), ("k_norm", k)):
        weight = g.constant(f"{prefix}.{name}.weight", as_array(state[f"{prefix}.{name}.weight"]))
        per_head = g.node("Reshape", [tensor, heads], [f"/l{layer}/{name}/heads"])[0]
        out = g.node("RMSNormalization", [per_head, weight], [f"/l{layer}/{name}/normed"], axis=-1,
                     epsilon=shape.rms_norm_eps)[0]
        normed.append(g.node("Reshape", [out, flat], [f"/l{layer}/{name}/out"])[0])
    return [*normed, v]


def mlp(g: GraphWriter, state: dict, layer: int, x: str) -> str:
    prefix = f"model.layers.{layer}.mlp"
    gate, up, down = (f"{prefix}.{p}_proj" for p in ("gate", "up", "down"))
    gate_out = g.linear(x, state[f"{gate}.weight"], gate, optional(state, f"{gate}.bias"))
    up_out = g.linear(x, state[f"{up}.weight"], up, optional(state, f"{up}.bias"))
    silu = g.node("QuickGelu", [gate_out], [f"/l{layer}/silu"], domain=MS_DOMAIN, alpha=1.0)[0]
    gated = g.node("Mul", [silu, up_out], [f"/l{layer}/gated"])[0]
    return g.linear(gated, state[f"{down}.weight"], down, optional(state, f"{down}.bias"))


def skip_norm(g: GraphWriter, hidden: str, residual: str | None, weight: str, eps: float, name: str):
    """RMSNorm of `hidden + residual`; returns (normed, the sum for the next residual)."""
    if residual is None:
        normed = g.node("RMSNormalization", [hidden, weight], [f"{name}/normed"], axis=-1, epsilon=eps)[0]
        return normed, hidden
    normed, _, _, total = g.node("SkipSimplifiedLayerNormalization", [hidden, residual, weight],
                                 [f"{name}/normed", "", "", f"{name}/sum"], domain=MS_DOMAIN, epsilon=eps)
    return normed, total


def lm_head(g: GraphWriter, shape: LlamaShape, state: dict, x: str, embed: str, precision: str) -> str:
    """Tied embeddings at fp32 reuse the table through Gemm(transB) instead of a second copy;
    quantised precisions quantise their own (small) copy. A draft that scores part of the
    vocabulary (`output_vocab`) returns its rows' scores as they are: the engine spreads
    them over the whole vocabulary (`scored_tokens` says which token each row scores)."""
    if shape.output_vocab:
        return g.linear(x, state["lm_head.weight"], "lm_head")
    if "lm_head.weight" in state and not shape.tie_word_embeddings:
        return g.linear(x, state["lm_head.weight"], "lm_head")
    if precision in QUANTIZED:
        return g.linear(x, state["model.embed_tokens.weight"], "lm_head")
    g.constant("/lm_head/rows", np.array([-1, shape.hidden_size], np.int64))
    rows = g.node("Reshape", [x, "/lm_head/rows"], ["/lm_head/rows_in"])[0]
    flat = g.node("Gemm", [rows, embed], ["/lm_head/flat"], transB=1)[0]
    g.constant("/lm_head/vocab", np.array([shape.vocab_size], np.int64))
    g.node("Shape", [x], ["/lm_head/in_shape"])
    g.node("Slice", ["/lm_head/in_shape", g.constant("/lm_head/zero", np.array([0], np.int64)),
                     g.constant("/lm_head/two", np.array([2], np.int64))], ["/lm_head/batch_seq"])
    g.node("Concat", ["/lm_head/batch_seq", "/lm_head/vocab"], ["/lm_head/out_shape"], axis=0)
    return g.node("Reshape", [flat, "/lm_head/out_shape"], ["lm_head/out"])[0]


def logits_output(shape: LlamaShape) -> onnx.ValueInfoProto:
    """`logits`: one score per token of the vocabulary, or per row of a draft that scores part of it."""
    return helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                         ["batch", "scored", shape.output_vocab or shape.vocab_size])


def with_scored_tokens(model: onnx.ModelProto, output_vocab: int, output_rows: torch.Tensor | None) -> onnx.ModelProto:
    """A graph that scores part of the vocabulary names the token of each of its rows (in its
    metadata, `SCORED_TOKENS_KEY`), which the engine spreads them onto. Spread inside the
    graph (a Gather of 49152 one-float rows, a transpose and a copy back), it had taken
    0.5 ms of SmolLM2's feature head's 1.9 ms step (int8, one thread) and 1.1 ms of a
    16-row forward; on the host it takes 0.02 and 0.16 ms."""
    if output_vocab:
        assert output_rows is not None  # a partial vocabulary's map: token -> row (`output_vocab` where none)
        rows = output_rows.to(torch.int64)
        scored = torch.full((output_vocab,), -1, dtype=torch.int64)
        tokens = torch.nonzero(rows < output_vocab).flatten()
        scored[rows[tokens]] = tokens
        if bool((scored < 0).any()):
            raise ValueError(f"output_rows leaves rows of the {output_vocab} scored ones without a token")
        helper.set_model_props(model, {SCORED_TOKENS_KEY: ",".join(map(str, scored.tolist()))})
    return model


def rope_caches(g: GraphWriter, shape: LlamaShape, max_positions: int) -> None:
    """GroupQueryAttention's `cos_cache` and `sin_cache` inputs."""
    cos, sin = rope_tables(shape, max_positions)
    g.constant("cos_cache", cos)
    g.constant("sin_cache", sin)


def weight_constant(g: GraphWriter, state: dict, name: str) -> str:
    """`state[name]` as a float32 initializer of that name (norm weights, the embedding table)."""
    return g.constant(name, as_array(state[name]))


def model_graph(shape: LlamaShape, state: dict, precision: str, max_positions: int,
                feature_layers: tuple[int, ...] = ()) -> onnx.ModelProto:
    """The fp32 graph (see the module docstring); `quantize` turns it into int8 / int4.
    With `feature_layers`, also the `hidden_states` output a feature draft reads."""
    g = GraphWriter()
    rope_caches(g, shape, max_positions)
    at = attention_inputs(g, attention_bias(g))
    embed = weight_constant(g, state, "model.embed_tokens.weight")
    hidden = g.node("Gather", [embed, "input_ids"], ["/embeddings"])[0]
    residual = None
    eps = shape.rms_norm_eps
    entering = []  # by layer: the hidden state entering it (hidden + residual, as the skip norm sums them)
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        norm = weight_constant(g, state, f"{prefix}.input_layernorm.weight")
        x, hidden = skip_norm(g, hidden, residual, norm, eps, f"/l{layer}/input_norm")
        entering.append(hidden)
        attended = attention(g, shape, state, layer, x, at)
        norm = weight_constant(g, state, f"{prefix}.post_attention_layernorm.weight")
        x, hidden = skip_norm(g, hidden, attended, norm, eps, f"/l{layer}/post_norm")
        residual = mlp(g, state, layer, x)
    x, last = skip_norm(g, hidden, residual, weight_constant(g, state, "model.norm.weight"), eps, "/final_norm")
    g.node("Identity", [lm_head(g, shape, state, scored_rows(g, x), embed, precision)], ["logits"])
    outputs = [logits_output(shape)]
    if feature_layers:
        outputs.append(feature_output(g, shape, [*entering, last], feature_layers))
    inputs = graph_inputs(shape)
    for layer in range(shape.num_layers):
        inputs += [kv_value(f"past_key.{layer}", shape), kv_value(f"past_value.{layer}", shape)]
        outputs += [kv_value(f"present_key.{layer}", shape), kv_value(f"present_value.{layer}", shape)]
    return finished_model(g, "model", inputs, outputs)


def feature_output(g: GraphWriter, shape: LlamaShape, states: list[str],
                   feature_layers: tuple[int, ...]) -> onnx.ValueInfoProto:
    """`hidden_states`: `states[i]` (entering layer i; the last, leaving the last layer)
    for each feature layer, joined in the order given (`llama.Features`)."""
    Features(feature_layers, shape.num_layers)  # refuses layers outside 0..num_layers
    g.node("Concat", [states[layer] for layer in feature_layers], [FEATURES_OUTPUT], axis=-1)
    return helper.make_tensor_value_info(FEATURES_OUTPUT, TensorProto.FLOAT,
                                         ["batch", "seq", len(feature_layers) * shape.hidden_size])


def finished_model(g: GraphWriter, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])


def export_model(shape: LlamaShape, state: dict, path: Path, precision: str, max_positions: int,
                 feature_layers: tuple[int, ...] = ()) -> Path:
    """Write the model graph at `precision` to `path`, its weights in one file beside it."""
    model = quantize(model_graph(shape, state, precision, max_positions, feature_layers), precision)
    return save_model(with_scored_tokens(model, shape.output_vocab, state.get("output_rows")), path)


def save_model(model: onnx.ModelProto, path: Path) -> Path:
    """Check a graph and write it to `path`, its weights in one file beside it."""
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = path.with_name(path.stem + ".weights")
    weights.unlink(missing_ok=True)  # onnx appends to an existing file
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=weights.name, size_threshold=1024)
    return path
