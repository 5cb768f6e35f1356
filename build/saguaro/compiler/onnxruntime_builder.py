"""The ONNX Runtime backend: quantisation, offline graph optimisation, session creation.

Precisions (see shared/cpu-facts.md for the measurements behind the choices):
  fp32  the exported graph as is;
  int8  `quantize_dynamic` with QInt8 weights, per-tensor scales: MatMulInteger keeps a K+1
        verify close to the cost of one decode step, which fp32 does not on these CPUs;
  int4  weight-only `MatMulNBits` (block 128, symmetric, accuracy level 4): the fastest
        decode step, at the price of a steeper cost in query length.
Quantisation runs on the bare forward graph, before any plugin node is attached, so the
quantisers never see a custom-domain node and the verify graph reuses the forward's
quantised weights unchanged.

The optimised model ORT writes (`*.opt.onnx`, level EXTENDED: fusions that run on any
CPU, no hardware-specific layouts) is what the runtime loads; plugin functions are inlined
in it. The `*.onnx` beside it keeps the plugin nodes (for TensorRT and for inspection).
"""
from __future__ import annotations

import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path

import onnx
import onnxruntime as ort

from saguaro.runtime.engines.onnxruntime_engine import SessionSettings, session_options

OPTIMIZED_SUFFIX = ".opt.onnx"


def quantize(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The forward graph at `precision` (fp32 returns it unchanged)."""
    if precision == "fp32":
        return model
    if precision == "int8":
        return _quantize_int8(model)
    if precision == "int4":
        return _quantize_int4(model)
    raise ValueError(f"onnxruntime backend: precision {precision!r} is not one of fp32, int8, int4")


@contextmanager
def quiet_root_logger():
    """The quantisers log advice ("consider pre-processing") on the root logger."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _quantize_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as work, quiet_root_logger():
        source, target = Path(work) / "fp32.onnx", Path(work) / "int8.onnx"
        onnx.save_model(model, str(source))
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=False)
        return onnx.load(str(target))


def _quantize_int4(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as error:  # it needs `onnx-ir`, not a dependency of onnxruntime itself
        raise RuntimeError(f"int4 needs ONNX Runtime's MatMulNBits quantiser: {error} "
                           "(pip install onnx-ir)") from error
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    with quiet_root_logger():
        quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=128, is_symmetric=True, accuracy_level=4)
        quantizer.process()
    return quantizer.model.model


def optimized_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".onnx") + OPTIMIZED_SUFFIX)


def save_optimized(path: Path, settings: SessionSettings) -> Path:
    """Let ORT optimise `path` once, at build time, and write the result beside it."""
    target = optimized_path(path)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(path), session_options(settings, level, target),
                         providers=["CPUExecutionProvider"])
    return target
