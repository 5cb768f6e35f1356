"""Llama-family architectures beyond Llama (Qwen2's q/k/v biases, Qwen3's per-head q/k norm,
Mistral's sliding window, Llama's own biases) against transformers' logits, through the
torch engine and through built ONNX Runtime engines; other model types refused by name."""
import json

import pytest
import torch
from checkpoints import make_architecture_checkpoint
from transformers import AutoModelForCausalLM

from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import BuildConfig, ConfigError
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.models.checkpoint import CheckpointError, load_checkpoint

ARCHITECTURES = {
    "qwen2 (q/k/v biases)": ("qwen2", {}),
    "qwen3 (q/k norm, head_dim 16)": ("qwen3", dict(head_dim=16)),
    "qwen3 with attention_bias": ("qwen3", dict(head_dim=16, attention_bias=True)),
    "mistral (sliding window 96)": ("mistral", dict(sliding_window=96)),
    "llama with attention_bias and mlp_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
}
IDS = torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = ARCHITECTURES[request.param]
    folder = make_architecture_checkpoint(tmp_path_factory.mktemp(model_type) / "m", model_type, **overrides)
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(folder).eval()(IDS.unsqueeze(0)).logits[0]
    return folder, reference


def prefill_then_decode(engine, prefill: int = 40) -> torch.Tensor:
    cache = engine.new_cache(len(IDS) + 1)
    rows = [engine.forward(cache, IDS[:prefill], torch.arange(prefill))]
    rows += [engine.forward(cache, IDS[i:i + 1], torch.tensor([i])) for i in range(prefill, len(IDS))]
    return torch.cat(rows)


def test_torch_engine_matches_transformers(checkpoint):
    folder, reference = checkpoint
    got = prefill_then_decode(TorchEngine(folder))
    assert torch.allclose(got, reference, atol=1e-4), (got - reference).abs().max()


def test_switches_matter(checkpoint):
    """The same weights without the architecture's switch give other logits (a Mistral has
    none: within its window it is a Llama)."""
    folder, reference = checkpoint
    loaded = load_checkpoint(folder).model
    shape = loaded.shape
    if shape.model_type == "mistral":
        assert not (shape.qkv_bias or shape.o_bias or shape.mlp_bias or shape.qk_norm)
        return
    with torch.no_grad():
        for layer in loaded.model.layers:
            attention = layer.self_attn
            for module in (attention.q_proj, attention.o_proj, layer.mlp.up_proj):
                if module.bias is not None:
                    module.bias.zero_()
            if loaded.shape.qk_norm:
                attention.q_norm.weight.fill_(1.0)
    plain = loaded.forward_sequence(IDS)
    assert (plain - reference).abs().max() > 1e-2


def test_onnxruntime_engines_match_transformers(checkpoint, tmp_path):
    folder, reference = checkpoint
    config = BuildConfig(name="arch", target=folder, draft=folder, max_context=96, max_draft_tokens=4, max_branches=4)
    build_engines(config, tmp_path / "engines", show_progress=False)
    target, draft = load_engine_pair(tmp_path / "engines")
    for engine in (target, draft):
        got = prefill_then_decode(engine)
        assert torch.allclose(got, reference, atol=1e-4), (got - reference).abs().max()


def test_sliding_window_becomes_the_context_limit(tmp_path):
    folder = make_architecture_checkpoint(tmp_path / "m", "mistral", sliding_window=32)
    assert TorchEngine(folder).info.max_context == 32
    with pytest.raises(ConfigError, match="max_context=96 is beyond the target model's max_position_embeddings 32"):
        build_engines(BuildConfig(name="w", target=folder, draft=folder, max_context=96), tmp_path / "e",
                      show_progress=False)


def test_other_model_types_are_refused_by_name(tmp_path):
    folder = make_architecture_checkpoint(tmp_path / "m", "qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    with pytest.raises(CheckpointError, match=r"model_type 'qwen3_moe' is not supported \(supported: llama, "
                                              r"mistral, qwen2, qwen3\)"):
        TorchEngine(folder)
