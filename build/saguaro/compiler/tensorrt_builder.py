"""Build a TensorRT engine from an exported ONNX graph carrying `saguaro` plugin nodes.

Steps: strip the plugin nodes' local-function bodies (TensorRT's parser would otherwise
inline them as standard ops, since it prefers a model's local function to a plugin),
register the `tensorrt.plugin` definitions, parse, add one optimization profile over the
graph's named dynamic dimensions, build, write the plan.

Precision: networks are strongly typed (TensorRT deprecated weak typing in 10.12 and
removed it in 11, where every network is strongly typed and the STRONGLY_TYPED creation
flag is deprecated, so it is set only on 10.x), so fp16/bf16/int8 come from the ONNX
itself (Cast / Q-DQ nodes). `strongly_typed: false` keeps the old builder flags for
TensorRT 10.x builds of an fp32 graph; TensorRT 11 refuses that with a clear error
(`check_precision_support`, before any export). Flags are always looked up by name:
their numbers changed in 11.

Every plugin node is checked against its op's signature before the parser sees it
(`check_plugin_node`): a node naming fewer or more outputs than the plugin declares
fails TensorRT's parser (onnx-tensorrt >= 10.6), and an op without a TensorRT plugin
(GatherKV) cannot be built at all.

TensorRT is imported inside the functions that need it; the ONNX-side helpers here
(`strip_plugin_functions`, `profile_shapes`, `TensorRTBuildOptions`) work without it.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from saguaro.plugins.branch_draft.signature import GATHER_SIGNATURE
from saguaro.plugins.branch_draft.signature import SIGNATURE as BRANCH_DRAFT
from saguaro.plugins.fused_verify.signature import SIGNATURE as FUSED_VERIFY
from saguaro.plugins.tensorrt_plugins import register_plugins
from saguaro.plugins.tensorrt_registry import import_tensorrt, tensorrt_version

PLUGIN_DOMAIN = "saguaro"
PLUGIN_SIGNATURES = {signature.name: signature for signature in (FUSED_VERIFY, BRANCH_DRAFT, GATHER_SIGNATURE)}
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
# weak-typing builder flag per precision (TensorRT <= 10.x only)
_WEAK_TYPING_FLAGS = {"fp16": "FP16", "bf16": "BF16", "int8": "INT8"}


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


def strip_plugin_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose `saguaro` nodes have no function bodies, only their attributes.

    TensorRT's ONNX parser then imports each such node as the plugin named by its op type
    and `plugin_namespace` / `plugin_version`. Functions of other domains stay.
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
    return stripped


DimRange = tuple[int, int, int]


@dataclass(frozen=True)
class TensorRTBuildOptions:
    """What `build_engine` needs: ranges (min, opt, max) for each named dynamic dimension of
    the graph inputs (`batch`, `query`, `past` ...), the precision and the workspace size."""

    dim_ranges: dict[str, DimRange] = field(default_factory=dict)
    precision: str = "fp32"
    strongly_typed: bool = True
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
        `strongly_typed`, `workspace_gib`."""
        dims = {name: tuple(int(v) for v in values) for name, values in config.get("dims", {}).items()}
        return cls(dim_ranges=dims, precision=config.get("precision", "fp32"),
                   strongly_typed=bool(config.get("strongly_typed", True)),
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
        ranges = []
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


def network_flags(trt, options: TensorRTBuildOptions) -> int:
    """Explicit batch is the only mode since TensorRT 10, so the one flag left is typing,
    and only on 10.x (11 deprecates the flag: every network is strongly typed there)."""
    if options.strongly_typed and not always_strongly_typed(trt):
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return 0


def check_precision_support(trt, options: TensorRTBuildOptions) -> None:
    """A weakly typed build (fp16 from an fp32 graph) needs TensorRT 10.x."""
    if not options.strongly_typed and always_strongly_typed(trt):
        raise RuntimeError(
            f"TensorRT {trt.__version__} has no weak typing, so it cannot build {options.precision} engines "
            "from this exporter's fp32 graphs; use precision fp32, or TensorRT 10.x for fp16 "
            "(pip install 'tensorrt>=10.8,<11')")


def apply_precision(trt, builder_config, options: TensorRTBuildOptions) -> None:
    """Weakly typed builds only: allow the requested lower precision by builder flag."""
    flag = _WEAK_TYPING_FLAGS.get(options.precision)
    if options.strongly_typed or flag is None:
        return
    check_precision_support(trt, options)
    if not hasattr(trt.BuilderFlag, flag):
        raise RuntimeError(
            f"TensorRT {trt.__version__} has no weak typing (BuilderFlag.{flag}); export the ONNX "
            f"in {options.precision} (Cast or Q/DQ nodes) and build with strongly_typed: true")
    builder_config.set_flag(getattr(trt.BuilderFlag, flag))


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
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, options))
    parse_network(trt, network, logger, model, onnx_path)
    builder_config = builder.create_builder_config()
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    apply_precision(trt, builder_config, options)
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
