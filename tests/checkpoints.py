"""Small random Llama checkpoints for tests that need exact control of the model.

A word-level tokenizer lets the vocabulary be as small as a test wants (a model "small
enough to enumerate"), which a byte-level BPE cannot be.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def word_tokenizer(vocab_size: int, prefix: str = "w") -> PreTrainedTokenizerFast:
    words = SPECIALS + [f"{prefix}{i}" for i in range(vocab_size - len(SPECIALS))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def make_checkpoint(folder: Path, vocab_size: int = 8, hidden: int = 32, layers: int = 1,
                    heads: int = 4, kv_heads: int = 2, max_positions: int = 64, seed: int = 0,
                    logit_scale: float = 1.0, word_prefix: str = "w") -> Path:
    """A random Llama; `logit_scale` sharpens (> 1) or flattens its next-token distributions."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder)
    word_tokenizer(vocab_size, word_prefix).save_pretrained(folder)
    return Path(folder)
