"""A GGUF file (llama.cpp's format) in, a Hugging Face Llama checkpoint folder out.

    read the file -> check everything that can refuse it (architecture, hyperparameters,
    every tensor's name, quantisation type and shape, the tokenizer) -> dequantise every
    tensor to float32, undo llama.cpp's q/k row permutation, rename to Hugging Face names
    -> write config.json, generation_config.json, model.safetensors, the tokenizer files
    with the chat template, and gguf_import.json (what was imported and how it checked)

Orientation: GGUF lists a tensor's dimensions innermost first (ggml's `ne`), so reversed
they are numpy's `(out_features, in_features)`, already `nn.Linear`'s layout.

q/k permutation: llama.cpp's converter reorders the rows of each attention head of q_proj
and k_proj so that its RoPE, which rotates adjacent pairs (2i, 2i+1), computes what
Hugging Face's `rotate_half`, which pairs i with i + head_dim/2, computes on the original
rows. `unpermute_rows` is the exact inverse.

Float32 weights are lossless: every Q4_1 / Q8_0 value is `d * q (+ m)` from fp16 numbers,
which float32 holds exactly.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants
from safetensors.torch import save_file

from saguaro.modelmaker.gguf_tokenizer import GGUFTokenizer, GGUFTokenizerError, build_tokenizer, for_transformers
from saguaro.runtime.models.llama import LlamaShape

ARCHITECTURES = ("llama",)  # GGUF's "llama" covers Llama 1-3, SmolLM, dense Mistral
Q = GGMLQuantizationType
# What `gguf.quants` dequantises and this importer has been run on; others are refused.
HANDLED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                 Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REPORT_FILE = "gguf_import.json"

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFImportError(ValueError):
    """A GGUF file this importer refuses; the message names the file and what is wrong."""


@dataclass
class ImportReport:
    source: str
    out: str
    name: str | None
    architecture: str
    hyperparameters: dict
    tied_embeddings: bool
    parameters: int
    quantisation_types: dict[str, int]
    tokenizer: dict
    tensor_map: dict[str, str]
    seconds: dict[str, float] = field(default_factory=dict)
    checks: dict = field(default_factory=dict)


# ---- reading and refusing (all before any tensor is dequantised) ----

def open_gguf(path: Path) -> tuple[GGUFReader, dict]:
    """The reader and the metadata as plain Python values."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    try:
        reader = GGUFReader(str(path), "r")
    except (ValueError, OSError) as error:
        raise GGUFImportError(f"{path}: not a readable GGUF file ({error})") from error
    metadata = {key: value.contents() for key, value in reader.fields.items() if not key.startswith("GGUF.")}
    return reader, metadata


def architecture(metadata: dict) -> str:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"general.architecture {arch!r} is not handled "
                              f"(this importer reads: {', '.join(ARCHITECTURES)})")
    return arch


