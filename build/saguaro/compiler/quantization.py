"""Quantising a finished fp32 graph: each MatMul with a constant weight becomes

- int8 / int4: ONNX Runtime's blockwise weight-only MatMulNBits (block 32, accuracy level
  4: int8 activations per block, the only setting that stays fast for more than one row);
- w8a8: MatMulInteger over 8-bit weights (a scale per output channel) and activations
  quantised per token as the graph runs (`per_token_int8`).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from saguaro.compiler.graph_writer import GraphWriter

QUANTIZED_BITS = {"int8": 8, "int4": 4}  # weight-only, MatMulNBits
PER_TOKEN_INT8 = "w8a8"  # int8 weights per output channel, int8 activations per token (MatMulInteger)
QUANTIZED = (*QUANTIZED_BITS, PER_TOKEN_INT8)
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations per block (VNNI); levels 0-1 are 2-3x slower for S > 1


@contextmanager
def quiet_root_logger():
    """The quantiser logs advice on the root logger."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantize(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """Every MatMul with a constant weight as MatMulNBits (int8, int4) or as a per-token
    int8 MatMulInteger (w8a8); fp32 returns the graph unchanged."""
    if precision == "fp32":
        return model
    if precision == PER_TOKEN_INT8:
        return per_token_int8(model)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    with quiet_root_logger():
        quantizer = MatMulNBitsQuantizer(model, bits=QUANTIZED_BITS[precision], block_size=BLOCK_SIZE,
                                         is_symmetric=False, accuracy_level=ACCURACY_LEVEL)
        quantizer.process()
    return quantizer.model.model


def per_token_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """W8A8: each constant-weight MatMul as MatMulInteger over 8-bit weights (symmetric, a
    scale per output channel, stored as uint8 around 128: `integer_matmul`) and activations
    quantised per token (per row: its largest magnitude maps to 127) as the graph runs,
    then scaled back to float. MLAS's integer kernel (u8 x s8, on an AVX-512 VNNI machine)
    measured 1.7x MatMulNBits' speed at 5 rows and 2x at 16 (equal at one), and its sums
    are integers, exact whatever their order, so a row's result never depends on the other
    rows of its forward. Each input is quantised once, however many MatMuls read it."""
    graph = model.graph
    weights = {tensor.name: tensor for tensor in graph.initializer}
    g = GraphWriter("/w8a8")
    g.constant("/w8a8/last_axis", np.array([-1], np.int64))
    g.constant("/w8a8/inverse_range", np.array(1 / 127, np.float32))
    g.constant("/w8a8/smallest_scale", np.array(1e-30, np.float32))
    g.constant("/w8a8/zero_point", np.array(128, np.uint8))
    quantised: dict[str, tuple[str, str]] = {}  # input -> (uint8 rows, their scales)
    nodes, replaced = [], set()
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in weights:
            nodes.append(node)
            continue
        first = len(g.nodes)
        x, weight = node.input[0], numpy_helper.to_array(weights[node.input[1]])
        if x not in quantised:
            quantised[x] = token_quantised(g, x, weight.shape[0])
        integer_matmul(g, *quantised[x], weight, node.input[1], node.output[0])
        nodes.extend(g.nodes[first:])
        replaced.add(node.input[1])
    kept = [tensor for tensor in graph.initializer if tensor.name not in replaced]
    del graph.node[:], graph.initializer[:]
    graph.node.extend(nodes)
    graph.initializer.extend([*kept, *g.initializers])
    return model


def token_quantised(g: GraphWriter, x: str, width: int) -> tuple[str, str]:
    """`x` `[..., width]` as uint8 (zero point 128) with one scale per row `[..., 1]`: its
    largest magnitude maps to 127 (QuantizeLinear with the row as its one block)."""
    name = f"/w8a8/{x.strip('/')}"
    largest = g.node("ReduceMax", [g.node("Abs", [x], [f"{name}/abs"])[0], "/w8a8/last_axis"], [f"{name}/max"],
                     keepdims=1)[0]
    scale = g.node("Mul", [largest, "/w8a8/inverse_range"], [f"{name}/scale_raw"])[0]
    scale = g.node("Max", [scale, "/w8a8/smallest_scale"], [f"{name}/scale"])[0]  # an all-zero row stays zero
    zero_point = g.node("ConstantOfShape", [g.node("Shape", [scale], [f"{name}/scale_shape"])[0]],
                        [f"{name}/zero_point"], value=numpy_helper.from_array(np.array([128], np.uint8)))[0]
    return g.node("QuantizeLinear", [x, scale, zero_point], [f"{name}/uint8"], axis=-1, block_size=width)[0], scale


def integer_matmul(g: GraphWriter, rows: str, row_scale: str, weight: np.ndarray, name: str, out: str) -> None:
    """`out` = rows (uint8, zero point 128) x `weight` `[in, out]` quantised per column to
    -127..127, stored as uint8 around 128 too. Not int8: MLAS's u8 x s8 kernel on x86 CPUs
    without VNNI (AVX2: `vpmaddubsw`) adds pairs of products in 16 bits and saturates (255 x
    127 twice passes 32767): on a Zen 1 EPYC almost every sum of a 576 x 1536 product came
    out wrong. Its u8 x u8 kernel widens first and is exact on every CPU (there 1.1-1.4x
    the u8 x s8 time)."""
    column_scale = np.abs(weight).max(axis=0) / 127
    column_scale[column_scale == 0] = 1
    integers = np.round(weight / column_scale).astype(np.int16)
    g.constant(f"{name}/uint8", (integers + 128).astype(np.uint8))
    g.constant(f"{name}/column_scale", column_scale.astype(np.float32))
    sums = g.node("MatMulInteger", [rows, f"{name}/uint8", "/w8a8/zero_point", "/w8a8/zero_point"],
                  [f"{out}/int32"])[0]
    real = g.node("Cast", [sums], [f"{out}/float"], to=TensorProto.FLOAT)[0]
    by_row = g.node("Mul", [real, row_scale], [f"{out}/by_row"])[0]
    g.node("Mul", [by_row, f"{name}/column_scale"], [out])
