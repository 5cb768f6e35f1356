"""Build an engine directory from a validated `BuildConfig`: the whole pipeline, top-down.

    check everything that can fail (checkpoints, pair, limits, backend, output folder)
    -> export both models (with a feature head for a draft, the target returns features)
    -> quantise -> assemble the plugin graphs -> backend build
    -> tokenizer files -> manifest.json (last: its presence means the build completed)
    -> ONNX Runtime: the calibration (forward costs by size), timed on the built engines,
       added to the manifest

The directory is built beside its destination and moved into place at the end, so an
interrupted build never leaves a half-written engine directory behind.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import onnx
import onnxruntime
import torch
import transformers
from tqdm.auto import tqdm

from saguaro.compiler import export, onnxruntime_builder
from saguaro.compiler.config import BuildConfig, ConfigError, config_to_dict
from saguaro.compiler.tensorrt_builder import EXPORT_DTYPES, DimRange, TensorRTBuildOptions, build_engine, manifest_entry
from saguaro.plugins.tensorrt_registry import import_tensorrt
from saguaro.runtime.control.calibration import measure_calibration
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.manifest import FEATURE_HEAD, MANIFEST_FILE, sha256_file, write_manifest
from saguaro.runtime.models.checkpoint import (
    CheckpointError,
    check_pair_compatible,
    end_of_generation_ids,
    llama_shape,
    load_checkpoint,
    load_tokenizer,
    measured_acceptance,
    read_config,
    read_state_dict,
    tokenizer_fingerprint,
)
from saguaro.runtime.models.feature_head import FeatureHeadShape, head_shape, is_feature_head, load_feature_head
from saguaro.runtime.models.llama import LlamaShape

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
TOKENIZER_DIR = "tokenizer"
# The graphs of each role, by backend. TensorRT parses standard ops (and does its own
# fusion), so it gets the traced graph with FusedVerify fused onto the forward; ONNX
# Runtime gets its fused operators. Both commit a branch between engine calls (in place).
GRAPHS = {"onnxruntime": onnxruntime_builder.GRAPHS,
          "tensorrt": {"target": ("forward", "verify"), "draft": ("forward", "branch_draft")}}


def role_backend(config: BuildConfig, role: str) -> str | None:
    """What a role's graphs are built for; None for a target TensorRT-LLM runs from its
    checkpoint (nothing to build)."""
    if role == "target" and config.backend == "tensorrt_llm":
        return None
    return config.draft_backend if role == "draft" else config.backend


def graphs_built(config: BuildConfig, role: str, feature_head: bool = False) -> tuple[str, ...]:
    backend = role_backend(config, role)
    if feature_head:
        return onnxruntime_builder.FEATURE_DRAFT_GRAPHS
    return () if backend is None else GRAPHS[backend][role]


@dataclass
class Source:
    """One checkpoint as inspected before the build: everything but its weights."""

    role: str
    path: Path
    config: dict
    shape: LlamaShape | FeatureHeadShape  # a feature head's: FeatureHeadShape
    tokenizer: object
    fingerprint: str
    feature_layers: tuple[int, ...] = ()  # a target's: the layers its feature draft reads
    target: "Source | None" = None  # a feature head's: the target whose embeddings and tokenizer it shares

    @property
    def is_feature_head(self) -> bool:
        return self.target is not None

    @property
    def model_source(self) -> "Source":
        """Where the tokenizer and the bos / eos ids come from: a head's target, else itself."""
        return self.target or self


@dataclass
class BuildRecord:
    """What the summary table and the manifest report, filled in as the build goes."""

    graphs: dict[str, dict[str, dict[str, str]]] = field(default_factory=lambda: {"target": {}, "draft": {}})
    seconds: dict[str, float] = field(default_factory=dict)


def inspect_checkpoint(role: str, path: Path) -> Source:
    config = read_config(path)
    shape = llama_shape(config, where=f"{role} checkpoint {str(path)!r}")
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"{role} checkpoint {str(path)!r} has no *.safetensors weights")
    tokenizer = load_tokenizer(path)
    return Source(role, path, config, shape, tokenizer, tokenizer_fingerprint(tokenizer))


