"""Small random Llama checkpoints for tests that need exact control of the model, and
random feature heads (EAGLE-3) for a target checkpoint.

A word-level tokenizer lets the vocabulary be as small as a test wants (a model "small
enough to enumerate"), which a byte-level BPE cannot be.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.models.feature_head import FeatureHead, FeatureHeadShape, default_feature_layers, save_feature_head

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
# Few merges over text with accents, CJK and emoji: such characters span several tokens,
# exactly what incremental detokenisation must not split.
TRAINING_TEXT = "the quick brown fox jumps over the lazy dog. café naïve Ωmega 日本語 🌵 " * 40


def word_tokenizer(vocab_size: int, prefix: str = "w") -> PreTrainedTokenizerFast:
    words = SPECIALS + [f"{prefix}{i}" for i in range(vocab_size - len(SPECIALS))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def make_checkpoint(folder: Path, vocab_size: int = 8, hidden: int = 32, layers: int = 1,
                    heads: int = 4, kv_heads: int = 2, max_positions: int = 64, seed: int = 0,
                    logit_scale: float = 1.0, word_prefix: str = "w", max_shard_size: str = "5GB",
                    **config_overrides) -> Path:
    """A random Llama; `logit_scale` sharpens (> 1) or flattens its next-token distributions."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3), **config_overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    word_tokenizer(vocab_size, word_prefix).save_pretrained(folder)
    return Path(folder)


def byte_level_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TRAINING_TEXT], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def build_engines_cli(pair: Path, out: Path, *flags: str, draft: Path | None = None) -> Path:
    """Build an engine folder from a pair (or its target and `draft`, e.g. a feature head)
    with `scripts/build_engines.py`, as users do."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_engines.py"
    build = subprocess.run([sys.executable, str(script), "--target", str(pair / "target"),
                            "--draft", str(draft or pair / "draft"), "--out", str(out), "--quiet", *flags],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    return out


def build_small_engines(pair: Path, out: Path, name: str, max_draft_tokens: int, max_branches: int,
                        **settings) -> Path:
    """ONNX Runtime engines of a test pair, built in-process (64-token context unless
    `settings` say otherwise: any `BuildConfig` field, e.g. precision or max_batch)."""
    from saguaro.compiler.builder import build_engines
    from saguaro.compiler.config import BuildConfig

    config = BuildConfig(name=name, target=pair / "target", draft=pair / "draft",
                         max_draft_tokens=max_draft_tokens, max_branches=max_branches,
                         **{"max_context": 64, **settings})
    build_engines(config, out, show_progress=False)
    return out


def with_longer_context(pair: Path, out: Path, max_positions: int) -> Path:
    """A copy of a pair that accepts `max_positions` tokens (RoPE runs past its training
    length: the text degrades, the computation stays exact). Long generations are what
    cancellation and concurrency tests need."""
    for role in ("target", "draft"):
        shutil.copytree(pair / role, out / role)
        config_file = out / role / "config.json"
        config = json.loads(config_file.read_text())
        config["max_position_embeddings"] = max_positions
        config_file.write_text(json.dumps(config))
    return out


ARCHITECTURE_CONFIGS = {  # model_type -> (config class, model class) names in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_architecture_checkpoint(folder: Path, model_type: str, vocab_size: int = 64, seed: int = 0,
                                 **config_overrides) -> Path:
    """A small random checkpoint of a Llama-family architecture, with every bias and norm
    weight drawn away from its initial 0 or 1, so a switch left off changes the logits."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in ARCHITECTURE_CONFIGS[model_type])
    torch.manual_seed(seed)
    config = config_class(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=3), **config_overrides})
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.uniform_(-0.5, 0.5)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
        model.lm_head.weight.mul_(10)  # logits of order 1, so differences show against the tolerance
    model.save_pretrained(folder)
    word_tokenizer(vocab_size).save_pretrained(folder)
    return Path(folder)


def random_head(target_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random-initialised head in the release format, for the target in `target_dir`,
    over a random half of its vocabulary."""
    target = TorchEngine(target_dir)
    shape = target.model.shape
    head_shape = FeatureHeadShape(
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta, rope_scaling=shape.rope_scaling,
        max_position_embeddings=shape.max_position_embeddings, vocab_size=shape.vocab_size,
        draft_vocab_size=shape.vocab_size // 2, feature_layers=default_feature_layers(shape.num_layers),
        target_hidden_size=shape.hidden_size)
    generator = torch.Generator().manual_seed(seed)
    head = FeatureHead(head_shape, target.model.model.embed_tokens.weight)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    head.set_vocabulary(torch.randperm(shape.vocab_size, generator=generator)[:head_shape.draft_vocab_size])
    save_feature_head(head, out)
    return out
