"""Built engine directories (`scripts/build_engines.py`) behind the `Engine` protocol.

`load_engine_pair` validates the whole directory first (manifest format, plugin versions,
draft/target compatibility, the sha256 of every file, the tokenizer's fingerprint) and
only then opens the backend's sessions, so a bad directory fails fast with a message
naming the problem, never halfway through loading.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

BACKEND_MODULES = {"onnxruntime": "runtime.engines.onnxruntime_engine",
                   "tensorrt": "runtime.engines.tensorrt_engine"}


@dataclass(frozen=True)
class EngineLimits:
    """What the engines were built for; larger requests fail with these numbers named."""

    max_draft_tokens: int
    max_branches: int
    max_context: int
    max_batch: int

    @property
    def max_cache_entries(self) -> int:
        """A draft cache holds the context plus a full branch tree and the glue entry."""
        return self.max_context + (self.max_branches + 1) * self.max_draft_tokens + 1

    @classmethod
    def from_manifest(cls, manifest: dict) -> "EngineLimits":
        build = manifest["build"]
        return cls(build["max_draft_tokens"], build["max_branches"], build["max_context"], build["max_batch"])


def load_engine_tokenizer(engine_dir: Path, manifest: dict):
    """The tokenizer shipped in the directory, checked against the fingerprint built in."""
    from build.manifest import ManifestError
    from runtime.checkpoint import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(engine_dir / manifest["tokenizer"]["dir"])
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer"]["fingerprint"]:
        raise ManifestError(f"{engine_dir}: the tokenizer in {manifest['tokenizer']['dir']!r} is not the "
                            "one the engines were built with (fingerprint differs)")
    return tokenizer


def load_engine_pair(engine_dir: str | Path, target_threads: int | None = None,
                     draft_threads: int | None = None):
    """`(target_engine, draft_engine)` of a built engine directory, validated first.

    Thread counts default to the build config's `session.threads`."""
    from build.manifest import ManifestError, validate_engine_dir

    engine_dir = Path(engine_dir)
    manifest = validate_engine_dir(engine_dir)
    backend = manifest["backend"]
    if backend not in BACKEND_MODULES:
        raise ManifestError(f"{engine_dir}: unknown backend {backend!r} (known: {', '.join(BACKEND_MODULES)})")
    module = importlib.import_module(BACKEND_MODULES[backend])
    tokenizer = load_engine_tokenizer(engine_dir, manifest)
    return (module.open_engine(engine_dir, "target", manifest, tokenizer, target_threads),
            module.open_engine(engine_dir, "draft", manifest, tokenizer, draft_threads))