def inspect_feature_head(path: Path, target: Source) -> Source:
    """A feature head (EAGLE-3) for `target`: its shape, checked to fit the target."""
    config = read_config(path)
    try:
        shape = head_shape(config, cast(LlamaShape, target.shape), f"draft feature head {str(path)!r}")
    except ValueError as error:
        raise CheckpointError(str(error)) from error
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"draft feature head {str(path)!r} has no *.safetensors weights")
    return Source("draft", path, config, shape, target.tokenizer, target.fingerprint, target=target)


def inspect_sources(config: BuildConfig) -> list[Source]:
    """The target and the draft; with a feature head for the draft, a target that returns
    the head's feature layers."""
    target = inspect_checkpoint("target", config.target)
    if not is_feature_head(config.draft):
        return [target, inspect_checkpoint("draft", config.draft)]
    draft = inspect_feature_head(config.draft, target)
    target = dataclasses.replace(target, feature_layers=cast(FeatureHeadShape, draft.shape).feature_layers)
    return [target, dataclasses.replace(draft, target=target)]


def check_sources(config: BuildConfig, target: Source, draft: Source) -> None:
    if draft.is_feature_head and config.backend != "onnxruntime":
        raise ConfigError(f"the draft {str(draft.path)!r} is a feature head, which is built for backend "
                          f"onnxruntime only (its target must return features); got backend {config.backend}")
    check_pair_compatible(target.shape.vocab_size, draft.shape.vocab_size, target.fingerprint, draft.fingerprint)
    for source in (target, draft):
        if config.max_context > source.shape.max_position_embeddings:
            raise ConfigError(f"max_context={config.max_context} is beyond the {source.role} model's "
                              f"max_position_embeddings {source.shape.max_position_embeddings}")
        if role_backend(config, source.role) == "onnxruntime" and source.shape.head_dim % 16:
            raise ConfigError(f"the {source.role} model's head_dim {source.shape.head_dim} is not a multiple of 16, "
                              "which ONNX Runtime's fused attention (GroupQueryAttention) needs")


def check_backend(config: BuildConfig) -> None:
    """Import what the backend build needs now, not after minutes of exporting. (A
    tensorrt_llm target needs TensorRT-LLM only where it is served, not to build.)"""
    if config.draft_backend == "tensorrt":
        try:
            import_tensorrt()
        except ImportError as error:
            raise ConfigError(f"backend={config.backend}: {error}") from error
        check_bf16_device(config)
    elif config.precision in ("int8", "int4"):
        try:
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: F401
        except ImportError as error:
            raise ConfigError(f"precision={config.precision} needs ONNX Runtime's MatMulNBits quantiser ({error}); "
                              "pip install onnx-ir") from error


def check_bf16_device(config: BuildConfig) -> None:
    """bf16 kernels need compute capability 8.0 (Ampere) or newer; TensorRT builds engines
    for the GPU it runs on, so that one is asked."""
    if config.precision != "bf16" or not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        raise ConfigError(f"precision=bf16 needs a GPU of compute capability >= 8.0; "
                          f"{torch.cuda.get_device_name()} is {capability[0]}.{capability[1]} (use fp16)")


def check_output(out: Path) -> None:
    """Replace only what is ours: an earlier engine directory or an empty folder."""
    if out.exists() and not (out.is_dir() and ((out / MANIFEST_FILE).is_file() or not any(out.iterdir()))):
        raise ConfigError(f"output {str(out)!r} exists and is not an engine directory; "
                          "choose another --out or remove it")


def export_model(config: BuildConfig, source: Source, folder: Path, work: Path) -> dict[str, Path]:
    """The role's ONNX graphs (plugin nodes included) in `folder`; returns stem -> path."""
    backend = role_backend(config, source.role)
    if backend is None:
        return {}
    if source.is_feature_head:
        return onnxruntime_builder.export_feature_draft(config, load_head(source), folder)
    if backend == "onnxruntime":
        return onnxruntime_builder.export_role(config, source.role, source.shape, source.path, folder,
                                               source.feature_layers)
    # strongly typed engines compute in the types of the graph: export in the precision
    model = load_checkpoint(source.path).model.to(getattr(torch, EXPORT_DTYPES[config.precision]))
    forward = export.export_forward(model, work / f"{source.role}_forward.onnx", config.opset)
    graphs = {"forward": forward}
    if source.role == "target":
        graphs["verify"] = export.assemble_verify(forward, config.opset, source.shape.vocab_size)
    paths = export.save_sharing_weights(graphs, folder)
    if source.role == "draft":
        paths["branch_draft"] = folder / "branch_draft.onnx"
        onnx.save_model(export.branch_draft_model(config.opset, config.max_branches), str(paths["branch_draft"]))
    return paths


