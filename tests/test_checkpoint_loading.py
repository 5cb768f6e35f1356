"""Any local Hugging Face Llama checkpoint runs on the torch engine with Hugging Face's logits."""
import pytest
import torch
from checkpoints import make_checkpoint
from transformers import AutoModelForCausalLM

from saguaro.runtime.engines.torch_engine import TorchEngine

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
VARIANTS = {
    "grouped-query attention": dict(heads=4, kv_heads=2),
    "multi-head attention, tied embeddings": dict(heads=4, kv_heads=4, tie_word_embeddings=True),
    "explicit head_dim": dict(heads=2, kv_heads=1, head_dim=24),
    "linear RoPE scaling": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3 RoPE scaling": dict(rope_parameters=LLAMA3_ROPE),
    "sharded safetensors": dict(layers=3, max_shard_size="40KB"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_engine_matches_hugging_face(tmp_path, variant):
    folder = make_checkpoint(tmp_path / "m", vocab_size=64, hidden=48, max_positions=128, seed=4,
                             **VARIANTS[variant])
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids.unsqueeze(0)).logits[0]
    engine = TorchEngine(folder)
    cache = engine.new_cache(80)
    got = torch.cat([engine.forward(cache, ids[:50], torch.arange(50)),   # prefill, then decode
                     *[engine.forward(cache, ids[i:i + 1], torch.tensor([i])) for i in range(50, 70)]])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
