"""A stand-in for the parts of `tensorrt` (10.x or 11.x) and `tensorrt.plugin` this project
uses, so their callers can be checked on machines without TensorRT.

Only what the documented API has in the named version: TensorRT 11 has no weak-typing
builder flags (FP16, BF16, INT8) and numbers its network creation flags differently
(STRONGLY_TYPED = 0 and deprecated; in 10.x STRONGLY_TYPED = 1); `BuilderFlag.TF32` is on
in a new builder config in every version (NvInfer.h: "Enabled by default").

`tensorrt.plugin` is a recorder (`register` / `impl` keep the decorated functions) whose
shape expressions behave as the real ones do (`tensorrt.plugin._tensor`, 10.8 to 11.4):

- TensorRT calls a plugin's shape function twice: for the output types, with fake input
  expressions (`output_types` below), and for the shapes, with an expression builder that
  lives for that call only (`output_shapes`). A constant, `ShapeExpr(int)`, is made by
  that builder: outside a shape pass it is fake, and before TensorRT 10.15 the builder of
  the last shape pass stays referenced after TensorRT destroyed it, so a constant made
  during a later types pass calls into a destroyed builder (here: `StaleExpressionBuilder`).
- arithmetic on a fake expression gives a fake one; on a size tensor's expression it
  raises ValueError; an int operand becomes a constant; there are no reflected operators
  (`2 * expr` is a TypeError).
- non-fake expressions evaluate for given input extents with `value(env)`.
"""
from __future__ import annotations

import operator
import types
from dataclasses import dataclass, field

