"""Small GGUF files written in tests, the way llama.cpp's converter writes a Llama.

`write_llama_gguf` takes a random Hugging Face Llama and a byte-level BPE tokenizer and
writes what `convert_hf_to_gguf.py` would: q/k rows permuted, tensors quantised as asked,
the vocabulary with its merges and token types, special ids and a chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from saguaro.modelmaker.gguf_import import permute_rows

Q = GGMLQuantizationType
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ("The capital of France is Paris. 12 + 34 = 46, don't  stop;\n\tcafé naïve 日本語 🌵 it's I'm "
        "The quick brown fox jumps over the lazy dog 2024-01-01. ") * 30
CONTROL, NORMAL = 3, 1
QUANTISABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


def byte_level_bpe(vocab_size: int = 320) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tokenizer


def vocabulary_of(tokenizer: Tokenizer) -> tuple[list[str], list[str]]:
    """Tokens in id order and merges as "a b" strings, read from the tokenizer's JSON."""
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [text for text, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def random_llama(vocab_size: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True), **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a mix-up of norm tensors shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """Hugging Face weights under GGUF names, q/k permuted as llama.cpp's converter does."""
    config, state = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    for layer in range(config.num_hidden_layers):
        for hf, gguf_name in names.items():
            weight = state[f"model.layers.{layer}.{hf}"]
            if gguf_name == "attn_q.weight":
                weight = permute_rows(weight, config.num_attention_heads)
            elif gguf_name == "attn_k.weight":
                weight = permute_rows(weight, config.num_key_value_heads)
            tensors[f"blk.{layer}.{gguf_name}"] = weight
    return tensors


def default_types(name: str) -> GGMLQuantizationType:
    """A file like SmolLM2's: Q8_0 embeddings, Q4_1 matrices, F32 norms."""
    if name.endswith("norm.weight"):
        return Q.F32
    return Q.Q8_0 if name == "token_embd.weight" or "attn_q" in name else Q.Q4_1


def add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, kind: GGMLQuantizationType) -> None:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if kind == Q.F32:
        writer.add_tensor(name, values)
    elif kind in QUANTISABLE:
        writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)
    else:  # a type gguf cannot write: blocks of zeros of the right size stand in
        block, size = GGML_QUANT_SIZES[kind]
        writer.add_tensor(name, np.zeros((values.shape[0], values.shape[1] // block * size), np.uint8), raw_dtype=kind)


def write_llama_gguf(path: Path, model: LlamaForCausalLM, tokenizer: Tokenizer, types=default_types,
                     architecture: str = "llama", tokenizer_model: str = "gpt2", extra_tensors=None,
                     chat_template: str | None = CHATML) -> Path:
    config = model.config
    writer = GGUFWriter(str(path), architecture)
    arch = architecture
    for key, value in (("context_length", config.max_position_embeddings), ("embedding_length", config.hidden_size),
                       ("block_count", config.num_hidden_layers), ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.head_count_kv", config.num_key_value_heads),
                       ("rope.dimension_count", config.hidden_size // config.num_attention_heads),
                       ("vocab_size", config.vocab_size)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_string("general.name", "tiny test llama")
    tokens, merges = vocabulary_of(tokenizer)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in SPECIALS else NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    for name, values in {**gguf_tensors(model), **(extra_tensors or {})}.items():
        add_tensor(writer, name, values, types(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

