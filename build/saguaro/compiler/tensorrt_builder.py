"""Build a TensorRT engine from an exported ONNX graph carrying `saguaro` plugin nodes.

Steps: strip the plugin nodes' local-function bodies (TensorRT's parser would otherwise
inline them as standard ops, since it prefers a model's local function to a plugin),
register the `tensorrt.plugin` definitions, parse, add one optimization profile over the
graph's named dynamic dimensions, build, write the plan.

Precision: every network is strongly typed (TensorRT deprecated weak typing in 10.12 and
removed it in 11, where the STRONGLY_TYPED creation flag is deprecated, so it is set only
on 10.x): an fp16 or bf16 engine is built from a graph exported in that type (the
builder casts the model before the export), the same way on every version. TensorRT
turns `BuilderFlag.TF32` on in every new builder config (NvInfer.h, 10.8 to 11.1: "Enabled
by default"), which would run fp32 matmuls on 10-bit mantissas; it is cleared for every
engine, so an fp32 engine computes in fp32 and the fp32 parts of a half-precision graph
(logits, norm statistics) stay fp32. `builder_flags` is the one statement of the flags:
the build applies it and the manifest records it. Flags are looked up by name: their
numbers changed in 11.

Every plugin node is checked against its op's signature before the parser sees it
(`check_plugin_node`): a node naming fewer or more outputs than the plugin declares
fails TensorRT's parser (onnx-tensorrt >= 10.6), and an op without a TensorRT plugin
(GatherKV) cannot be built at all. The element type of every plugin input must be one
the signature lists (`check_plugin_input_types`: a half-precision export must not hand
the kernels a type they do not read).

TensorRT is imported inside the functions that need it; the ONNX-side helpers here
(`strip_plugin_functions`, `profile_shapes`, `TensorRTBuildOptions`) work without it.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import onnx

from saguaro.plugins.branch_draft.signature import GATHER_SIGNATURE
from saguaro.plugins.branch_draft.signature import SIGNATURE as BRANCH_DRAFT
from saguaro.plugins.fused_verify.signature import SIGNATURE as FUSED_VERIFY
from saguaro.plugins.signature import dtype_of, onnx_type
from saguaro.plugins.tensorrt_plugins import register_plugins
from saguaro.plugins.tensorrt_registry import import_tensorrt, tensorrt_version

PLUGIN_DOMAIN = "saguaro"
PLUGIN_SIGNATURES = {signature.name: signature for signature in (FUSED_VERIFY, BRANCH_DRAFT, GATHER_SIGNATURE)}
# precision -> the element type the model's weights and activations are exported in
EXPORT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
PRECISIONS = tuple(EXPORT_DTYPES)
# Builder flags every engine is built with, by name. TF32 off: TensorRT turns it on by
# default. No precision flag: the types are the graph's own (strongly typed).
BUILDER_FLAGS = {"TF32": False}


def iter_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph`, including those inside If / Loop / Scan bodies."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from iter_nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from iter_nodes(subgraph)


def check_plugin_node(node: onnx.NodeProto) -> None:
    """A plugin node must name its plugin the way TensorRT's parser looks it up, and name
    exactly the inputs and outputs the plugin declares (the parser counts non-empty names)."""
    where = f"node {node.name or node.op_type!r} in domain {PLUGIN_DOMAIN!r}"
    signature = PLUGIN_SIGNATURES.get(node.op_type)
    if signature is None or not signature.tensorrt:
        raise ValueError(f"{where}: {node.op_type} has no TensorRT plugin "
                         f"(plugins: {', '.join(s.name for s in PLUGIN_SIGNATURES.values() if s.tensorrt)})")
    present = {attribute.name for attribute in node.attribute}
    missing = [name for name in signature.node_attributes if name not in present]
    if missing:
        raise ValueError(f"{where} lacks {missing}: TensorRT's parser could not map it to a plugin")
    for kind, names, specs in (("inputs", node.input, signature.inputs), ("outputs", node.output, signature.outputs)):
        named = [name for name in names if name]
        if len(named) != len(specs) or len(names) != len(specs):
            raise ValueError(f"{where} names {len(named)} {kind}; the plugin has {len(specs)} "
                             f"({', '.join(spec.name for spec in specs)}), and TensorRT's parser requires "
                             "every one named")


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """The ONNX element type of every value of the main graph that type inference can tell."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {tensor.name: tensor.data_type for tensor in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    return types


def check_plugin_input_types(model: onnx.ModelProto) -> None:
    """Every input of a plugin node has a type its signature lists (where inference knows
    it), before TensorRT builds kernels that would read its bytes as another type."""
    types = element_types(model)
    for node in model.graph.node:
        if node.domain != PLUGIN_DOMAIN or node.op_type not in PLUGIN_SIGNATURES:
            continue
        for spec, name in zip(PLUGIN_SIGNATURES[node.op_type].inputs, node.input):
            if name in types and types[name] not in [onnx_type(dtype) for dtype in spec.dtypes]:
                found = onnx.TensorProto.DataType.Name(types[name]).lower()
                raise ValueError(f"node {node.name or node.op_type!r}: input {spec.name} ({name!r}) is {found}; "
                                 f"the {node.op_type} plugin takes {' or '.join(spec.dtypes)}")


