"""Load a local Hugging Face checkpoint of the Llama family (config.json + safetensors + tokenizer).

Architectures (`model_type`): llama, mistral, qwen2 (q/k/v biases), qwen3 (per-head q/k
RMSNorm), all run by the one `llama.Llama` with the switches of `LlamaShape`. A sliding
attention window (Mistral, Qwen with `use_sliding_window`) becomes the context limit:
within the window, windowed attention is full attention, so the computation stays exact.

No hub access ever: paths are local folders, and a folder that is not such a checkpoint
fails with a message that names the folder and what is wrong, before any weights load.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from saguaro.runtime.models.llama import Llama, LlamaShape

SUPPORTED_ROPE_TYPES = ("default", None, "linear", "llama3")
ROPE_SCALING_KEYS: dict[str | None, tuple[str, ...]] = {"linear": ("factor",),
                                                        "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                                   "original_max_position_embeddings")}


# A config.json key of this project's drafts that score part of the vocabulary (see
# `llama.LlamaShape.output_vocab`); transformers does not know it.
OUTPUT_VOCAB_KEY = "saguaro_output_vocab"
DRAFT_REPORT = "draft.json"  # what `make_models.py --draft-for` measured of the draft it made


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed, or not something this runtime can run."""


@dataclass
class Checkpoint:
    path: Path
    shape: LlamaShape
    model: Llama
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # generation stops at any of them


def read_config(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{str(path)!r} is not a Hugging Face checkpoint: no config.json")
    return json.loads(config_file.read_text())


def architecture_switches(config: dict, where: str) -> dict:
    """The `LlamaShape` switches of a config's `model_type`; others are refused by name."""
    model_type = config.get("model_type")
    attention_bias = bool(config.get("attention_bias", False))
    switches = {
        "llama": dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(config.get("mlp_bias", False))),
        "mistral": {},
        "qwen2": dict(qkv_bias=True),
        "qwen3": dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True),
    }
    if model_type not in switches:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(switches)})")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(f"{where}: hidden_act {activation!r} is not supported (only silu)")
    return {**switches[model_type], "model_type": model_type}


def attention_window(config: dict) -> int | None:
    """The sliding window when any layer uses one (Mistral always; Qwen when enabled)."""
    window = config.get("sliding_window")
    if config.get("model_type") == "mistral":
        return window
    sliding_layers = "sliding_attention" in (config.get("layer_types") or [])
    return window if window and (sliding_layers or config.get("use_sliding_window")) else None


def llama_shape(config: dict, where: str = "config") -> LlamaShape:
    """Validate a Hugging Face config dict of the Llama family and return its shape."""
    switches = architecture_switches(config, where)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported "
                              f"(supported: default, linear, llama3)")
    scaling_keys = ROPE_SCALING_KEYS.get(rope_type, ())
    missing = [key for key in scaling_keys if key not in rope]
    if missing:
        raise CheckpointError(f"{where}: rope type {rope_type!r} needs {', '.join(missing)}")
    rope_scaling = tuple(sorted([("rope_type", rope_type)] + [(key, rope[key]) for key in scaling_keys])) \
        if scaling_keys else ()
    heads = config["num_attention_heads"]
    window = attention_window(config)
    context = min(config["max_position_embeddings"], window or config["max_position_embeddings"])
    return LlamaShape(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        max_position_embeddings=context,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        output_vocab=int(config.get(OUTPUT_VOCAB_KEY, 0)),
        **switches,
    )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(path)!r} has no *.safetensors weights")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer  # heavy import, only when a checkpoint loads

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{str(path)!r}: cannot load its tokenizer ({error})") from error


def build_model(shape: LlamaShape, state: dict[str, torch.Tensor], where: str) -> Llama:
    model = Llama(shape)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (shape.tie_word_embeddings and name == "lm_head.weight")]
    unexpected = [name for name in unexpected if not name.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise CheckpointError(f"{where}: weights do not match a {shape.model_type} model of this config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    config = read_config(path)
    shape = llama_shape(config, where=str(path))
    tokenizer = load_tokenizer(path)
    model = build_model(shape, read_state_dict(path), where=str(path))
    return Checkpoint(path, shape, model, tokenizer, config.get("bos_token_id"),
                      end_of_generation_ids(path, config, tokenizer))


def end_of_generation_ids(path: Path, config: dict, tokenizer) -> tuple[int, ...]:
    """The tokens generation stops at: generation_config.json's `eos_token_id` (a chat
    model lists its end-of-turn token and its end-of-text token there), else config.json's,
    else the tokenizer's EOS. One id or a list; empty when none is known."""
    generation_file = Path(path) / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos = generation.get("eos_token_id", config.get("eos_token_id", tokenizer.eos_token_id))
    eos = eos if isinstance(eos, list) else [eos]
    return tuple(dict.fromkeys(int(token) for token in eos if token is not None))


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary and special tokens: equal fingerprints tokenize identically."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token]
    return hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()[:16]


def check_pair_compatible(target_vocab: int, draft_vocab: int,
                          target_tokenizer: str, draft_tokenizer: str) -> None:
    """Speculative decoding compares token ids: draft and target must share one vocabulary."""
    if target_vocab != draft_vocab:
        raise CheckpointError(f"draft vocab_size {draft_vocab} differs from target vocab_size {target_vocab}")
    if target_tokenizer != draft_tokenizer:
        raise CheckpointError(f"draft tokenizer (fingerprint {draft_tokenizer}) differs from the "
                              f"target's ({target_tokenizer}): they must share one tokenizer")


def measured_acceptance(draft_dir: str | Path) -> tuple[float, ...]:
    """P(the draft at depth j is accepted | the ones before were), j = 1..K, from the
    held-out greedy rounds in a draft folder's report (`DRAFT_REPORT`); empty when the
    folder has none (a draft made elsewhere)."""
    try:
        report = json.loads((Path(draft_dir) / DRAFT_REPORT).read_text())
        histogram = [float(share) for share in report["acceptance"]["accepted_histogram"]]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return acceptance_by_depth(histogram)


def acceptance_by_depth(histogram: list[float]) -> tuple[float, ...]:
    """Conditional acceptance per depth from the shares of rounds accepting 0..K drafts."""
    rates = []
    for depth in range(1, len(histogram)):
        reached = sum(histogram[depth - 1:])
        if reached <= 0:
            break
        rates.append(sum(histogram[depth:]) / reached)
    return tuple(rates)