def load_head(source: Source):
    """A feature head's weights, sharing its target's embedding table."""
    assert source.target is not None  # called for a feature head only
    embed_tokens = read_state_dict(source.target.path)["model.embed_tokens.weight"]
    return load_feature_head(source.path, cast(LlamaShape, source.target.shape), embed_tokens)


def build_backend(config: BuildConfig, path: Path, shape) -> Path:
    """The file the runtime loads for one graph: the checked ONNX file, or a TensorRT plan
    (only the draft's graphs are built with a tensorrt_llm target: the draft backend)."""
    if config.draft_backend == "onnxruntime":
        return onnxruntime_builder.check_loads(path, config.session)
    return build_engine(path, path.with_suffix(".plan"), tensorrt_options(config, shape.vocab_size, path.stem))


def tensorrt_options(config: BuildConfig, vocab_size: int, graph: str) -> TensorRTBuildOptions:
    """The optimisation profile of one graph over its named dimensions.

    Each corner (min, opt, max) is a shape set the graph can run, with total = past + n
    (the tests run every graph under ONNX Runtime at all three): the range of every
    input covers any call the runtime makes (past + n never exceeds the cache, which the
    box past <= cache, n <= longest query contains), and opt is a decode step at half the
    context. A verify feeds its K+1 tokens, so its query length follows K."""
    cache, k, typical = config.max_cache_entries, config.max_draft_tokens, config.max_context // 2
    longest_query = max(config.max_context, k + 1, config.max_branches)
    query = (1, k + 1, k + 1) if graph == "verify" else (1, 1, longest_query)
    dims = {"batch": (1, 1, config.max_batch), "n": query, "past": (0, typical, cache),
            "total": cast(DimRange, tuple(p + n for p, n in zip((0, typical, cache), query))),
            "k": (0, k, k), "k_plus_1": (1, k + 1, k + 1), "vocab": (vocab_size,) * 3}
    return TensorRTBuildOptions(dim_ranges=dims, precision=config.precision)


def copy_tokenizer(source: Path, folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, folder / name)
    return copied


def input_hashes(sources: list[Source]) -> dict[str, str]:
    """sha256 of every file of each checkpoint folder the build read."""
    return {f"{s.role}/{p.name}": sha256_file(p) for s in sources for p in sorted(s.path.iterdir()) if p.is_file()}


