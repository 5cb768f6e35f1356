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

from saguaro.runtime.checkpoint import load_tokenizer, tokenizer_fingerprint
from saguaro.runtime.engines.manifest import ManifestError, validate_engine_dir

BACKEND_MODULES = {"onnxruntime": "saguaro.runtime.engines.onnxruntime_engine",
                   "tensorrt": "saguaro.runtime.engines.tensorrt_engine",
                   # the target in TensorRT-LLM, the draft in one of the two above
                   "tensorrt_llm": "saguaro.runtime.engines.tensorrt_llm_target"}


def load_engine_tokenizer(engine_dir: Path, manifest: dict):
    """The tokenizer shipped in the directory, checked against the fingerprint built in."""
    tokenizer = load_tokenizer(engine_dir / manifest["tokenizer"]["dir"])
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer"]["fingerprint"]:
        raise ManifestError(f"{engine_dir}: the tokenizer in {manifest['tokenizer']['dir']!r} is not the "
                            "one the engines were built with (fingerprint differs)")
    return tokenizer


def backend_module(engine_dir: Path, manifest: dict):
    backend = manifest["backend"]
    if backend not in BACKEND_MODULES:
        raise ManifestError(f"{engine_dir}: unknown backend {backend!r} (known: {', '.join(BACKEND_MODULES)})")
    return importlib.import_module(BACKEND_MODULES[backend])


def load_engine_pair(engine_dir: str | Path, target_threads: int | None = None,
                     draft_threads: int | None = None):
    """`(target_engine, draft_engine)` of a built engine directory, validated first; a draft
    the manifest calls a feature head opens as its backend's feature draft.

    Thread counts default to the build config's `session.threads`."""
    engine_dir = Path(engine_dir)
    manifest = validate_engine_dir(engine_dir)
    module = backend_module(engine_dir, manifest)
    tokenizer = load_engine_tokenizer(engine_dir, manifest)
    return (module.open_engine(engine_dir, "target", manifest, tokenizer, target_threads),
            module.open_engine(engine_dir, "draft", manifest, tokenizer, draft_threads))


def load_draft_engine(engine_dir: str | Path, threads: int | None = None):
    """The draft engine alone of a built engine directory, validated first (what a drafter
    running in another process loads)."""
    engine_dir = Path(engine_dir)
    manifest = validate_engine_dir(engine_dir)
    tokenizer = load_engine_tokenizer(engine_dir, manifest)
    return backend_module(engine_dir, manifest).open_engine(engine_dir, "draft", manifest, tokenizer, threads)
