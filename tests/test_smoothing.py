"""Activation smoothing for w8a8 (`saguaro.compiler.smoothing`): the smoothed weights
compute the same function, and move an outlier channel's range into the weights so that
per-token int8 loses less."""
import torch
from checkpoints import make_checkpoint

from saguaro.compiler.smoothing import smoothed_state
from saguaro.runtime.models.checkpoint import build_model, llama_shape, read_config, read_state_dict

TOKENS = torch.tensor([5, 9, 14, 3, 22, 7, 11, 6, 18, 4, 30, 2, 41, 17])


def outlier_checkpoint(folder):
    """A random Llama whose norms make two channels 30x the others and whose projections
    read them with weights 30x smaller, as in LLMs: the product is not dominated by the
    outlier, but a row's int8 range is."""
    make_checkpoint(folder, vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, seed=5)
    state = read_state_dict(folder)
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for norm, channel, readers in (("input_layernorm", 5, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                       ("post_attention_layernorm", 7, ("mlp.gate_proj", "mlp.up_proj"))):
            state[f"{prefix}.{norm}.weight"][channel] *= 30
            for reader in readers:
                state[f"{prefix}.{reader}.weight"][:, channel] /= 30
    return llama_shape(read_config(folder)), state


def first_q_input(model) -> torch.Tensor:
    seen = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0]))
    logits = model.forward_sequence(TOKENS)
    handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1]), logits


def per_token_int8_error(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Relative error of x @ weight.T with x quantised per row, weight per output channel."""
    row = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)  # the padding token embeds to zeros
    column = weight.abs().amax(-1, keepdim=True) / 127
    approx = (torch.round(x / row) * row) @ (torch.round(weight / column) * column).T
    exact = x @ weight.T
    return float((approx - exact).abs().max() / exact.abs().max())


def test_smoothing_keeps_the_function_and_evens_out_the_outlier_channels(tmp_path):
    shape, state = outlier_checkpoint(tmp_path)
    smoothed = smoothed_state(shape, state, tmp_path)
    before, after = (build_model(shape, s, where="test") for s in (state, smoothed))
    x_before, logits_before = first_q_input(before)
    x_after, logits_after = first_q_input(after)
    torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4)
    assert x_after.abs().amax(0).max() < x_before.abs().amax(0).max() / 3  # the outlier moved into the weight
    name = "model.layers.0.self_attn.q_proj.weight"
    assert per_token_int8_error(x_after, smoothed[name]) < 0.85 * per_token_int8_error(x_before, state[name])
    assert not torch.equal(smoothed["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])
