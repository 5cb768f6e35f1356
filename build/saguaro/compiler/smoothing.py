"""Activation smoothing for per-token int8 (`w8a8`), after SmoothQuant (Xiao et al., 2023).

A few channels of an LLM's activations run far larger than the rest, the same channels
token after token; quantised per token, they take the int8 range and the other channels
keep a few levels each. Smoothing divides each input channel j of a matmul by a factor
s_j and multiplies the weight's row j by it: the product is unchanged in exact arithmetic,
and the activation's range and the weight's are evened out, s_j = max|X_j|^a / max|W_j|^(1-a).
The division is folded into what produces the activation, so the graph gains no node:
  - the q/k/v projections' input is the input norm's output: its weight is divided;
  - the gate/up projections' input is the post-attention norm's: likewise;
  - the down projection's input is silu(gate) * up: the up projection's rows are divided.
The maxima are measured on the target itself, by the torch reference over a fixed
calibration text (`CALIBRATION_TEXT`) at build time.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from saguaro.runtime.models.checkpoint import build_model, load_tokenizer
from saguaro.runtime.models.llama import LlamaShape

if TYPE_CHECKING:
    from collections.abc import Iterable

    from saguaro.runtime.models.llama import DecoderLayer

MIGRATION = 0.5  # the exponent a: half of each channel's range moves into the weight
# General prose, dialogue and code (none of the benchmarks' prompts): channels that carry
# outliers do so whatever the text, so a few hundred tokens of it find them.
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion about the costs of maintaining the old library building, they agreed to "
    "postpone the renovation and to spend the money on new books and longer opening hours.\n"
    "User: Can you help me plan a three-day trip to the mountains in early spring?\n"
    "Assistant: Of course. On the first day, arrive early and take the short trail along the "
    "river; on the second, climb to the lake while the snow is firm; keep the third for rest.\n"
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    averages = [total / window]\n"
    "    for old, new in zip(values, values[window:]):\n"
    "        total += new - old\n"
    "        averages.append(total / window)\n"
    "    return averages\n"
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. In 1905 Albert "
    "Einstein published four papers; one of them explained the photoelectric effect. Q: What is "
    "12 times 14? A: 168. Q: Which planet is closest to the sun? A: Mercury.\n"
)


def smoothed_state(shape: LlamaShape, state: dict[str, torch.Tensor], checkpoint: Path) -> dict[str, torch.Tensor]:
    """`state` with every layer's q/k/v, gate/up and down projections smoothed (see the
    module docstring); the model computes the same function in exact arithmetic."""
    maxima = activation_maxima(shape, state, checkpoint)
    smoothed = dict(state)
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        attention = [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv"]
        fold_into_norm(smoothed, f"{prefix}.input_layernorm.weight", attention, maxima[f"{layer}.attention"])
        mlp_in = [f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight"]
        fold_into_norm(smoothed, f"{prefix}.post_attention_layernorm.weight", mlp_in, maxima[f"{layer}.mlp"])
        fold_into_up(smoothed, prefix, maxima[f"{layer}.down"])
    return smoothed


def factors(activation_max: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """s_j per input channel j of weights `[out, in]` (Hugging Face layout)."""
    weight_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = activation_max.clamp(min=1e-5) ** MIGRATION / weight_max.clamp(min=1e-5) ** (1 - MIGRATION)
    return s.clamp(min=1e-2, max=1e2)


def fold_into_norm(state: dict, norm: str, weights: list[str], activation_max: torch.Tensor) -> None:
    s = factors(activation_max, [state[name].float() for name in weights])
    state[norm] = (state[norm].float() / s).to(state[norm].dtype)
    for name in weights:
        state[name] = (state[name].float() * s).to(state[name].dtype)


def fold_into_up(state: dict, prefix: str, activation_max: torch.Tensor) -> None:
    up, down = f"{prefix}.mlp.up_proj", f"{prefix}.mlp.down_proj.weight"
    s = factors(activation_max, [state[down].float()])
    state[f"{up}.weight"] = (state[f"{up}.weight"].float() / s[:, None]).to(state[f"{up}.weight"].dtype)
    if f"{up}.bias" in state:
        state[f"{up}.bias"] = (state[f"{up}.bias"].float() / s).to(state[f"{up}.bias"].dtype)
    state[down] = (state[down].float() * s).to(state[down].dtype)


@torch.inference_mode()
def activation_maxima(shape: LlamaShape, state: dict[str, torch.Tensor], checkpoint: Path) -> dict[str, torch.Tensor]:
    """Per input channel, the largest magnitude each smoothed matmul's input reaches over
    the calibration text: `{layer}.attention`, `{layer}.mlp`, `{layer}.down`."""
    model = build_model(shape, {name: tensor.float() for name, tensor in state.items()}, where=str(checkpoint))
    tokens = torch.tensor(load_tokenizer(checkpoint).encode(CALIBRATION_TEXT))[: shape.max_position_embeddings]
    maxima: dict[str, torch.Tensor] = {}

    def record(key: str):
        def hook(module, inputs):
            seen = inputs[0].detach().abs().flatten(0, -2).amax(dim=0).float()
            maxima[key] = torch.maximum(maxima[key], seen) if key in maxima else seen
        return hook

    handles = []
    for index, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):
        handles.append(layer.self_attn.q_proj.register_forward_pre_hook(record(f"{index}.attention")))
        handles.append(layer.mlp.gate_proj.register_forward_pre_hook(record(f"{index}.mlp")))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(record(f"{index}.down")))
    try:
        model.forward_sequence(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return maxima
