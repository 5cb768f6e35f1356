"""The build configuration: a YAML file, validated into frozen dataclasses, CLI overrides on top.

Every problem is found here, before any export starts, and each error names the key and
the value: an unknown key (a typo would otherwise be silently ignored), a wrong type
(`true` is not a thread count), an impossible value (a precision the backend cannot build).
Checks that need the checkpoints (context beyond the model, tokenizers that differ) are
the builder's, run right after this and still before any long work.

Relative paths in a config resolve against the current directory, like any CLI argument.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from saguaro.runtime.core.contracts import BUILD_DEFAULT_LIMITS, draft_cache_capacity
from saguaro.runtime.engines.onnxruntime_engine import SessionSettings
from saguaro.runtime.engines.tensorrt_llm_settings import TensorRTLLMSettings

# tensorrt_llm: the target runs in TensorRT-LLM from its checkpoint (nothing to build);
# the draft's graphs are built for `tensorrt_llm.draft_backend`.
BACKENDS = ("onnxruntime", "tensorrt", "tensorrt_llm")
# int8, int4: ORT's weight-only MatMulNBits (block 32); w8a8: int8 weights per channel and
# activations per token (MatMulInteger), faster for several rows a forward (`fused_export`).
# TensorRT builds float engines here, strongly typed from a graph exported in the precision
# (bf16 needs an Ampere or newer GPU); its int8/int4 would need calibration or Q/DQ graphs.
# For tensorrt_llm, `precision` is the draft's, in its draft backend.
PRECISIONS = {"onnxruntime": ("fp32", "int8", "int4", "w8a8"), "tensorrt": ("fp32", "fp16", "bf16")}
# A config that names no precision (or `auto`) gets its backend's: fp32 on CPU cores (ONNX
# Runtime has no bf16 kernels, and its fp16 is no faster there), fp16 on a GPU.
DEFAULT_PRECISIONS = {"onnxruntime": "fp32", "tensorrt": "fp16"}
MIN_OPSET = 17  # LayerNormalization-era opsets; the plugin functions are written for >= 17
MAX_DRAFT_TOKENS_LIMIT = 64  # beyond this a verify forward is no longer "one step"


class ConfigError(ValueError):
    """The build configuration is malformed or asks for something impossible."""


@dataclass(frozen=True)
class BuildConfig:
    name: str
    target: Path
    draft: Path
    backend: str = "onnxruntime"
    precision: str = "fp32"
    max_draft_tokens: int = BUILD_DEFAULT_LIMITS.max_draft_tokens  # K: the longest draft a verify graph accepts
    max_branches: int = BUILD_DEFAULT_LIMITS.max_branches   # fan-out budget B: branches pre-speculated per round
    max_context: int = BUILD_DEFAULT_LIMITS.max_context     # committed tokens per sequence (prompt + output)
    max_batch: int = BUILD_DEFAULT_LIMITS.max_batch         # KV slots per model: sequences decoded at once
    opset: int = MIN_OPSET
    session: SessionSettings = SessionSettings()
    tensorrt_llm: TensorRTLLMSettings = TensorRTLLMSettings()

    @property
    def draft_backend(self) -> str:
        """What the draft's graphs are built for (the target's too, except with tensorrt_llm)."""
        return self.tensorrt_llm.draft_backend if self.backend == "tensorrt_llm" else self.backend

    @property
    def max_cache_entries(self) -> int:
        """KV entries a draft cache may hold: the context plus a full branch tree and glue."""
        return draft_cache_capacity(self.max_context, self.max_branches, self.max_draft_tokens)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_name(value) -> bool:
    return isinstance(value, str) and value.replace("-", "").replace("_", "").isalnum()


def _is_core_list(value) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and all(_is_int(c) and c >= 0 for c in value))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_path(value) -> bool:
    return isinstance(value, (str, Path))


# What a field's annotation admits in YAML: (type check, what the error says it expected).
CHECKS_BY_TYPE = {
    "int": (_is_int, "an integer"),
    "float": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "Path": (_is_path, "a path"),
    "tuple[int, ...] | None": (_is_core_list, "a list of core numbers or null"),
}
# Fields whose values mean more than their type says.
SPECIAL_CHECKS = {
    "name": (_is_name, "a name of letters, digits, '-' or '_'"),
    "target": (_is_path, "a checkpoint folder path"),
    "draft": (_is_path, "a checkpoint or feature head (EAGLE-3) folder path"),
}


def key_types(cls) -> dict:
    """key -> (type check, expected) for every field of the dataclass `cls`, read from its
    annotations; a nested dataclass is a mapping of its own fields (or null)."""
    types = {}
    for field in dataclasses.fields(cls):
        default = field.default
        if dataclasses.is_dataclass(default):
            names = ", ".join(f.name for f in dataclasses.fields(default))
            types[field.name] = (lambda v: v is None or isinstance(v, dict), f"a mapping ({names})")
        else:
            types[field.name] = SPECIAL_CHECKS.get(field.name) or CHECKS_BY_TYPE[str(field.type)]
    return types


REQUIRED = ("name", "target", "draft")


def _check_keys_and_types(raw: dict, types: dict, where: str) -> None:
    unknown = sorted(set(raw) - set(types))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(types)})")
    for key, value in raw.items():
        check, expected = types[key]
        if not check(value):
            raise ConfigError(f"{where}: {key} must be {expected}, got {value!r}")


def _check_values(config: BuildConfig, where: str) -> None:
    def fail(key, value, why):
        raise ConfigError(f"{where}: {key}={value!r} {why}")

    if config.backend not in BACKENDS:
        fail("backend", config.backend, f"is not one of {', '.join(BACKENDS)}")
    if config.precision not in PRECISIONS[config.draft_backend]:
        backend = config.draft_backend if config.backend == "tensorrt_llm" else config.backend
        fail("precision", config.precision,
             f"is not supported by backend {backend} (choose {', '.join(PRECISIONS[config.draft_backend])})")
    if not 1 <= config.max_draft_tokens <= MAX_DRAFT_TOKENS_LIMIT:
        fail("max_draft_tokens", config.max_draft_tokens, f"must be in 1..{MAX_DRAFT_TOKENS_LIMIT}")
    if config.max_branches < 0:
        fail("max_branches", config.max_branches, "must be >= 0 (0 turns pre-speculation off)")
    if config.max_context < 2:
        fail("max_context", config.max_context, "must be >= 2 (a prompt token and an output)")
    if config.max_batch < 1:
        fail("max_batch", config.max_batch, "must be >= 1")
    if config.opset < MIN_OPSET:
        fail("opset", config.opset, f"must be >= {MIN_OPSET}")
    if config.session.threads < 1:
        fail("session.threads", config.session.threads, "must be >= 1")
    pins = config.session.pin_cores
    if pins is not None and len(pins) < config.session.threads - 1:
        fail("session.pin_cores", list(pins),
             f"names fewer cores than the {config.session.threads - 1} intra-op worker threads")


def config_from_dict(raw: Any, where: str = "config") -> BuildConfig:
    """Validate a parsed YAML mapping into a `BuildConfig`; `where` names it in errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(raw).__name__}")
    _check_keys_and_types(raw, key_types(BuildConfig), where)
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise ConfigError(f"{where}: missing required key {missing[0]!r}")
    session_raw = raw.get("session") or {}
    _check_keys_and_types(session_raw, key_types(SessionSettings), f"{where}: session")
    pins = session_raw.get("pin_cores")
    session = SessionSettings(**{**session_raw, "pin_cores": tuple(pins) if pins is not None else None})
    tensorrt_llm_raw = raw.get("tensorrt_llm") or {}
    _check_keys_and_types(tensorrt_llm_raw, key_types(TensorRTLLMSettings), f"{where}: tensorrt_llm")
    try:
        tensorrt_llm = TensorRTLLMSettings(**tensorrt_llm_raw)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from error
    fields = {key: value for key, value in raw.items() if key not in ("session", "tensorrt_llm")}
    fields["target"], fields["draft"] = Path(fields["target"]), Path(fields["draft"])
    config = BuildConfig(**fields, session=session, tensorrt_llm=tensorrt_llm)
    if fields.get("precision", "auto") == "auto" and config.draft_backend in DEFAULT_PRECISIONS:
        config = dataclasses.replace(config, precision=DEFAULT_PRECISIONS[config.draft_backend])
    _check_values(config, where)
    return config


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_path(name_or_path: str | Path) -> Path:
    """A config file's path: a path as given, or the name of a shipped config (`tiny`, `bench`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIGS / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"config file {str(path)!r} does not exist (shipped configs: {names})")


def load_config(path: str | Path) -> dict:
    """Read a YAML config file (or a shipped config by name) into a plain mapping,
    validated later by `config_from_dict`."""
    path = config_path(path)
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from error


# CLI flag destination -> where it lands in the YAML mapping
OVERRIDE_KEYS = {
    "backend": ("backend",), "precision": ("precision",), "max_draft_tokens": ("max_draft_tokens",),
    "max_branches": ("max_branches",), "max_context": ("max_context",), "max_batch": ("max_batch",),
    "target": ("target",), "draft": ("draft",), "threads": ("session", "threads"),
}


def merge_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Return `raw` with every override that is not None applied (flags beat the file)."""
    merged = {**raw, "session": dict(raw.get("session") or {})}
    for flag, value in overrides.items():
        if value is None:
            continue
        if flag not in OVERRIDE_KEYS:
            raise ConfigError(f"unknown override {flag!r}")
        *parents, key = OVERRIDE_KEYS[flag]
        (merged[parents[0]] if parents else merged)[key] = value
    if not merged["session"] and "session" not in raw:
        del merged["session"]
    return merged


def resolve_config(path: str | Path, overrides: dict[str, Any] | None = None) -> BuildConfig:
    """The config a build runs with: the file, then the command line's overrides."""
    raw = load_config(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    return config_from_dict(merge_overrides(raw, overrides or {}), where=str(path))


def config_to_dict(config: BuildConfig) -> dict:
    """Plain JSON-able form (for the manifest)."""
    data = dataclasses.asdict(config)
    data["target"], data["draft"] = str(config.target), str(config.draft)
    pins = config.session.pin_cores
    data["session"]["pin_cores"] = list(pins) if pins is not None else None
    return data