def graph_signature(path: Path) -> dict:
    """Names, element types and shapes (ints or symbolic names) of a graph's inputs and outputs."""
    graph = onnx.load(str(path), load_external_data=False).graph

    def describe(values):
        return [{"name": v.name, "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]
    return {"inputs": describe(graph.input), "outputs": describe(graph.output)}


def versions(config: BuildConfig) -> dict[str, str]:
    found = {"python": sys.version.split()[0], "torch": torch.__version__, "onnx": onnx.__version__,
             "onnxruntime": onnxruntime.__version__, "transformers": transformers.__version__,
             "opset": str(config.opset),
             "exporter": {"onnxruntime": "saguaro.compiler.fused_export (onnx.helper, ONNX Runtime fused ops)",
                          "tensorrt": "torch.onnx.export (TorchScript)"}[config.draft_backend]}
    if config.draft_backend == "tensorrt":
        found["tensorrt"] = import_tensorrt().__version__
    return found


def model_entry(source: Source, graphs: dict[str, dict[str, str]], root: Path) -> dict:
    """A role's manifest entry; a feature head's says so (`kind`, its shape with its feature
    layers) and takes its target's bos / eos, and that target's lists the layers it returns."""
    model = source.model_source
    eos = end_of_generation_ids(model.path, model.config, model.tokenizer)
    entry = {"checkpoint": str(source.path.resolve()), "config": source.config,
             "shape": dataclasses.asdict(source.shape), "tokenizer_fingerprint": source.fingerprint,
             "bos_token_id": model.config.get("bos_token_id"), "eos_token_id": eos[0] if eos else None,
             "eos_token_ids": list(eos), "graphs": graphs,
             "signatures": {stem: graph_signature(root / files["onnx"]) for stem, files in graphs.items()}}
    if source.role == "draft":
        entry["acceptance"] = list(measured_acceptance(source.path))
    if source.is_feature_head:
        entry["kind"] = FEATURE_HEAD
    if source.feature_layers:
        entry["feature_layers"] = list(source.feature_layers)
    return entry


def manifest_content(config: BuildConfig, sources: list[Source], record: BuildRecord, root: Path) -> dict:
    target = sources[0]
    content = {"name": config.name, "backend": config.backend, "precision": config.precision,
               "build": config_to_dict(config),
               "models": {s.role: model_entry(s, record.graphs[s.role], root) for s in sources},
               "tokenizer": {"dir": TOKENIZER_DIR, "fingerprint": target.fingerprint,
                             "vocab_size": target.shape.vocab_size},
               "versions": versions(config), "inputs": input_hashes(sources)}
    if config.draft_backend == "tensorrt":  # how the engines compute: types, TF32
        content["tensorrt"] = manifest_entry(config.precision)
    return content


def build_role(config: BuildConfig, source: Source, staging: Path, record: BuildRecord, bar) -> None:
    """Export one model's graphs, then build each for the backend, timing every step."""
    bar.set_description(f"export {source.role}")
    started = time.perf_counter()
    paths = export_model(config, source, staging / source.role, staging / "work")
    record.seconds[f"{source.role}/export"] = time.perf_counter() - started
    bar.update()
    for stem, path in paths.items():
        bar.set_description(f"{config.backend} {source.role}/{stem}")
        started = time.perf_counter()
        engine = build_backend(config, path, source.shape)
        record.seconds[f"{source.role}/{stem}"] = time.perf_counter() - started
        record.graphs[source.role][stem] = {"onnx": path.relative_to(staging).as_posix(),
                                            "engine": engine.relative_to(staging).as_posix()}
        bar.update()


def calibrate(config: BuildConfig, engine_dir: Path) -> dict:
    """The manifest's `calibration` entry: the built pair loaded as the runtime loads it
    (validated, with the build's session settings) and timed (`control.calibration`)."""
    target, draft = load_engine_pair(engine_dir)
    return measure_calibration(target, draft).to_manifest(config.max_draft_tokens, config.max_branches)


def build_engines(config: BuildConfig, out: Path, show_progress: bool = True) -> BuildRecord:
    """Validate everything, then build `out`. Raises ConfigError / CheckpointError up front."""
    out = Path(out)
    check_output(out)
    sources = inspect_sources(config)
    check_sources(config, *sources)
    check_backend(config)
    staging = out.resolve().with_name(f".{out.resolve().name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "work").mkdir(parents=True)
    record = BuildRecord()
    steps = sum(1 + len(graphs_built(config, s.role, s.is_feature_head)) for s in sources) + 2
    try:
        with tqdm(total=steps, desc="build", disable=not show_progress, file=sys.stderr) as bar:
            for source in sources:
                build_role(config, source, staging, record, bar)
            shutil.rmtree(staging / "work")
            bar.set_description("tokenizer + manifest")
            copy_tokenizer(config.target, staging / TOKENIZER_DIR)
            bar.update()
            content = manifest_content(config, sources, record, staging)
            write_manifest(staging, content)
            bar.update()
            if config.backend == "onnxruntime":
                bar.set_description("branch calibration")
                write_manifest(staging, {**content, "calibration": calibrate(config, staging)})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-built directory
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return record


def summary(config: BuildConfig, out: Path, record: BuildRecord) -> str:
    """The table printed at the end of a build: each engine file, its size and build time."""
    rows = [("graph", "engine file", "MB", "seconds")]
    total_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6
    for role, graphs in record.graphs.items():
        rows.append((f"{role}/export", "", "", f"{record.seconds[f'{role}/export']:.1f}"))
        for stem, files in graphs.items():
            rows.append((f"{role}/{stem}", files["engine"], f"{(out / files['engine']).stat().st_size / 1e6:.2f}",
                         f"{record.seconds[f'{role}/{stem}']:.1f}"))
    rows.append(("all files", "", f"{total_mb:.2f}", f"{sum(record.seconds.values()):.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.append(f"{out}: backend {config.backend}, precision {config.precision}, K <= {config.max_draft_tokens}, "
                 f"branches <= {config.max_branches}, context <= {config.max_context}")
    return "\n".join(lines)
