"""A pure-torch Llama that runs Hugging Face Llama checkpoints against an explicit KV cache.

One implementation with small switches covers the Llama family's variants (`LlamaShape`):
q/k/v (and o) projection biases (Qwen2; Llama's `attention_bias`), per-head RMSNorm of q
and k before RoPE (Qwen3), biased MLPs (Llama's `mlp_bias`); Mistral is a Llama whose
sliding window the loader turns into a context limit. A draft may score only part of the
vocabulary (`output_vocab`): its lm_head has that many rows, and every other token gets
`UNSCORED` logits, so its probability is exactly 0 and speculative decoding, which only
ever accepts what the target would produce, stays lossless.

Why not `LlamaForCausalLM` itself: speculative decoding needs control the Hugging Face
forward does not give cleanly: arbitrary positions and a full boolean attention mask per
query (tree/branch drafting), truncation, and gathering cache entries to commit a branch.
The layer math is written once here and used by both forms the project needs:

- `forward_packed`: a ragged batch of sequences writing new K/V into their slots of a
  preallocated pool in place (the torch engine);
- `forward_concat`: takes past K/V and returns present K/V (the ONNX export form).
Parameter names match Hugging Face's, so a checkpoint's state dict loads unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from saguaro.runtime.core.sampling import UNSCORED


@dataclass(frozen=True)
class LlamaShape:
    """The architecture numbers of a Llama checkpoint (read from its config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Hugging Face `rope_parameters` beyond the base: rope_type "linear" or "llama3" and
    # their numbers, as sorted (key, value) pairs (hashable); empty for plain RoPE.
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: tuple = ()
    qkv_bias: bool = False   # biases on q_proj, k_proj, v_proj (Qwen2, Llama attention_bias)
    o_bias: bool = False     # a bias on o_proj (Llama attention_bias)
    mlp_bias: bool = False   # biases on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False    # RMSNorm over each head of q and k, before RoPE (Qwen3)
    model_type: str = "llama"
    output_vocab: int = 0    # a draft's lm_head rows when it scores part of the vocabulary; 0: all

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """Per-layer cache entry shape without the sequence axis: (layers, kv heads, head dim)."""
        return self.num_layers, self.num_kv_heads, self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the statistics in float32: a half-precision square overflows at |x| > 255
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, d, bias = shape.hidden_size, shape.head_dim, shape.qkv_bias
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(d, shape.rms_norm_eps)
            self.k_norm = RMSNorm(d, shape.rms_norm_eps)
        self.shape = shape


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, i, bias = shape.hidden_size, shape.intermediate_size, shape.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaBody(nn.Module):
    """Holds the parameters under Hugging Face's names (`model.layers.0.self_attn.q_proj`...)."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


def rope_inverse_frequencies(shape: LlamaShape) -> torch.Tensor:
    """RoPE frequencies, with Hugging Face's "linear" or "llama3" scaling when configured."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = dict(shape.rope_scaling)
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return llama3_frequencies(inv_freq, scaling)
    return inv_freq


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's rule: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between (wavelengths measured against the original context)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for `positions` `[batch, n]` -> two `[batch, 1, n, head_dim]` tensors."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # the float32 tables would promote a half-precision x (and so the KV cache) to float32
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention; `mask` `[batch, n, total]` is True where a query may look."""
    groups = q.shape[1] // keys.shape[1]
    # eagerly (shapes are ints), SDPA serves the K/V heads to their query groups itself: no
    # copy of the cache per step, 2-3x faster decoding at SmolLM2's 3 groups; a traced
    # graph repeats them, as ONNX's attention has no grouped form
    eager = isinstance(groups, int) and not (torch.jit.is_tracing() or torch.onnx.is_in_onnx_export())
    if eager and q.dtype != torch.float32:
        return grouped_attention(q, keys, values, mask)
    if groups > 1 and not eager:  # grouped-query attention: each K/V head serves `groups` query heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    mask = mask.unsqueeze(1)
    if q.dtype != torch.float32:
        # ONNX's export of a bool mask adds it as float32, which would run a half-precision
        # attention (and o_proj after it) in float32; an additive mask of q's type does not
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=eager and groups > 1)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attend` for half-precision eager calls: CPU's bf16 SDPA kernel runs 7x slower than
    two grouped matmuls (measured at SmolLM2's shapes, batch 64, one new token). Scores and
    softmax in float32; a fully masked query gets a uniform mix instead of NaN."""
    batch, heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * n, dim)  # row g * n + j: group g's query j
    scores = (grouped @ keys.transpose(-1, -2)).float() * dim ** -0.5
    allowed = mask.repeat(1, heads // kv_heads, 1).unsqueeze(1)      # the same rows of the mask
    weights = scores.masked_fill(~allowed, torch.finfo(torch.float32).min).softmax(-1).to(q.dtype)
    return (weights @ values).reshape(batch, heads, n, dim)


def write_cache(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor,
                counts: torch.Tensor) -> None:
    """Write each row's `counts[row]` new K/V entries at `past[row]` of its cache row
    (`keys`/`values` `[batch, kv_heads, capacity, head_dim]`, `k`/`v` `[batch, kv_heads, n, head_dim]`).
    One indexed write when every row brings all n (decoding a batch: a per-row loop of
    small copies cost a fifth of a 64-row step)."""
    n = k.shape[2]
    if bool((counts == n).all()):
        rows = torch.arange(k.shape[0]).unsqueeze(1)
        at = past.unsqueeze(1) + torch.arange(n)
        keys[rows, :, at] = k.transpose(1, 2)
        values[rows, :, at] = v.transpose(1, 2)
        return
    for row, (start, count) in enumerate(zip(past.tolist(), counts.tolist())):
        keys[row, :, start:start + count] = k[row, :, :count]
        values[row, :, start:start + count] = v[row, :, :count]


class Features:
    """The hidden states a feature draft reads (EAGLE-3's "auxiliary hidden states"):
    feature layer i is the hidden state entering decoder layer i (vLLM's and SpecForge's
    convention), layer `num_layers` the one leaving the last layer before the final norm;
    the chosen layers' states are concatenated in the order given: `[.., len * hidden]`."""

    def __init__(self, layers: tuple[int, ...], num_layers: int):
        if any(not 0 <= layer <= num_layers for layer in layers):
            raise ValueError(f"feature layers {tuple(layers)} outside 0..{num_layers} (the model's layers)")
        self.layers = tuple(layers)
        self.taken: dict[int, torch.Tensor] = {}

    def take(self, layer: int, h: torch.Tensor) -> None:
        if layer in self.layers:
            self.taken[layer] = h

    def joined(self) -> torch.Tensor | None:
        return torch.cat([self.taken[layer] for layer in self.layers], dim=-1) if self.layers else None


class Llama(nn.Module):
    output_rows: torch.Tensor  # a buffer, with an `output_vocab` (registered in __init__)

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.output_vocab or shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if shape.output_vocab:
            # For every token id: the lm_head row that scores it, or `output_vocab` (a row of
            # UNSCORED appended to the logits) for tokens the draft never proposes.
            self.register_buffer("output_rows", torch.full((shape.vocab_size,), shape.output_vocab))
        self.inv_freq = rope_inverse_frequencies(shape)  # a constant, not a parameter

    def _project_qkv(self, layer: DecoderLayer, h: torch.Tensor, cos, sin):
        batch, n, _ = h.shape
        attn, d = layer.self_attn, self.shape.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(batch, n, -1, d)
        k = attn.k_proj(x).view(batch, n, -1, d)
        v = attn.v_proj(x).view(batch, n, -1, d).transpose(1, 2)
        if self.shape.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def _finish_layer(self, layer: DecoderLayer, h, q, keys, values, mask) -> torch.Tensor:
        batch, n, _ = h.shape
        out = attend(q, keys, values, mask).transpose(1, 2).reshape(batch, n, -1)
        h = h + layer.self_attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def output_logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head rows only: `[.., output_vocab or vocab_size]` (what a draft trains on)."""
        return self.lm_head(self.model.norm(h)).float()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.output_logits(h)
        if not self.shape.output_vocab:
            return logits
        padded = F.pad(logits, (0, 1), value=UNSCORED)
        return padded[..., self.output_rows]  # a Gather: [.., vocab_size]

    def forward_concat(self, input_ids, position_ids, attention_mask, past_keys, past_values):
        """Export form. `past_*` `[layers, batch, kv_heads, past, head_dim]`;
        `attention_mask` `[batch, n, past + n]` bool. Returns logits and present K/V."""
        h, present_keys, present_values = self.hidden_concat(input_ids, position_ids, attention_mask,
                                                             past_keys, past_values)
        return self._logits(h), present_keys, present_values

    def hidden_concat(self, input_ids, position_ids, attention_mask, past_keys, past_values,
                      feature_layers: tuple[int, ...] = ()):
        """`forward_concat` up to the last hidden states (before the final norm); with
        `feature_layers`, their features (`Features`) as a fourth result."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq)
        present_keys, present_values = [], []
        features = Features(feature_layers, self.shape.num_layers)
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.model.layers)):
            features.take(i, h)
            q, k, v = self._project_qkv(layer, h, cos, sin)
            keys = torch.cat((past_keys[i], k), dim=2)
            values = torch.cat((past_values[i], v), dim=2)
            present_keys.append(keys)
            present_values.append(values)
            h = self._finish_layer(layer, h, q, keys, values, attention_mask)
        features.take(self.shape.num_layers, h)
        if feature_layers:
            return h, torch.stack(present_keys), torch.stack(present_values), features.joined()
        return h, torch.stack(present_keys), torch.stack(present_values)

    @torch.inference_mode()
    def forward_sequence(self, tokens: torch.Tensor) -> torch.Tensor:
        """One sequence from position 0, no cache kept: logits `[n, vocab]` (for checks)."""
        n, (layers, heads, dim) = len(tokens), self.shape.kv_shape
        empty = torch.zeros(layers, 1, heads, 0, dim, dtype=self.lm_head.weight.dtype)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        return self.forward_concat(tokens[None], torch.arange(n)[None], mask[None], empty, empty)[0][0]

    @torch.inference_mode()
    def forward_packed(self, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past: torch.Tensor,
                       counts: torch.Tensor, mask: torch.Tensor,
                       feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Engine form: a ragged batch over cache slots, as `engines/batching.py` packs it.

        `kv` `[layers, 2, batch, kv_heads, capacity, head_dim]` (the batch's rows of a
        `KVPool`, written in place); `tokens`, `positions` `[batch, n]` right-padded;
        `past`, `counts` `[batch]`: cached entries and new tokens per row; `mask`
        `[batch, n, total]` by cache entry. Returns logits `[batch, n, vocab]` and the
        features of `feature_layers` (`Features`; None without)."""
        total = mask.shape[-1]
        h = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        features = Features(feature_layers, self.shape.num_layers)
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.model.layers)):
            features.take(i, h)
            q, k, v = self._project_qkv(layer, h, cos, sin)
            keys, values = kv[i, 0], kv[i, 1]
            write_cache(keys, values, k, v, past, counts)
            h = self._finish_layer(layer, h, q, keys[:, :, :total], values[:, :, :total], mask)
        features.take(self.shape.num_layers, h)
        return self._logits(h), features.joined()
