"""A stand-in for the parts of `tensorrt` (10.x or 11.x) and `tensorrt.plugin` this project
uses, so their callers can be checked on machines without TensorRT.

Only what the documented API has in the named version: TensorRT 11 has no weak-typing
builder flags (FP16, BF16, INT8) and numbers its network creation flags differently
(STRONGLY_TYPED = 0 and deprecated; in 10.x STRONGLY_TYPED = 1). `tensorrt.plugin` is a
recorder: `register` / `impl` keep the decorated functions, descriptors keep their type
and symbolic shape, and shape expressions evaluate for given input extents.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from unittest import mock

DTYPE_NAMES = ("float32", "float16", "int64", "int32", "int8", "uint8", "bool")


@dataclass(frozen=True)
class DataType:
    name: str

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


class Expr:
    """A shape expression: a function of the input extents, evaluated with `value(env)`."""

    def __init__(self, function):
        self.function = function

    @staticmethod
    def of(value) -> "Expr":
        return value if isinstance(value, Expr) else Expr(lambda env, v=value: v)

    def value(self, env: dict) -> int:
        return self.function(env)

    def __add__(self, other):
        other = Expr.of(other)
        return Expr(lambda env: self.value(env) + other.value(env))

    __radd__ = __add__

    def __mul__(self, other):
        other = Expr.of(other)
        return Expr(lambda env: self.value(env) * other.value(env))

    __rmul__ = __mul__


@dataclass
class TensorDesc:
    dtype: DataType
    shape_expr: tuple


@dataclass
class SizeTensorDesc:
    opt: Expr
    upper_bound: Expr
    dtype: DataType = field(default_factory=lambda: DataType("int32"))

    def expr(self) -> Expr:
        return Expr(lambda env: env.get(id(self), self.upper_bound.value(env)))


class PluginAPI:
    """`tensorrt.plugin`: records what `register` and `impl` decorate."""

    TensorDesc = TensorDesc
    SizeTensorDesc = SizeTensorDesc

    class Tensor:
        pass

    def __init__(self):
        self.shape_functions, self.implementations = {}, {}

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

    @staticmethod
    def ShapeExpr(value) -> Expr:  # noqa: N802 - the API's name
        return Expr.of(value)

    @staticmethod
    def size_tensor(opt, upper_bound) -> SizeTensorDesc:
        return SizeTensorDesc(Expr.of(opt), Expr.of(upper_bound))

    @staticmethod
    def from_shape_expr(shape, dtype) -> TensorDesc:
        return TensorDesc(dtype, tuple(Expr.of(extent) for extent in shape))


def input_desc(trt, dtype: str, extents: list[str]) -> TensorDesc:
    """A plugin input of `dtype` whose extents are the named variables of an `env`."""
    return TensorDesc(getattr(trt, dtype), tuple(Expr(lambda env, name=name: env[name]) for name in extents))


def fake_tensorrt(version: str = "10.8.0") -> types.SimpleNamespace:
    """A `tensorrt` module of `version` (10.x or 11.x); the builder and runtime are mocks
    that record their calls."""
    major = int(version.split(".")[0])
    trt = types.SimpleNamespace(__version__=version, plugin=PluginAPI())
    for name in DTYPE_NAMES:
        setattr(trt, name, DataType(name))
    if major >= 11:
        trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0, PREFER_JIT_PYTHON_PLUGINS=1,
                                                                  PREFER_AOT_PYTHON_PLUGINS=2)
        trt.BuilderFlag = types.SimpleNamespace(VERSION_COMPATIBLE=12, REFIT=4)
    else:
        trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=1,
                                                                  PREFER_JIT_PYTHON_PLUGINS=2,
                                                                  PREFER_AOT_PYTHON_PLUGINS=3)
        trt.BuilderFlag = types.SimpleNamespace(FP16=0, BF16=1, INT8=2, VERSION_COMPATIBLE=13, REFIT=4)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
    trt.Logger = mock.MagicMock(name="Logger")
    trt.Builder = mock.MagicMock(name="Builder")
    trt.Builder.return_value.build_serialized_network.return_value = b"plan-bytes"
    trt.OnnxParser = mock.MagicMock(name="OnnxParser")
    trt.OnnxParser.return_value.parse.return_value = True
    return trt
