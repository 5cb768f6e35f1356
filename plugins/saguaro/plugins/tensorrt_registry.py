"""Registering the `saguaro` plugins with TensorRT's Python plugin API (`tensorrt.plugin`).

TensorRT's ONNX parser maps a `saguaro` node whose function body was stripped to the
plugin registered under its op type, `plugin_namespace` and `plugin_version`. Each
plugin's `tensorrt_plugin.py` builds its `register()` with `registration` below; builds
and engine loads call `tensorrt_plugins.register_plugins` first (deserialising an engine
needs the creators too). TensorRT is imported only here, when a registration runs: its
libraries install from NVIDIA's index only (PyPI's `tensorrt` fetches them from there), and
this project imports everywhere without it.

Supported TensorRT: 10.8 (the first with `tensorrt.plugin` size tensors as used here) up
to 11.x. What changes within that range and is handled: weak typing is gone in 11 (every
engine here is strongly typed anyway) and `NetworkDefinitionCreationFlag.STRONGLY_TYPED` is
deprecated there (see `saguaro.compiler.tensorrt_builder`); before 10.15 `tensorrt.plugin`
keeps a destroyed expression builder after each shape pass (see the BranchDraft plugin).
12 is refused until checked.
"""
from __future__ import annotations

TENSORRT_INSTALL_HINT = ("pip install --extra-index-url https://pypi.nvidia.com 'tensorrt>=10.8,<12'; "
                         "offline: docs/gpu.md")
SUPPORTED_TENSORRT = ((10, 8), (12, 0))  # [lowest, first unsupported)
# `tensorrt.plugin` registers every plugin creator under this version.
QUICKLY_DEPLOYABLE_PLUGIN_VERSION = "1"
# array-interface type strings of the element types plugin outputs use
_TYPESTR = {"int64": "<i8", "int32": "<i4", "int8": "|i1", "float32": "<f4", "float16": "<f2"}


def tensorrt_version(version: str) -> tuple[int, int]:
    """(major, minor) of a TensorRT version string such as "10.8.0.43"."""
    major, minor, *_ = (version.split(".") + ["0"])[:3]
    return int(major), int(minor)


def check_tensorrt_version(version: str) -> None:
    lowest, unsupported = SUPPORTED_TENSORRT
    if not lowest <= tensorrt_version(version) < unsupported:
        raise ImportError(f"TensorRT {version} is not supported: this code is written for TensorRT "
                          f">= {lowest[0]}.{lowest[1]}, < {unsupported[0]} ({TENSORRT_INSTALL_HINT})")


def import_tensorrt():
    """The `tensorrt` module with its plugin API loaded, or an ImportError saying how to get it."""
    try:
        import tensorrt
        import tensorrt.plugin  # noqa: F401 - makes `tensorrt.plugin` an attribute
    except ImportError as error:
        raise ImportError(
            "This needs TensorRT >= 10.8 with its Python plugin API (tensorrt.plugin), which is "
            f"installed from NVIDIA's index only: {TENSORRT_INSTALL_HINT} ({error})") from error
    check_tensorrt_version(tensorrt.__version__)
    return tensorrt


def tensorrt_dtype(trt, dtype: str):
    """The `tensorrt.DataType` of a signature's element type name (`int64` -> `trt.int64`)."""
    return getattr(trt, dtype)


def check_input_types(trt, signature, descs) -> None:
    """A plugin's shape function refuses inputs whose type its signature does not list
    (TensorRT would otherwise hand the kernels bytes of another type)."""
    for spec, desc in zip(signature.inputs, descs):
        if desc.dtype not in [tensorrt_dtype(trt, dtype) for dtype in spec.dtypes]:
            raise TypeError(f"{signature.plugin_id}: {spec.name} must be {' or '.join(spec.dtypes)}, got {desc.dtype}")


def check_plugin_version(plugin_version: str) -> None:
    """The ONNX node's `plugin_version` must be the one `tensorrt.plugin` registers."""
    if plugin_version != QUICKLY_DEPLOYABLE_PLUGIN_VERSION:
        raise RuntimeError(
            f"plugin_version {plugin_version!r} cannot be found by TensorRT's ONNX parser: "
            f"tensorrt.plugin registers every plugin as version {QUICKLY_DEPLOYABLE_PLUGIN_VERSION!r}")


def registration(define_plugin, plugin_version: str):
    """A plugin's `register()`: import TensorRT, check the version, define it once per process."""
    done = False

    def register() -> None:
        nonlocal done
        if not done:
            trt = import_tensorrt()
            check_plugin_version(plugin_version)
            define_plugin(trt, trt.plugin)
            done = True

    return register


class DeviceBuffer:
    """A contiguous view of raw device memory for `torch.as_tensor`.

    A data-dependent output's `tensorrt.plugin.Tensor` has wildcard extents until the op
    has run, so its own array interface cannot describe it; once the extents are known,
    this can.
    """

    def __init__(self, pointer: int, shape: tuple, dtype: str):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype],
                                         "data": (pointer, False), "strides": None,
                                         "version": 3, "stream": None}
