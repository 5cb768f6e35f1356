"""FusedVerify registered with TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT >= 10.8).

TensorRT's ONNX parser maps a `saguaro::FusedVerify` node whose function body was
stripped (`saguaro.compiler.tensorrt_builder`) to the plugin registered here: op type = plugin
name, attribute `plugin_namespace` = namespace, `plugin_version` = version (quickly
deployable plugins always register version "1"). Inputs and outputs are
`signature.SIGNATURE`'s; the computation is the OpenAI Triton kernels of
`triton_kernel.py`, launched on the stream TensorRT hands over.

TensorRT is imported only inside `register()` (`saguaro.plugins.tensorrt_registry`):
this module imports everywhere, and using it without TensorRT fails with an error that
says how to install it.

No `from __future__ import annotations` here: `tensorrt.plugin` reads the annotations of
the decorated functions as classes (TensorDesc, Tensor), not strings.
"""
from typing import Tuple

from saguaro.plugins.fused_verify.signature import SIGNATURE
from saguaro.plugins.tensorrt_registry import check_input_types, registration, tensorrt_dtype

PLUGIN_ID = SIGNATURE.plugin_id
NUM_OUTPUTS = len(SIGNATURE.outputs)


def register() -> None:
    """Register `saguaro::FusedVerify` with TensorRT (once per process)."""
    _register()


def _define_plugin(trt, trtp) -> None:
    @trtp.register(PLUGIN_ID)
    def fused_verify_shapes(
        target_logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
        uniforms: trtp.TensorDesc, temperature: trtp.TensorDesc, top_k: trtp.TensorDesc,
        top_p: trtp.TensorDesc,
    ) -> Tuple[(trtp.TensorDesc,) * NUM_OUTPUTS]:  # type: ignore[valid-type]  # built at run time for tensorrt.plugin
        """Two 0-d int64 outputs, accepted and bonus, whatever K and V are (no shape
        expression is built, so this is safe while TensorRT's shapes are still fake)."""
        check_input_types(trt, SIGNATURE, (target_logits, draft_tokens, draft_probs, uniforms, temperature, top_k,
                                           top_p))
        return tuple(trtp.from_shape_expr((), dtype=tensorrt_dtype(trt, spec.dtype)) for spec in SIGNATURE.outputs)

    @trtp.impl(PLUGIN_ID)
    def fused_verify_launch(
        target_logits: trtp.Tensor, draft_tokens: trtp.Tensor, draft_probs: trtp.Tensor,
        uniforms: trtp.Tensor, temperature: trtp.Tensor, top_k: trtp.Tensor, top_p: trtp.Tensor,
        outputs: Tuple[(trtp.Tensor,) * NUM_OUTPUTS],  # type: ignore[valid-type]  # built at run time for tensorrt.plugin
        stream: int,
    ) -> None:
        import torch

        from saguaro.plugins.fused_verify.triton_kernel import launch

        inputs = (target_logits, draft_tokens, draft_probs, uniforms, temperature, top_k, top_p)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            tensors = [torch.as_tensor(t, device="cuda") for t in (*inputs, *outputs)]
            launch(*tensors)


_register = registration(_define_plugin, SIGNATURE.version)
