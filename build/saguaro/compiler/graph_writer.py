"""Writing an ONNX graph node by node: names kept unique, weights as initializers."""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper


class GraphWriter:
    """Nodes and initializers of one graph, with unique node names."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix  # of node names: a pass that adds nodes to a graph names them apart
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def constant(self, name: str, array) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attributes) -> list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{self.prefix}/{op}_{len(self.nodes)}",
                                           domain=domain, **attributes))
        return outputs

    def linear(self, x: str, weight: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> str:
        """`x @ weight.T (+ bias)` for a Hugging Face `[out, in]` weight (MatMulNBits
        replaces the MatMul later; a bias stays an Add)."""
        out = self.node("MatMul", [x, self.constant(f"{name}.weight", as_array(weight).T)], [f"{name}/out"])[0]
        if bias is None:
            return out
        return self.node("Add", [out, self.constant(f"{name}.bias", as_array(bias))], [f"{name}/biased"])[0]


def as_array(tensor: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy(), dtype=np.float32)
