"""Load any local Hugging Face Llama checkpoint (config.json + safetensors + tokenizer).

No hub access ever: paths are local folders, and a folder that is not a Llama checkpoint
fails with a message that names the folder and what is wrong, before any weights load.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from saguaro.runtime.llama import Llama, LlamaShape

SUPPORTED_ROPE_TYPES = ("default", None, "linear", "llama3")
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")}


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed, or not something this runtime can run."""


@dataclass
class Checkpoint:
    path: Path
    shape: LlamaShape
    model: Llama
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    bos_token_id: int | None
    eos_token_id: int | None


def read_config(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{str(path)!r} is not a Hugging Face checkpoint: no config.json")
    return json.loads(config_file.read_text())


def llama_shape(config: dict, where: str = "config") -> LlamaShape:
    """Validate a Hugging Face config dict as a plain Llama and return its shape."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise CheckpointError(f"{where}: model_type is {model_type!r}; only 'llama' checkpoints are supported")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise CheckpointError(f"{where}: {flag}=true is not supported")
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
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
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
        raise CheckpointError(f"{where}: weights do not match a Llama of this config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    config = read_config(path)
    shape = llama_shape(config, where=str(path))
    tokenizer = load_tokenizer(path)
    model = build_model(shape, read_state_dict(path), where=str(path))
    eos = config.get("eos_token_id", tokenizer.eos_token_id)
    if isinstance(eos, list):
        eos = eos[0]
    return Checkpoint(path, shape, model, tokenizer, config.get("bos_token_id"), eos)


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
