"""An EAGLE-3 feature head: a one-layer draft that reads the target's hidden states.

The head drafts from what the target already computed. For the token at position p it
takes the token's embedding (the target's own table, shared, not a copy) and a feature
of position p - 1: the target's hidden states at a few layers (`Features`), joined and
projected by `fc`, or, when it drafts on its own guesses, its own `hidden_out` at p - 1.
One decoder layer whose q/k/v read `[input_layernorm(embedding) ; hidden_norm(feature)]`
(2 x hidden wide) turns that into `hidden_out` for p, and `norm` + `lm_head` score the
token at p + 1 over a reduced draft vocabulary. The residual stream starts at the
feature itself (before `hidden_norm`), so `hidden_out = feature + attention + MLP`.

The parameter names, buffers and config keys are those of the published EAGLE-3 heads
(EAGLE's reference code, SpecForge, vLLM, SGLang): `fc`, `midlayer.{hidden_norm,
input_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
post_attention_layernorm}`, `norm`, `lm_head`, and the vocabulary maps `d2t` (draft row i
scores target token `i + d2t[i]`) and `t2d` (the target tokens the head can propose). A
released head therefore loads as it is (`load_feature_head`), and a head trained here
(`saguaro.modelmaker.feature_draft`) is a release-format folder (`save_feature_head`).

Which target layers a head reads, and the two conventions the releases use for them:

- here (`llama.Features`): layer i is the hidden state ENTERING decoder layer i (0 is the
  embedding output, `num_layers` the last layer's output before the final norm);
- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` in this same convention
  (it collects `hidden + residual` before layer id); its default for an L-layer target
  is (2, L // 2, L - 3);
- SpecForge and SGLang read `eagle_config.eagle_aux_hidden_state_layer_ids` as the
  OUTPUT of decoder layer id (SpecForge hooks `layers[id]`'s output, SGLang captures
  before layer id + 1), one less: their default (1, L // 2 - 1, L - 4) is the same states.

`save_feature_head` writes both keys, each in its own convention; `load_feature_head`
takes the top-level one as it is, else the nested one plus one, else vLLM's default.

Logits: `forward_packed` / `forward_concat` return float32 logits over the TARGET
vocabulary with `UNSCORED` outside the draft vocabulary, so such tokens get probability
exactly 0 and speculative decoding stays lossless; `draft_logits` is the unpadded form
that training losses use.

Positions: a head's attention is over its own cache. The first token of a sequence has no
feature before it, so the heads here (and the published ones) are trained on the tokens
from position 1 on: a runtime feeds the token at position p >= 1 with the feature of p - 1
and keeps the head's cache entry p - 1 for it. RoPE sees only differences of positions, so
passing p or p - 1 as the position gives the same result.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from saguaro.runtime.models.checkpoint import CheckpointError, llama_shape, read_state_dict
from saguaro.runtime.models.llama import (
    MLP,
    UNSCORED,
    LlamaShape,
    RMSNorm,
    apply_rope,
    attend,
    rope_cos_sin,
    rope_inverse_frequencies,
    write_cache,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
EMBEDDING_KEY = "embed_tokens.weight"
VOCABULARY_KEYS = ("d2t", "t2d")


@dataclass(frozen=True)
class FeatureHeadShape:
    """The numbers of a feature head; `vocab_size` is the target's, `feature_layers` in
    the `llama.Features` convention, `target_hidden_size` the width of one feature layer."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    target_hidden_size: int
    # Some releases (vLLM speculators' `norm_before_residual`) start the residual stream at
    # hidden_norm(feature) instead of the feature; False is EAGLE-3's own form.
    norm_before_residual: bool = False

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """Cache entry shape without the sequence axis: (layers, kv heads, head dim)."""
        return 1, self.num_kv_heads, self.head_dim

    @property
    def feature_width(self) -> int:
        return len(self.feature_layers) * self.target_hidden_size

    def layer_shape(self) -> LlamaShape:
        """The decoder layer's numbers as a `LlamaShape` (for `MLP` and the RoPE tables)."""
        return LlamaShape(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                          intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                          rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
                          tie_word_embeddings=False, rope_scaling=self.rope_scaling)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice for an L-layer target, (2, L // 2, L - 3), clamped to 0..L and sorted."""
    return tuple(sorted(min(max(layer, 0), num_layers) for layer in (2, num_layers // 2, num_layers - 3)))


class HeadAttention(nn.Module):
    """q/k/v read the embedding and the feature side by side: 2 x hidden wide."""

    def __init__(self, shape: FeatureHeadShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.q_proj = nn.Linear(2 * h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)


class MidLayer(nn.Module):
    def __init__(self, shape: FeatureHeadShape):
        super().__init__()
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = HeadAttention(shape)
        self.mlp = MLP(shape.layer_shape())
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class FeatureHead(nn.Module):
    d2t: torch.Tensor  # buffers (registered in __init__)
    t2d: torch.Tensor
    output_rows: torch.Tensor

    def __init__(self, shape: FeatureHeadShape, embed_tokens: torch.Tensor):
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(shape.feature_width, shape.hidden_size, bias=False)
        self.midlayer = MidLayer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(shape.vocab_size, dtype=torch.bool))
        # For every target token: its lm_head row, or `draft_vocab_size` (an UNSCORED column
        # appended to the logits); derived from d2t, so not saved
        self.register_buffer("output_rows", torch.zeros(shape.vocab_size, dtype=torch.int64), persistent=False)
        self.set_vocabulary(torch.arange(min(shape.draft_vocab_size, shape.vocab_size)))
        # The target's table, shared: a plain tensor, neither a parameter nor in the state dict
        self.embed_tokens = embed_tokens.detach()
        self.inv_freq = rope_inverse_frequencies(shape.layer_shape())

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The target token each lm_head row scores (`draft_vocab_size` distinct ids)."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.int64)
        rows = len(target_ids)
        if rows != self.shape.draft_vocab_size or len(set(target_ids.tolist())) != rows:
            raise ValueError(f"a draft vocabulary is {self.shape.draft_vocab_size} distinct target ids, "
                             f"got {rows} ({len(set(target_ids.tolist()))} distinct)")
        self.d2t.copy_(target_ids - torch.arange(rows))
        self.t2d.zero_()
        self.t2d[target_ids] = True
        self.output_rows.fill_(rows)
        self.output_rows[target_ids] = torch.arange(rows)

    def target_ids(self) -> torch.Tensor:
        """The target token of each lm_head row."""
        return torch.arange(self.shape.draft_vocab_size) + self.d2t

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's joined features `[.., feature_width]` -> the head's `[.., hidden]`."""
        return self.fc(features.to(self.fc.weight.dtype))

    def draft_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """lm_head rows only: `[.., draft_vocab_size]` float32 (what training losses use)."""
        return self.lm_head(self.norm(hidden_out)).float()

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Over the target vocabulary, `UNSCORED` where the head has no row."""
        padded = F.pad(self.draft_logits(hidden_out), (0, 1), value=UNSCORED)
        return padded[..., self.output_rows]  # a Gather: [.., vocab_size]

    # The layer, in the pieces both forms (and training's unrolled steps) share.

    def layer_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k/v input `[embedding ; feature]` (each normed) and the residual stream."""
        layer = self.midlayer
        embeds = layer.input_layernorm(F.embedding(tokens, self.embed_tokens).to(hidden.dtype))
        normed = layer.hidden_norm(hidden)
        residual = normed if self.shape.norm_before_residual else hidden
        return torch.cat((embeds, normed), dim=-1), residual

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        batch, n, _ = x.shape
        attn, d = self.midlayer.self_attn, self.shape.head_dim
        q = attn.q_proj(x).view(batch, n, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(batch, n, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(batch, n, -1, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish_layer(self, residual, q, keys, values, mask) -> torch.Tensor:
        batch, n, _ = residual.shape
        layer = self.midlayer
        out = attend(q, keys, values, mask).transpose(1, 2).reshape(batch, n, -1)
        h = residual + layer.self_attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.inference_mode()
    def forward_packed(self, kv: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       past: torch.Tensor, counts: torch.Tensor, mask: torch.Tensor):
        """Engine form, as `Llama.forward_packed`: `kv` `[1, 2, batch, kv_heads, capacity,
        head_dim]` written in place; `tokens`, `positions` `[batch, n]` right-padded;
        `hidden` `[batch, n, hidden]` (for the token at p, the feature of p - 1); `past`,
        `counts` `[batch]`; `mask` `[batch, n, total]` by cache entry. Returns logits
        `[batch, n, vocab_size]` (row p predicts token p + 1) and `hidden_out` `[batch, n, hidden]`."""
        total = mask.shape[-1]
        x, residual = self.layer_inputs(tokens, hidden)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        q, k, v = self.project_qkv(x, cos, sin)
        keys, values = kv[0, 0], kv[0, 1]
        write_cache(keys, values, k, v, past, counts)
        hidden_out = self.finish_layer(residual, q, keys[:, :, :total], values[:, :, :total], mask)
        return self.logits(hidden_out), hidden_out

    def forward_concat(self, input_ids, hidden, position_ids, attention_mask, past_keys, past_values):
        """Export and training form, as `Llama.forward_concat`: `past_*` `[1, batch,
        kv_heads, past, head_dim]`, `attention_mask` `[batch, n, past + n]` bool. Returns
        logits, hidden_out, present keys and values."""
        x, residual = self.layer_inputs(input_ids, hidden)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq)
        q, k, v = self.project_qkv(x, cos, sin)
        keys = torch.cat((past_keys[0], k), dim=2)
        values = torch.cat((past_values[0], v), dim=2)
        hidden_out = self.finish_layer(residual, q, keys, values, attention_mask)
        return self.logits(hidden_out), hidden_out, keys[None], values[None]


# The release format: config.json and model.safetensors.

def head_config(head: FeatureHead) -> dict:
    s = head.shape
    config = {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "hidden_act": "silu", "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_position_embeddings,
        "vocab_size": s.vocab_size, "draft_vocab_size": s.draft_vocab_size,
        "num_hidden_layers": 1, "tie_word_embeddings": False, "target_hidden_size": s.target_hidden_size,
        # vLLM's key, in its convention (= llama.Features); SpecForge's and SGLang's, one less
        "eagle_aux_hidden_state_layer_ids": list(s.feature_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in s.feature_layers],
                         "use_aux_hidden_state": True},
    }
    if s.rope_scaling:
        config["rope_scaling"] = dict(s.rope_scaling)
    if s.norm_before_residual:
        config["norm_before_residual"] = True
    return config


def save_feature_head(head: FeatureHead, out_dir: str | Path, with_embeddings: bool = False) -> None:
    """Write `head` as a release-format folder (config.json, model.safetensors); the
    shared embedding table only with `with_embeddings` (releases mostly leave it out)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(head_config(head), indent=2) + "\n")
    state = {name: tensor.contiguous() for name, tensor in head.state_dict().items()}
    if with_embeddings:
        state[EMBEDDING_KEY] = head.embed_tokens.contiguous()
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def is_feature_head(path: str | Path) -> bool:
    """Whether the folder's config names an EAGLE-3 architecture or carries an eagle_config."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    names = config.get("architectures") or []
    return "eagle_config" in config or any("eagle3" in str(name).lower() for name in names)


def load_feature_head(path: str | Path, target_shape: LlamaShape, embed_tokens: torch.Tensor) -> FeatureHead:
    """A release-format head for a target of `target_shape`, sharing its `embed_tokens`.
    Refuses (ValueError naming the folder and what differs) a head that does not fit."""
    path = Path(path)
    if not is_feature_head(path):
        raise ValueError(f"{str(path)!r} is not an EAGLE-3 feature head (its config.json names no "
                         f"Eagle3 architecture and has no eagle_config)")
    config = json.loads((path / "config.json").read_text())
    shape = head_shape(config, target_shape, str(path))
    state = read_state_dict(path)  # a CheckpointError (a ValueError) names a folder without weights
    own_embeddings = state.pop(EMBEDDING_KEY, None)
    embeddings = embedding_table(own_embeddings, shape, target_shape, embed_tokens, str(path))
    head = FeatureHead(shape, embeddings)
    check_weights(head, state, str(path))
    head.load_state_dict({**head.state_dict(), **state}, strict=True)
    head.set_vocabulary(head.target_ids())  # t2d and the output rows follow d2t
    return head.eval()


def head_shape(config: dict, target: LlamaShape, where: str) -> FeatureHeadShape:
    try:
        layer = llama_shape({**config, "model_type": "llama"}, where)
    except (CheckpointError, KeyError) as error:
        raise ValueError(f"{where}: not a readable head config ({error})") from error
    draft_vocab = int(config.get("draft_vocab_size") or layer.vocab_size)
    shape = FeatureHeadShape(
        hidden_size=layer.hidden_size, intermediate_size=layer.intermediate_size, num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, rms_norm_eps=layer.rms_norm_eps,
        rope_theta=layer.rope_theta, rope_scaling=layer.rope_scaling,
        max_position_embeddings=layer.max_position_embeddings, vocab_size=layer.vocab_size,
        draft_vocab_size=draft_vocab, feature_layers=feature_layers_of(config, target.num_layers),
        target_hidden_size=int(config.get("target_hidden_size") or layer.hidden_size),
        norm_before_residual=bool(config.get("norm_before_residual", False)))
    check_fits(shape, target, where)
    return shape


def feature_layers_of(config: dict, num_layers: int) -> tuple[int, ...]:
    """In the `Features` convention: vLLM's top-level key as it is, else SpecForge's nested
    one plus one, else vLLM's default for the target."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(layer) for layer in config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(layer) + 1 for layer in nested)
    return default_feature_layers(num_layers)


def check_fits(shape: FeatureHeadShape, target: LlamaShape, where: str) -> None:
    if shape.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: vocab_size {shape.vocab_size} != target's {target.vocab_size}")
    if shape.target_hidden_size != target.hidden_size:
        raise ValueError(f"{where}: target_hidden_size {shape.target_hidden_size} != target's hidden_size "
                         f"{target.hidden_size} (the width of the features it reads)")
    outside = [layer for layer in shape.feature_layers if not 0 <= layer <= target.num_layers]
    if outside:
        raise ValueError(f"{where}: feature layers {list(shape.feature_layers)} (hidden states entering "
                         f"those layers) include {outside}, outside the target's 0..{target.num_layers}")
    if not 0 < shape.draft_vocab_size <= shape.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {shape.draft_vocab_size} is not within 1..{shape.vocab_size}")


def embedding_table(own: torch.Tensor | None, shape: FeatureHeadShape, target: LlamaShape,
                    embed_tokens: torch.Tensor, where: str) -> torch.Tensor:
    """The target's table, unless the head's hidden size differs and it brings its own."""
    if shape.hidden_size == target.hidden_size:
        return embed_tokens
    if own is not None and tuple(own.shape) == (shape.vocab_size, shape.hidden_size):
        return own
    raise ValueError(f"{where}: hidden_size {shape.hidden_size} != target's {target.hidden_size}, and the head "
                     f"has no {EMBEDDING_KEY} of its own [{shape.vocab_size}, {shape.hidden_size}]")


def check_weights(head: FeatureHead, state: dict[str, torch.Tensor], where: str) -> None:
    """Every parameter present with its shape; d2t/t2d may be left out only by a head
    that scores the whole vocabulary (then the identity map)."""
    expected = head.state_dict()
    for name, tensor in expected.items():
        if name not in state:
            if name in VOCABULARY_KEYS and head.shape.draft_vocab_size == head.shape.vocab_size:
                continue
            raise ValueError(f"{where}: weight {name!r} is missing")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{where}: weight {name!r} has shape {list(state[name].shape)}, "
                             f"expected {list(tensor.shape)}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{where}: unexpected weights {unexpected[:3]}")
