"""The EAGLE-3 feature head: the release format (names, config, layer-id conventions), the
refusals of heads that do not fit a target, and the packed form against the concat form."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from saguaro.runtime.models.feature_head import (
    FeatureHead,
    FeatureHeadShape,
    default_feature_layers,
    is_feature_head,
    load_feature_head,
    save_feature_head,
)
from saguaro.runtime.models.llama import UNSCORED, LlamaShape

TARGET = LlamaShape(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                    head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                    tie_word_embeddings=True)
SHAPE = FeatureHeadShape(hidden_size=16, intermediate_size=40, num_heads=4, num_kv_heads=2, head_dim=4,
                         rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=(), max_position_embeddings=128,
                         vocab_size=64, draft_vocab_size=24, feature_layers=(1, 3, 6), target_hidden_size=16)
RELEASE_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d",
}


def random_head(shape: FeatureHeadShape = SHAPE, seed: int = 0) -> FeatureHead:
    torch.manual_seed(seed)
    head = FeatureHead(shape, torch.randn(shape.vocab_size, shape.hidden_size))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
    head.set_vocabulary(torch.randperm(shape.vocab_size)[:shape.draft_vocab_size])
    return head.eval()


def inputs(head: FeatureHead, batch: int, n: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(head.shape.vocab_size, (batch, n), generator=generator)
    hidden = torch.randn(batch, n, head.shape.hidden_size, generator=generator)
    return tokens, hidden


def concat_run(head: FeatureHead, tokens, hidden):
    batch, n = tokens.shape
    _, heads, dim = head.shape.kv_shape
    empty = torch.zeros(1, batch, heads, 0, dim)
    mask = torch.ones(n, n, dtype=torch.bool).tril().expand(batch, n, n)
    with torch.no_grad():
        return head.forward_concat(tokens, hidden, torch.arange(n).expand(batch, n), mask, empty, empty)


def test_saved_head_loads_with_identical_outputs(tmp_path):
    head = random_head()
    save_feature_head(head, tmp_path)
    loaded = load_feature_head(tmp_path, TARGET, head.embed_tokens)
    tokens, hidden = inputs(head, 2, 5)
    for mine, theirs in zip(concat_run(head, tokens, hidden), concat_run(loaded, tokens, hidden)):
        assert torch.equal(mine, theirs)
    assert torch.equal(loaded.output_rows, head.output_rows) and torch.equal(loaded.t2d, head.t2d)
    assert loaded.embed_tokens.data_ptr() == head.embed_tokens.data_ptr()  # shared, not copied


def test_release_key_and_config_names(tmp_path):
    save_feature_head(random_head(), tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == RELEASE_KEYS  # no embedding table by default
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size",
            "tie_word_embeddings", "target_hidden_size"} <= set(config)
    # vLLM's key in the Features convention; SpecForge's and SGLang's (outputs of layers) one less
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 5], "use_aux_hidden_state": True}
    assert is_feature_head(tmp_path)


def test_layer_ids_from_either_convention(tmp_path):
    head = random_head()
    save_feature_head(head, tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    del config["eagle_aux_hidden_state_layer_ids"]  # a SpecForge release: the nested key only
    config_file.write_text(json.dumps(config))
    assert load_feature_head(tmp_path, TARGET, head.embed_tokens).shape.feature_layers == (1, 3, 6)
    assert default_feature_layers(30) == (2, 15, 27) and default_feature_layers(2) == (0, 1, 2)


def edited(tmp_path, head, config_changes=None, state_change=None):
    save_feature_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(config_changes or {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    if state_change:
        state = load_file(str(tmp_path / "model.safetensors"))
        state_change(state)
        save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 4096}, "hidden_size 4096 != target's 16"),
    ({"vocab_size": 65}, "vocab_size 65 != target's 64"),
    ({"target_hidden_size": 32}, "target_hidden_size 32 != target's hidden_size 16"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, r"include \[7\], outside the target's 0..6"),
])
def test_refusals_name_what_differs(tmp_path, changes, message):
    head = random_head()
    with pytest.raises(ValueError, match=message) as error:
        load_feature_head(edited(tmp_path, head, changes), TARGET, head.embed_tokens)
    assert str(tmp_path) in str(error.value)


def test_refusals_name_the_weight(tmp_path):
    head = random_head()
    with pytest.raises(ValueError, match="'midlayer.mlp.up_proj.weight' is missing"):
        load_feature_head(edited(tmp_path, head, state_change=lambda s: s.pop("midlayer.mlp.up_proj.weight")),
                          TARGET, head.embed_tokens)
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \[16, 47\], expected \[16, 48\]"):
        load_feature_head(edited(tmp_path, head, state_change=lambda s: s.update({"fc.weight": torch.zeros(16, 47)})),
                          TARGET, head.embed_tokens)
    with pytest.raises(ValueError, match="'d2t' is missing"):  # a reduced vocabulary needs its map
        load_feature_head(edited(tmp_path, head, state_change=lambda s: s.pop("d2t")), TARGET, head.embed_tokens)


def test_a_plain_checkpoint_is_not_a_head(tmp_path):
    head = random_head()
    save_feature_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    del config["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not is_feature_head(tmp_path)
    with pytest.raises(ValueError, match="not an EAGLE-3 feature head"):
        load_feature_head(tmp_path, TARGET, head.embed_tokens)


def test_full_vocabulary_head_without_maps_is_the_identity(tmp_path):
    head = random_head(dataclasses.replace(SHAPE, draft_vocab_size=64))
    head.set_vocabulary(torch.arange(64))
    edited(tmp_path, head, state_change=lambda s: (s.pop("d2t"), s.pop("t2d")))
    loaded = load_feature_head(tmp_path, TARGET, head.embed_tokens)
    assert torch.equal(loaded.output_rows, torch.arange(64)) and bool(loaded.t2d.all())


def test_logits_unscored_exactly_outside_the_draft_vocabulary():
    head = random_head()
    logits, _, _, _ = concat_run(head, *inputs(head, 2, 4))
    scored = torch.zeros(64, dtype=torch.bool)
    scored[head.target_ids()] = True
    assert torch.equal(scored, head.t2d)
    assert bool((logits[..., ~scored] == UNSCORED).all()) and bool((logits[..., scored] > UNSCORED).all())
    assert logits.dtype == torch.float32 and logits.shape == (2, 4, 64)
    draft = head.draft_logits(concat_run(head, *inputs(head, 2, 4))[1])
    assert torch.equal(logits[..., head.target_ids()], draft)  # row i scores target token i + d2t[i]


def test_packed_equals_concat_and_prefix_then_rest():
    head = random_head()
    tokens, hidden = inputs(head, 2, 7)
    logits, hidden_out, keys, values = concat_run(head, tokens, hidden)
    kv = torch.zeros(1, 2, 2, 2, 16, 4)
    positions = torch.arange(7).expand(2, 7)
    split = 4
    for first, last in ((0, split), (split, 7)):  # a prefix, then the rest, over the same cache
        n = last - first
        mask = (torch.arange(last) <= torch.arange(first, last).unsqueeze(1)).expand(2, n, last)
        step_logits, step_hidden = head.forward_packed(kv, tokens[:, first:last], hidden[:, first:last],
                                                       positions[:, first:last], torch.tensor([first] * 2),
                                                       torch.tensor([n] * 2), mask)
        torch.testing.assert_close(step_logits, logits[:, first:last], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(step_hidden, hidden_out[:, first:last], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[0, 0, :, :, :7], keys[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[0, 1, :, :, :7], values[0], rtol=1e-5, atol=1e-5)


def test_residual_starts_at_the_feature():
    """With attention and MLP outputs zeroed, hidden_out is the feature itself (EAGLE-3's residual)."""
    head = random_head()
    with torch.no_grad():
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    tokens, hidden = inputs(head, 1, 3)
    assert torch.equal(concat_run(head, tokens, hidden)[1], hidden)
