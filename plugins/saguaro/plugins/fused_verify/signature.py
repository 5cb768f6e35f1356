"""FusedVerify's signature: what the ONNX node, its local function and the TensorRT plugin
all take and give (see `saguaro.plugins.signature`)."""
from __future__ import annotations

from saguaro.plugins.fused_verify import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from saguaro.plugins.signature import FLOAT_TYPES, PluginSignature, TensorSpec

SIGNATURE = PluginSignature(
    name=PLUGIN_NAME, namespace=PLUGIN_NAMESPACE, version=PLUGIN_VERSION,
    inputs=(TensorSpec("target_logits", FLOAT_TYPES, 2),  # [K+1, V]
            TensorSpec("draft_tokens", ("int64",), 1),  # [K]
            TensorSpec("draft_probs", FLOAT_TYPES, 2),    # [K, V]
            TensorSpec("uniforms", ("float32",), 1),    # [K+1]
            TensorSpec("temperature", ("float32",), 0),
            TensorSpec("top_k", ("int64",), 0),
            TensorSpec("top_p", ("float32",), 0)),
    outputs=(TensorSpec("accepted", ("int64",), 0),
             TensorSpec("bonus", ("int64",), 0)),
)