def hyperparameters(metadata: dict, vocab_size: int, tied: bool) -> LlamaShape:
    """A llama-architecture GGUF's numbers (its `llama.*` metadata) as the runtime's shape."""
    arch = architecture(metadata)

    def number(key: str, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFImportError(f"metadata key {arch}.{key} is missing")
        if isinstance(value, list):
            raise GGUFImportError(f"{arch}.{key} holds per-layer values, which this importer does not handle")
        return value

    if number("expert_count", 0):
        raise GGUFImportError(f"{arch}.expert_count = {number('expert_count')}: mixture-of-experts "
                              "models are not handled")
    hidden, heads = int(number("embedding_length")), int(number("attention.head_count"))
    head_dim = int(number("attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(number(key, head_dim)) != head_dim:
            raise GGUFImportError(f"{arch}.{key} = {number(key)} differs from the head size {head_dim} "
                                  "(partial rotary or unequal key/value sizes are not handled)")
    return LlamaShape(
        vocab_size=int(number("vocab_size", vocab_size)), hidden_size=hidden,
        intermediate_size=int(number("feed_forward_length")), num_layers=int(number("block_count")),
        num_heads=heads, num_kv_heads=int(number("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon")),
        rope_theta=float(number("rope.freq_base", 10000.0)),
        max_position_embeddings=int(number("context_length", 2048)), tie_word_embeddings=tied,
        rope_scaling=rope_scaling(metadata, arch))


def rope_scaling(metadata: dict, arch: str) -> tuple:
    """`LlamaShape.rope_scaling`: sorted (key, value) pairs, empty for plain RoPE."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return ()
    if kind == "linear":
        return (("factor", float(metadata[f"{arch}.rope.scaling.factor"])), ("rope_type", "linear"))
    raise GGUFImportError(f"{arch}.rope.scaling.type {kind!r} is not handled (only linear)")


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER_NAME.match(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    raise GGUFImportError(f"tensor {gguf_name!r} has no Hugging Face Llama counterpart in this importer")


def expected_shapes(hp: LlamaShape) -> dict[str, tuple[int, ...]]:
    h, q, kv = hp.hidden_size, hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    shapes = {"model.embed_tokens.weight": (hp.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (hp.vocab_size, h)}
    per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (hp.intermediate_size, h), "mlp.up_proj.weight": (hp.intermediate_size, h),
                 "mlp.down_proj.weight": (h, hp.intermediate_size)}
    for layer in range(hp.num_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def tensor_shape(tensor) -> tuple[int, ...]:
    """numpy order: ggml's `ne` reversed."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def check_tensors(reader: GGUFReader, hp: LlamaShape) -> dict[str, str]:
    """Every tensor's type, name and shape, and no required tensor missing; returns the
    name map. Runs before any dequantisation, so a refusal costs no time."""
    handled = ", ".join(t.name for t in HANDLED_TYPES)
    shapes, names = expected_shapes(hp), {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in HANDLED_TYPES:
            raise GGUFImportError(f"tensor {tensor.name!r} has quantisation type {tensor.tensor_type.name}, "
                                  f"which this importer does not dequantise (handled: {handled})")
        name = hf_name(tensor.name)
        if tensor_shape(tensor) != shapes[name]:
            raise GGUFImportError(f"tensor {tensor.name!r} has shape {list(tensor_shape(tensor))}; the "
                                  f"metadata implies {list(shapes[name])}")
        names[tensor.name] = name
    missing = sorted(set(shapes) - set(names.values()) - {"lm_head.weight"})
    if missing:
        raise GGUFImportError(f"no tensor for {missing[0]} ({len(missing)} missing in all)")
    return names


# ---- dequantising and mapping ----

def dequantize(tensor) -> np.ndarray:
    """float32 in numpy orientation, `(out, in)` for a matrix."""
    values = quants.dequantize(tensor.data, tensor.tensor_type)
    return np.array(values, dtype=np.float32).reshape(tensor_shape(tensor))  # a copy: the file is mapped read-only


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering (Hugging Face -> GGUF): within each head, row j*half + i
    moves to 2i + j. Here for tests, which build GGUF files from Hugging Face weights."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse (GGUF -> Hugging Face): within each head, row 2i + j moves to j*half + i."""
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor(tensor, hp: LlamaShape) -> np.ndarray:
    values = dequantize(tensor)
    if tensor.name.endswith("attn_q.weight"):
        return unpermute_rows(values, hp.num_heads)
    if tensor.name.endswith("attn_k.weight"):
        return unpermute_rows(values, hp.num_kv_heads)
    return values


def state_dict(reader: GGUFReader, hp: LlamaShape, names: dict[str, str], dtype: torch.dtype):
    return {names[t.name]: torch.from_numpy(np.ascontiguousarray(hf_tensor(t, hp))).to(dtype)
            for t in reader.tensors}


# ---- writing ----

def hf_config(hp: LlamaShape, spec: GGUFTokenizer, dtype: str) -> dict:
    """config.json as transformers 5 writes a LlamaConfig (`rope_parameters`)."""
    rope = {"rope_type": "default", **dict(hp.rope_scaling), "rope_theta": hp.rope_theta}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": hp.vocab_size,
            "hidden_size": hp.hidden_size, "intermediate_size": hp.intermediate_size,
            "num_hidden_layers": hp.num_layers, "num_attention_heads": hp.num_heads,
            "num_key_value_heads": hp.num_kv_heads, "head_dim": hp.head_dim, "hidden_act": "silu",
            "max_position_embeddings": hp.max_position_embeddings, "rms_norm_eps": hp.rms_norm_eps,
            "rope_parameters": rope, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": hp.tie_word_embeddings, "bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id,
            "pad_token_id": spec.pad_token_id, "dtype": dtype}


def generation_config(spec: GGUFTokenizer) -> dict:
    """Generation stops at any end-of-generation token (e.g. both <|im_end|> and <|endoftext|>)."""
    eos = spec.end_of_generation_ids
    return {"bos_token_id": spec.bos_token_id, "eos_token_id": eos if len(eos) > 1 else spec.eos_token_id,
            "pad_token_id": spec.pad_token_id}


def staging_folder(out: Path) -> Path:
    """Write beside the destination, then move: an interrupted import leaves nothing half-written."""
    if out.exists() and not (out.is_dir() and ((out / REPORT_FILE).is_file() or not any(out.iterdir()))):
        raise GGUFImportError(f"output {str(out)!r} exists and is not an imported checkpoint; "
                              "choose another folder or remove it")
    staging = out.resolve().with_name(f".{out.resolve().name}.importing")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_checkpoint(folder: Path, weights: dict, config: dict, generation: dict, spec: GGUFTokenizer,
                     max_length: int) -> None:
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for_transformers(spec, max_length).save_pretrained(str(folder))


def type_counts(reader: GGUFReader) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


@dataclass
class Inspected:
    """A GGUF file that passed every check; nothing dequantised yet."""

    path: Path
    reader: GGUFReader
    name: str | None  # general.name
    hp: LlamaShape
    names: dict[str, str]
    tokenizer: GGUFTokenizer


def inspect_gguf(path: str | Path) -> Inspected:
    """Read and check a GGUF file; raises `GGUFImportError` naming the file and the problem."""
    path = Path(path)
    reader, metadata = open_gguf(path)
    try:
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        hp = hyperparameters(metadata, tensor_shape(embedding)[0] if embedding is not None else 0, tied)
        names = check_tensors(reader, hp)
        tokenizer = build_tokenizer(metadata)
    except (GGUFImportError, GGUFTokenizerError) as error:
        raise GGUFImportError(f"{path}: {error}") from None
    if len(tokenizer.tokens) != hp.vocab_size:
        raise GGUFImportError(f"{path}: {len(tokenizer.tokens)} tokenizer tokens for a vocabulary of {hp.vocab_size}")
    return Inspected(path, reader, metadata.get("general.name"), hp, names, tokenizer)


def import_gguf(path: str | Path, out: str | Path, dtype: str = "float32") -> ImportReport:
    """Convert the GGUF at `path` into a checkpoint folder `out` (see `convert`)."""
    return convert(inspect_gguf(path), out, dtype)


def convert(source: Inspected, out: str | Path, dtype: str = "float32") -> ImportReport:
    """Write the checked GGUF `source` as a checkpoint folder `out`; returns what was done
    (also in `out/gguf_import.json`, which the caller rewrites with its checks)."""
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    seconds: dict[str, float] = {}
    out = Path(out)
    staging = staging_folder(out)
    try:
        mark = time.perf_counter()
        weights = state_dict(source.reader, source.hp, source.names, DTYPES[dtype])
        seconds["dequantize"] = time.perf_counter() - mark
        mark = time.perf_counter()
        write_checkpoint(staging, weights, hf_config(source.hp, source.tokenizer, dtype),
                         generation_config(source.tokenizer), source.tokenizer, source.hp.max_position_embeddings)
        seconds["write"] = time.perf_counter() - mark
        report = import_report(source, out, weights, seconds)
        write_report(staging, report)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return report


def import_report(source: Inspected, out: Path, weights: dict, seconds: dict) -> ImportReport:
    spec = source.tokenizer
    return ImportReport(
        source=str(source.path.resolve()), out=str(out), name=source.name, architecture="llama",
        hyperparameters=asdict(source.hp), tied_embeddings=source.hp.tie_word_embeddings,
        parameters=sum(w.numel() for w in weights.values()),
        quantisation_types=type_counts(source.reader),
        tokenizer={"pre_tokenizer": spec.pre_tokenizer, "tokens": len(spec.tokens),
                   "bos": spec.text_of(spec.bos_token_id), "eos": spec.text_of(spec.eos_token_id),
                   "end_of_generation": [spec.tokens[i] for i in spec.end_of_generation_ids],
                   "chat_template": spec.chat_template is not None},
        tensor_map=dict(source.names), seconds=seconds)


def write_report(folder: Path, report: ImportReport) -> None:
    data = asdict(report)
    data["seconds"] = {key: round(value, 3) for key, value in report.seconds.items()}
    (folder / REPORT_FILE).write_text(json.dumps(data, indent=1) + "\n")