def strip_plugin_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose `saguaro` nodes have no function bodies, only their attributes.

    TensorRT's ONNX parser then imports each such node as the plugin named by its op type
    and `plugin_namespace` / `plugin_version`. Functions of other domains stay. Every
    plugin node is checked first (outputs named, attributes, input types).
    """
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    for node in iter_nodes(stripped.graph):
        if node.domain == PLUGIN_DOMAIN:
            check_plugin_node(node)
    kept = [function for function in stripped.functions if function.domain != PLUGIN_DOMAIN]
    del stripped.functions[:]
    stripped.functions.extend(kept)
    # the checker accepts a custom-domain node without a function if its domain is imported
    if not any(opset.domain == PLUGIN_DOMAIN for opset in stripped.opset_import):
        stripped.opset_import.append(onnx.helper.make_opsetid(PLUGIN_DOMAIN, 1))
    check_plugin_input_types(stripped)
    return stripped


DimRange = tuple[int, int, int]


@dataclass(frozen=True)
class TensorRTBuildOptions:
    """What `build_engine` needs: ranges (min, opt, max) for each named dynamic dimension of
    the graph inputs (`batch`, `query`, `past` ...), the precision the graph was exported
    in and the workspace size."""

    dim_ranges: dict[str, DimRange] = field(default_factory=dict)
    precision: str = "fp32"
    workspace_bytes: int = 4 << 30

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        for name, (low, opt, high) in self.dim_ranges.items():
            if not 0 <= low <= opt <= high:
                raise ValueError(f"dimension {name!r}: need 0 <= min <= opt <= max, got {(low, opt, high)}")

    @classmethod
    def from_mapping(cls, config: Mapping) -> "TensorRTBuildOptions":
        """From a build config section: `dims: {name: [min, opt, max]}`, `precision`,
        `workspace_gib`."""
        # (min, opt, max) each: __post_init__ unpacks three
        dims = {name: cast(DimRange, tuple(int(v) for v in values)) for name, values in config.get("dims", {}).items()}
        return cls(dim_ranges=dims, precision=config.get("precision", "fp32"),
                   workspace_bytes=int(float(config.get("workspace_gib", 4)) * (1 << 30)))


def profile_shapes(model: onnx.ModelProto, dim_ranges: Mapping[str, DimRange]) -> dict[str, tuple]:
    """`{input: (min_shape, opt_shape, max_shape)}` for the inputs with dynamic dimensions.

    A fixed dimension is the same in all three; a named one takes its range from
    `dim_ranges`. An unnamed dynamic dimension, or a name without a range, is an error.
    """
    initializers = {tensor.name for tensor in model.graph.initializer}
    shapes, missing = {}, set()
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        dims = graph_input.type.tensor_type.shape.dim
        if all(dim.HasField("dim_value") for dim in dims):
            continue
        ranges: list[tuple[int, ...]] = []
        for index, dim in enumerate(dims):
            if dim.HasField("dim_value"):
                ranges.append((dim.dim_value,) * 3)
            elif dim.dim_param in dim_ranges:
                ranges.append(tuple(dim_ranges[dim.dim_param]))
            else:
                missing.add(dim.dim_param or f"{graph_input.name}[{index}] (unnamed)")
        shapes[graph_input.name] = tuple(tuple(r[i] for r in ranges) for i in range(3))
    if missing:
        raise ValueError(f"no (min, opt, max) range for dynamic dimension(s) {sorted(missing)}")
    return shapes


def always_strongly_typed(trt) -> bool:
    """TensorRT 11 builds every network strongly typed and has no weak typing left."""
    return tensorrt_version(trt.__version__) >= (11, 0)


def network_flags(trt) -> int:
    """Explicit batch is the only mode since TensorRT 10, so the one flag left is typing,
    and only on 10.x (11 deprecates the flag: every network is strongly typed there)."""
    if always_strongly_typed(trt):
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def apply_builder_flags(trt, builder_config) -> None:
    """Set or clear each of `BUILDER_FLAGS` on a new builder config."""
    for name, on in BUILDER_FLAGS.items():
        flag = getattr(trt.BuilderFlag, name)
        if on:
            builder_config.set_flag(flag)
        else:
            builder_config.clear_flag(flag)


def manifest_entry(precision: str) -> dict:
    """What the engine directory's manifest says about how its TensorRT engines were built."""
    return {"precision": precision, "export_dtype": EXPORT_DTYPES[precision], "strongly_typed": True,
            "builder_flags": dict(BUILDER_FLAGS)}


def check_graph_precision(model: onnx.ModelProto, precision: str) -> None:
    """The weight matrices of the graph are in the precision the engine is built for (a
    strongly typed network computes in the types it is given)."""
    wanted = EXPORT_DTYPES[precision]
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    found = {dtype_of(t.data_type) for t in model.graph.initializer if t.data_type in floats and len(t.dims) >= 2}
    if found - {wanted}:
        raise ValueError(f"graph {model.graph.name!r} holds {'/'.join(sorted(found))} weights; a {precision} "
                         f"engine needs them exported as {wanted}")


def parse_network(trt, network, logger, model: onnx.ModelProto, onnx_path: Path) -> None:
    parser = trt.OnnxParser(network, logger)
    # the path lets the parser find external weight files next to the original model
    if not parser.parse(model.SerializeToString(), str(onnx_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}:\n{errors}")


def build_engine(onnx_path: str | Path, engine_path: str | Path,
                 config: TensorRTBuildOptions | Mapping) -> Path:
    """Build a serialized TensorRT engine (plan) for the ONNX graph at `onnx_path`."""
    options = config if isinstance(config, TensorRTBuildOptions) else TensorRTBuildOptions.from_mapping(config)
    trt = import_tensorrt()
    register_plugins()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    model = strip_plugin_functions(onnx.load(str(onnx_path), load_external_data=False))
    check_graph_precision(model, options.precision)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parse_network(trt, network, logger, model, onnx_path)
    builder_config = builder.create_builder_config()
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    apply_builder_flags(trt, builder_config)
    shapes = profile_shapes(model, options.dim_ranges)
    if shapes:  # a graph of fixed shapes needs no profile
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        builder_config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, builder_config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    engine_path.write_bytes(bytes(plan))
    return engine_path