DTYPE_NAMES = ("float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
SIZE_TENSOR_ARITHMETIC = "It is not permitted to perform binary operations on size tensor expressions"
# the first release whose tensorrt.plugin resets the expression builder after a shape pass
BUILDER_RESET_SINCE = (10, 15)


class StaleExpressionBuilder(RuntimeError):
    """A constant was made with the builder of a shape pass TensorRT has already destroyed
    (what crashes, or corrupts memory, in TensorRT 10.8 to 10.14)."""


@dataclass(frozen=True)
class DataType:
    name: str

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


class ExpressionBuilder:
    """`IExprBuilder`: valid only during the shape pass it was handed to."""

    def __init__(self):
        self.alive = True

    def check(self) -> None:
        if not self.alive:
            raise StaleExpressionBuilder("ShapeExpr(int) used the expression builder of a shape pass that TensorRT "
                                         "already destroyed (tensorrt.plugin before 10.15 keeps it referenced)")


class ShapeExpr:
    """One symbolic extent: fake, a function of the input extents, or a size tensor's."""

    def __init__(self, api: "PluginAPI", function=None, size_tensor: bool = False, fake: bool = False):
        self.api, self.function, self.size_tensor, self._fake = api, function, size_tensor, fake or function is None

    @property
    def is_fake(self) -> bool:
        return self._fake

    @property
    def is_size_tensor(self) -> bool:
        return self.size_tensor

    def value(self, env: dict) -> int:
        if self.is_fake:
            raise RuntimeError("a fake ShapeExpr has no value")
        return self.function(env)

    def _op(self, other, combine):
        if self.size_tensor:
            raise ValueError(SIZE_TENSOR_ARITHMETIC)
        if self.is_fake:
            return ShapeExpr(self.api)
        if isinstance(other, int):
            other = self.api.ShapeExpr(other)
        if other.size_tensor:
            raise ValueError(SIZE_TENSOR_ARITHMETIC)
        builder = self.api.builder
        if builder is None or other.is_fake:
            raise RuntimeError("IExprBuilder.operation outside a shape pass")
        builder.check()
        return ShapeExpr(self.api, lambda env: combine(self.value(env), other.value(env)))

    def __add__(self, other):
        return self._op(other, operator.add)

    def __sub__(self, other):
        return self._op(other, operator.sub)

    def __mul__(self, other):
        return self._op(other, operator.mul)

    def __floordiv__(self, other):
        return self._op(other, operator.floordiv)


@dataclass
class TensorDesc:
    dtype: DataType
    shape_expr: tuple


@dataclass
class SizeTensorDesc:
    opt: ShapeExpr
    upper_bound: ShapeExpr
    dtype: DataType = field(default_factory=lambda: DataType("int32"))

    def expr(self) -> ShapeExpr:
        """Stands for the value the plugin writes; at its bound unless `env` names it."""
        if self.opt.is_fake:
            return ShapeExpr(self.opt.api, size_tensor=True, fake=True)
        return ShapeExpr(self.opt.api, lambda env: env.get(id(self), self.upper_bound.value(env)), size_tensor=True)


class PluginAPI:
    """`tensorrt.plugin`: records what `register` and `impl` decorate, and drives a
    registered shape function the two ways TensorRT calls it."""

    TensorDesc = TensorDesc
    SizeTensorDesc = SizeTensorDesc

    class Tensor:
        pass

    def __init__(self, trt, version: tuple[int, int]):
        self.trt, self.version = trt, version
        self.shape_functions, self.implementations = {}, {}
        self.builder: ExpressionBuilder | None = None  # ShapeExpr._exprBuilder

    def register(self, plugin_id: str):
        def decorate(function):
            self.shape_functions[plugin_id] = function
            return function
        return decorate

    def impl(self, plugin_id: str):
        def decorate(function):
            self.implementations[plugin_id] = function
            return function
        return decorate

    def ShapeExpr(self, value: int) -> ShapeExpr:  # noqa: N802 - the API's name
        if self.builder is None:
            return ShapeExpr(self)
        self.builder.check()
        return ShapeExpr(self, lambda env, v=value: v)

    def size_tensor(self, opt: ShapeExpr, upper_bound: ShapeExpr) -> SizeTensorDesc:
        if not (isinstance(opt, ShapeExpr) and isinstance(upper_bound, ShapeExpr)):
            raise TypeError("size_tensor takes ShapeExpr bounds")
        return SizeTensorDesc(opt, upper_bound)

    def from_shape_expr(self, shape, dtype) -> TensorDesc:
        return TensorDesc(dtype, tuple(e if isinstance(e, ShapeExpr) else self.ShapeExpr(e) for e in shape))

    def variable(self, name: str) -> ShapeExpr:
        """An input extent as the shape pass hands it over: the `env` entry `name`."""
        return ShapeExpr(self, lambda env: env[name])

    def output_types(self, plugin_id: str, dtypes: list, ranks: list[int], **attributes) -> list:
        """`get_output_data_types`: fake input shapes, the builder left as it is."""
        inputs = [TensorDesc(dtype, tuple(ShapeExpr(self) for _ in range(rank))) for dtype, rank in zip(dtypes, ranks)]
        return [desc.dtype for desc in self.shape_functions[plugin_id](*inputs, **attributes)]

    def output_shapes(self, plugin_id: str, inputs: list[TensorDesc], **attributes) -> tuple:
        """`get_output_shapes`: a builder valid for this call only; before 10.15 it stays
        referenced afterwards."""
        self.builder = ExpressionBuilder()
        try:
            return self.shape_functions[plugin_id](*inputs, **attributes)
        finally:
            self.builder.alive = False  # TensorRT destroys it when the call returns
            if self.version >= BUILDER_RESET_SINCE:
                self.builder = None

    def layer(self, plugin_id: str, inputs: list[TensorDesc], **attributes) -> tuple:
        """What a network with this plugin node asks of it: types, then shapes."""
        self.output_types(plugin_id, [desc.dtype for desc in inputs], [len(desc.shape_expr) for desc in inputs],
                          **attributes)
        return self.output_shapes(plugin_id, inputs, **attributes)


def input_desc(trt, dtype: str, extents: list[str]) -> TensorDesc:
    """A plugin input of `dtype` whose extents are the named variables of an `env`."""
    return TensorDesc(getattr(trt, dtype), tuple(trt.plugin.variable(name) for name in extents))


class BuilderConfig:
    """`IBuilderConfig`'s flags as a set (TF32 on from the start, as in TensorRT), plus
    recorders of the other calls the builder makes."""

    def __init__(self, builder_flags):
        self.flags = {builder_flags.TF32}
        self.memory_limits, self.profiles = {}, []

    def set_flag(self, flag) -> None:
        self.flags.add(flag)

    def clear_flag(self, flag) -> None:
        self.flags.discard(flag)

    def get_flag(self, flag) -> bool:
        return flag in self.flags

    def set_memory_pool_limit(self, pool, size: int) -> None:
        self.memory_limits[pool] = size

    def add_optimization_profile(self, profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


def fake_tensorrt(version: str = "10.8.0") -> types.SimpleNamespace:
    """A `tensorrt` module of `version` (10.x or 11.x); the builder, parser and runtime are
    mocks that record their calls."""
    from unittest import mock

    major, minor = (int(part) for part in version.split(".")[:2])
    trt = types.SimpleNamespace(__version__=version)
    trt.plugin = PluginAPI(trt, (major, minor))
    for name in DTYPE_NAMES:
        setattr(trt, name, DataType(name))
    if major >= 11:
        trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0, PREFER_JIT_PYTHON_PLUGINS=1,
                                                                  PREFER_AOT_PYTHON_PLUGINS=2)
        trt.BuilderFlag = types.SimpleNamespace(TF32=6, VERSION_COMPATIBLE=12, REFIT=4)
    else:
        trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=1,
                                                                  PREFER_JIT_PYTHON_PLUGINS=2,
                                                                  PREFER_AOT_PYTHON_PLUGINS=3)
        trt.BuilderFlag = types.SimpleNamespace(FP16=0, BF16=17, INT8=1, TF32=6, VERSION_COMPATIBLE=13, REFIT=4)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
    trt.Logger = mock.MagicMock(name="Logger")
    trt.Builder = mock.MagicMock(name="Builder")
    trt.Builder.return_value.create_builder_config.side_effect = lambda: BuilderConfig(trt.BuilderFlag)
    trt.Builder.return_value.build_serialized_network.return_value = b"plan-bytes"
    trt.OnnxParser = mock.MagicMock(name="OnnxParser")
    trt.OnnxParser.return_value.parse.return_value = True
    return trt
