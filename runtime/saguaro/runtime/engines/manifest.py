"""The engine directory's manifest.json: what was built from what, and a hash of every file.

One home for the format, on the loading side: the compiler writes it with
`write_manifest` (last, so a directory with a manifest is complete), and the runtime
validates it before loading anything: format, plugin versions against the code that will
run them, draft/target compatibility, and the sha256 of every file (a file that is
missing, changed, or not in the manifest fails with its name). Layout:

  format, format_version, name, backend, precision
  build        the build config (limits, session settings)
  models       target / draft: Hugging Face config, shape, checkpoint path, tokenizer
               fingerprint, bos/eos ids, graphs {kind: {onnx, engine}}, signatures;
               a feature draft's `kind: feature_head` (its shape: the head's, with the
               feature layers it reads), its target's `feature_layers` (it returns them)
  tokenizer    folder, fingerprint, vocab size
  plugins      {name: {namespace, version}}
  versions     exporter and backend versions, opset
  inputs       sha256 of every checkpoint file the build read (target/..., draft/...)
  files        sha256 of every file in the directory but the manifest itself
  calibration  optional (ONNX Runtime builds): seconds of the target's and the draft's
               forwards by size on the building machine, and `hidden_branches` by K
               (`control.calibration`); manifests without it load, with no hidden budget
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import saguaro.plugins.branch_draft as branch_draft
import saguaro.plugins.fused_verify as fused_verify
from saguaro.runtime.models.checkpoint import CheckpointError, check_pair_compatible
from saguaro.runtime.core.contracts import EngineInfo, EngineLimits
from saguaro.runtime.control.calibration import calibration_from_manifest

MANIFEST_FILE = "manifest.json"
FORMAT = "saguaro-engines"
FORMAT_VERSION = 3  # 2: one fused model graph per role and KV slots (max_batch); 3: scored_positions,
                    # and a partial vocabulary's scores spread by the engine (scored_tokens)
ROLES = ("target", "draft")
FEATURE_HEAD = "feature_head"  # a draft entry's `kind` when the draft is an EAGLE-3 head
PLUGINS = {module.PLUGIN_NAME: {"namespace": module.PLUGIN_NAMESPACE, "version": module.PLUGIN_VERSION}
           for module in (fused_verify, branch_draft)}
REQUIRED_KEYS = ("format", "format_version", "name", "backend", "precision", "build", "models",
                 "tokenizer", "plugins", "versions", "inputs", "files")


class ManifestError(ValueError):
    """An engine directory is incomplete, altered, or was built for other code."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_files(root: Path) -> list[str]:
    """POSIX paths, relative to `root`, of every file under it but the manifest."""
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*")
                  if path.is_file() and path.relative_to(root).as_posix() != MANIFEST_FILE)


def hash_tree(root: Path) -> dict[str, str]:
    return {name: sha256_file(root / name) for name in tree_files(root)}


def write_manifest(root: Path, content: dict) -> Path:
    """Hash the directory as it stands and write the manifest (the build's last step)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **content,
                "plugins": PLUGINS, "files": hash_tree(root)}
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise ValueError(f"manifest content lacks {missing}")
    path = root / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(root: Path) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"engine directory {str(root)!r} does not exist")
    path = root / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{str(root)!r} is not an engine directory: no {MANIFEST_FILE} "
                            "(build one with scripts/build_engines.py)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ManifestError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: format_version {manifest.get('format_version')!r} is not "
                            f"{FORMAT_VERSION}; rebuild the engines")
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise ManifestError(f"{path}: missing key {missing[0]!r}")
    return manifest


def check_files(root: Path, manifest: dict) -> None:
    """Every listed file present with its hash, and no file the manifest does not list."""
    listed: dict[str, str] = manifest["files"]
    for name, expected in listed.items():
        path = root / name
        if not path.is_file():
            raise ManifestError(f"{root}: file {name!r} listed in {MANIFEST_FILE} is missing")
        if sha256_file(path) != expected:
            raise ManifestError(f"{root}: file {name!r} does not match its sha256 in {MANIFEST_FILE} "
                                "(changed after the build; rebuild the engines)")
    unlisted = sorted(set(tree_files(root)) - set(listed))
    if unlisted:
        raise ManifestError(f"{root}: file {unlisted[0]!r} is not listed in {MANIFEST_FILE}")


def check_plugins(manifest: dict) -> None:
    """The engines' plugin nodes must be the versions this code implements."""
    for name, expected in PLUGINS.items():
        built = manifest["plugins"].get(name)
        if built != expected:
            raise ManifestError(f"engines were built with plugin {name} {built!r}; this code "
                                f"provides {expected!r}: rebuild the engines")


def check_pair(manifest: dict) -> None:
    """Draft and target must share one tokenizer and vocabulary (token ids are compared)."""
    models = manifest["models"]
    missing = [role for role in ROLES if role not in models]
    if missing:
        raise ManifestError(f"manifest has no {missing[0]} model")
    target, draft = models["target"], models["draft"]
    try:
        check_pair_compatible(target["shape"]["vocab_size"], draft["shape"]["vocab_size"],
                              target["tokenizer_fingerprint"], draft["tokenizer_fingerprint"])
    except CheckpointError as error:
        raise ManifestError(f"incompatible engine pair: {error}") from error


def validate_engine_dir(root: str | Path) -> dict:
    """All checks, cheapest first; returns the manifest. Raises `ManifestError`."""
    root = Path(root)
    manifest = read_manifest(root)
    check_plugins(manifest)
    check_pair(manifest)
    check_files(root, manifest)
    return manifest


def manifest_eos_ids(model: dict) -> tuple[int, ...]:
    """`eos_token_ids` (every end-of-generation token); older manifests hold one `eos_token_id`."""
    if "eos_token_ids" in model:
        return tuple(model["eos_token_ids"])
    return () if model["eos_token_id"] is None else (model["eos_token_id"],)


def engine_info(backend: str, engine_dir: Path, role: str, manifest: dict) -> EngineInfo:
    """What the decoding loops need to know of the `role` engine of a validated directory."""
    model = manifest["models"][role]
    limits = EngineLimits.from_manifest(manifest)
    return EngineInfo(backend=backend, path=str(Path(engine_dir) / role), vocab_size=model["shape"]["vocab_size"],
                      max_context=limits.max_context, eos_token_ids=manifest_eos_ids(model),
                      bos_token_id=model["bos_token_id"], tokenizer_fingerprint=model["tokenizer_fingerprint"],
                      limits=limits, calibration=calibration_from_manifest(manifest),
                      feature_layers=tuple(model.get("feature_layers", ())),
                      reads_features=is_feature_draft(model), acceptance=tuple(model.get("acceptance", ())))


def is_feature_draft(model: dict) -> bool:
    """Whether a model entry is a feature head (manifests before feature drafts have no `kind`)."""
    return model.get("kind") == FEATURE_HEAD
