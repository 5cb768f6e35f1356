"""Engines behind the `contracts.Engine` protocol: the eager torch reference over checkpoints,
and built engine directories (`scripts/build_engines.py`) for ONNX Runtime or TensorRT.

`load_engine_pair` validates the whole directory first (manifest format, plugin versions,
draft/target compatibility, the sha256 of every file, the tokenizer's fingerprint) and
only then opens the backend's sessions, so a bad directory fails fast with a message
naming the problem, never halfway through loading. A backend's module is imported only
when its engines load: TensorRT exists only on GPU machines.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from saguaro.runtime.models.checkpoint import load_tokenizer, tokenizer_fingerprint
from saguaro.runtime.engines.manifest import ManifestError, validate_engine_dir
from saguaro.runtime.engines.tensorrt_llm_settings import TensorRTLLMSettings

BACKEND_MODULES = {"onnxruntime": "saguaro.runtime.engines.onnxruntime_engine",
                   "tensorrt": "saguaro.runtime.engines.tensorrt_engine"}
# A backend whose target decodes whole requests itself: its target is a request loop
# (`saguaro.runtime.decoding.tensorrt_llm_loop`, which `Pipeline.load` opens); only its
# draft, an engine of one of the backends above, opens here.
REQUEST_LEVEL_BACKENDS = ("tensorrt_llm",)


def load_engine_tokenizer(engine_dir: Path, manifest: dict):
    """The tokenizer shipped in the directory, checked against the fingerprint built in."""
    tokenizer = load_tokenizer(engine_dir / manifest["tokenizer"]["dir"])
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer"]["fingerprint"]:
        raise ManifestError(f"{engine_dir}: the tokenizer in {manifest['tokenizer']['dir']!r} is not the "
                            "one the engines were built with (fingerprint differs)")
    return tokenizer


def backend_module(engine_dir: Path, manifest: dict, role: str):
    """The module that opens `role`'s engine of a validated folder."""
    backend = manifest["backend"]
    if backend in REQUEST_LEVEL_BACKENDS:
        if role == "target":
            raise ManifestError(f"{engine_dir}: a {backend} target decodes whole requests itself, so it is no "
                                "engine: open the folder with Pipeline.load")
        backend = TensorRTLLMSettings.from_manifest(manifest).draft_backend
    if backend not in BACKEND_MODULES:
        known = ", ".join([*BACKEND_MODULES, *REQUEST_LEVEL_BACKENDS])
        raise ManifestError(f"{engine_dir}: unknown backend {backend!r} (known: {known})")
    return importlib.import_module(BACKEND_MODULES[backend])


def open_engine(engine_dir: Path, manifest: dict, role: str, tokenizer, threads: int | None = None):
    """One engine of a folder `validate_engine_dir` has checked."""
    return backend_module(engine_dir, manifest, role).open_engine(engine_dir, role, manifest, tokenizer, threads)


def load_engine_pair(engine_dir: str | Path, target_threads: int | None = None,
                     draft_threads: int | None = None):
    """`(target_engine, draft_engine)` of a built engine directory, validated first; a draft
    the manifest calls a feature head opens as its backend's feature draft.

    Thread counts default to the build config's `session.threads`."""
    engine_dir = Path(engine_dir)
    manifest = validate_engine_dir(engine_dir)
    tokenizer = load_engine_tokenizer(engine_dir, manifest)
    return (open_engine(engine_dir, manifest, "target", tokenizer, target_threads),
            open_engine(engine_dir, manifest, "draft", tokenizer, draft_threads))


def load_draft_engine(engine_dir: str | Path, threads: int | None = None):
    """The draft engine alone of a built engine directory, validated first (what a drafter
    running in another process loads)."""
    engine_dir = Path(engine_dir)
    manifest = validate_engine_dir(engine_dir)
    return open_engine(engine_dir, manifest, "draft", load_engine_tokenizer(engine_dir, manifest), threads)
