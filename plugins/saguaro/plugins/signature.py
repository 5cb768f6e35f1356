"""A plugin's signature: the one description of its inputs, outputs and attributes.

Both forms of each op are built from it: the ONNX node and its local function (what ONNX
Runtime runs and what TensorRT's parser reads) and the `tensorrt.plugin` registration
(what the parser maps the node to). They must agree exactly:

- onnx-tensorrt >= 10.6 requires a plugin node to name exactly as many (non-empty)
  outputs as the plugin declares, size tensors included ("Node has more output tensors
  than TRT expected" also fires when the node names fewer);
- `PluginTensorDesc::type` does not support `kBOOL` or `kUINT8` (NvInferRuntimePlugin.h,
  TensorRT 10.8 to 11.1), so no plugin input or output may have those types: a bool
  result leaves the plugin as int32 (not int8: TensorRT's kINT8 is a quantized
  floating-point type) and the graph casts it after the node.

Element types are named by their `tensorrt` attribute names (`float32`, `int64`, `int32`
...); `onnx_type` maps them to ONNX. A signature checks its own types when it is defined.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
              "int64": TensorProto.INT64, "int32": TensorProto.INT32, "int8": TensorProto.INT8,
              "uint8": TensorProto.UINT8, "bool": TensorProto.BOOL}
# The float types a plugin's score / logits / probability inputs accept: the precisions the
# TensorRT engines are built in (the OpenAI Triton kernels read each as float32).
FLOAT_TYPES = ("float32", "float16", "bfloat16")
# PluginTensorDesc::type: "DataType:kBOOL and DataType::kUINT8 are not supported"
UNSUPPORTED_PLUGIN_TYPES = ("bool", "uint8")
# Every node names its plugin this way; TensorRT's parser looks the plugin up by them.
LOOKUP_ATTRIBUTES = ("plugin_namespace", "plugin_version")


def onnx_type(dtype: str) -> int:
    return ONNX_TYPES[dtype]


def dtype_of(onnx_elem_type: int) -> str:
    """The signature's name for an ONNX element type."""
    names: dict[int, str] = {code: name for name, code in ONNX_TYPES.items()}
    if onnx_elem_type not in names:
        raise ValueError(f"element type {TensorProto.DataType.Name(onnx_elem_type)} has no plugin type name")
    return names[onnx_elem_type]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name, the element types it may have (the first is the one
    the op produces or the exporter feeds) and its rank. A size tensor is a 0-d int32 output
    that tells TensorRT a data-dependent extent; it exists on the TensorRT side only as a
    value, but the ONNX node must still name it."""

    name: str
    dtypes: tuple[str, ...]
    rank: int
    size_tensor: bool = False

    @property
    def dtype(self) -> str:
        return self.dtypes[0]


@dataclass(frozen=True)
class PluginSignature:
    """Op type (= plugin name), domain (= plugin namespace), version, I/O and the node's
    own attributes. `tensorrt=False` marks an op that only ONNX Runtime runs (no plugin)."""

    name: str
    namespace: str
    version: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attributes: tuple[str, ...] = ()
    tensorrt: bool = True

    def __post_init__(self):
        for spec in (*self.inputs, *self.outputs):
            unknown = [t for t in spec.dtypes if t not in ONNX_TYPES]
            if unknown:
                raise ValueError(f"{self.name}.{spec.name}: unknown element type(s) {unknown}")
            if self.tensorrt and set(spec.dtypes) & set(UNSUPPORTED_PLUGIN_TYPES):
                raise ValueError(f"{self.name}.{spec.name}: TensorRT plugins cannot take or give "
                                 f"{'/'.join(UNSUPPORTED_PLUGIN_TYPES)} tensors; use int32 and cast outside")
            if spec.size_tensor and (spec.rank != 0 or spec.dtypes != ("int32",)):
                raise ValueError(f"{self.name}.{spec.name}: a size tensor is a 0-d int32")

    @property
    def plugin_id(self) -> str:
        """How `tensorrt.plugin` names it: `namespace::name`."""
        return f"{self.namespace}::{self.name}"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    @property
    def node_attributes(self) -> tuple[str, ...]:
        """Every attribute a node of this op carries (the lookup ones first)."""
        return (*LOOKUP_ATTRIBUTES, *self.attributes)

    def output(self, name: str) -> TensorSpec:
        return next(spec for spec in self.outputs if spec.name == name)

    def make_node(self, inputs: list[str], outputs: list[str], name: str | None = None,
                  **attributes) -> onnx.NodeProto:
        """The custom-domain node, naming every input and output of the signature."""
        if len(inputs) != len(self.inputs) or len(outputs) != len(self.outputs) or not all(outputs):
            raise ValueError(f"{self.name} takes inputs {self.input_names} and gives outputs "
                             f"{self.output_names} (every one named); got {inputs} -> {outputs}")
        if set(attributes) != set(self.attributes):
            raise ValueError(f"{self.name} takes attributes {self.attributes}, got {sorted(attributes)}")
        return helper.make_node(self.name, inputs, outputs, name=name or self.name, domain=self.namespace,
                                plugin_namespace=self.namespace, plugin_version=self.version, **attributes)


def value_infos(specs: tuple[TensorSpec, ...], dims: dict[str, list]) -> list[onnx.ValueInfoProto]:
    """Graph input or output declarations for `specs` (their first type), shapes given by name."""
    return [helper.make_tensor_value_info(spec.name, onnx_type(spec.dtype), dims[spec.name]) for spec in specs]
