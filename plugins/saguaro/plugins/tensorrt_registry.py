"""Registering the `saguaro` plugins with TensorRT's Python plugin API (`tensorrt.plugin`).

TensorRT's ONNX parser maps a `saguaro` node whose function body was stripped to the
plugin registered under its op type, `plugin_namespace` and `plugin_version`. Each
plugin's `tensorrt_plugin.py` builds its `register()` with `registration` below; builds
and engine loads call `tensorrt_plugins.register_plugins` first (deserialising an engine
needs the creators too). TensorRT is imported only here, when a registration runs: it installs from
NVIDIA's index only, and this project imports everywhere without it.
"""
from __future__ import annotations

TENSORRT_INSTALL_HINT = "pip install --extra-index-url https://pypi.nvidia.com tensorrt"
# `tensorrt.plugin` registers every plugin creator under this version.
QUICKLY_DEPLOYABLE_PLUGIN_VERSION = "1"


def import_tensorrt():
    """The `tensorrt` module with its plugin API loaded, or an ImportError saying how to get it."""
    try:
        import tensorrt
        import tensorrt.plugin  # noqa: F401 - makes `tensorrt.plugin` an attribute
    except ImportError as error:
        raise ImportError(
            "This needs TensorRT >= 10.8 with its Python plugin API (tensorrt.plugin), which is "
            f"installed from NVIDIA's index only: {TENSORRT_INSTALL_HINT} ({error})") from error
    return tensorrt


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
