"""`make_models.py --draft-for`: a draft pruned from a target and distilled on its generations,
with a reduced output vocabulary that keeps speculative decoding exact."""
import dataclasses
import json
import re

import pytest
import torch
from checkpoints import build_engines_cli
from transformers import AutoModelForCausalLM

from saguaro.modelmaker.draft_for import PRESETS, kept_layers, make_draft_for, output_vocabulary, target_generations
from saguaro.modelmaker.draft_prompts import HELD_OUT_SUBJECTS, SUBJECTS, prompt_set, text_windows
from saguaro.modelmaker.draft_training import Sequence
from saguaro.modelmaker.train import TrainSettings
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import UNSCORED, SamplingParams
from saguaro.runtime.models.checkpoint import DRAFT_REPORT, acceptance_by_depth, load_tokenizer
from saguaro.runtime.models.prompts import CHAT_PROMPTS
from saguaro.runtime.pipeline import Pipeline

TINY = dataclasses.replace(PRESETS["quick"], num_layers=1, output_vocab=160, train_prompts=12, held_out_prompts=4,
                           new_tokens=12, generation_batch=6,
                           train=TrainSettings(steps=6, batch_size=4, seq_len=0, lr=1e-3, warmup_steps=1))


@pytest.fixture(scope="module")
def draft(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "draft"
    report = make_draft_for(tiny_pair / "target", out, TINY, progress=False)
    return out, report


def test_layers_and_output_vocabulary():
    assert kept_layers(30, 4) == [0, 1, 2, 29] and kept_layers(2, 1) == [1]
    with pytest.raises(ValueError, match="1 to 30"):
        kept_layers(30, 31)
    sequences = [Sequence([5, 6, 7, 7, 9], start=2)]
    vocab = output_vocabulary(sequences, 4, vocab_size=20, always=(1,))
    assert vocab.tolist() == [1, 5, 7, 9]  # the EOS, then outputs by frequency, then prompt tokens


def test_text_windows_are_drawn_by_length_and_questions_spread_over_many_subjects():
    """A short topic is not drawn as often as a long one (its windows would overlap, the
    target's same answer learnt several times over), and each subject is asked about a few
    times, not a dozen; no held-out subject is a training one."""
    short, long = "short " * 100, "long " * 2000
    windows = text_windows([short, long], count=200, seed=0)
    assert sum(window.startswith("long") for window in windows) > 0.9 * len(windows)
    assert len(SUBJECTS) >= 400 and not set(SUBJECTS) & set(HELD_OUT_SUBJECTS)
    asked = [p.text for p in prompt_set(1536, 0.75, held_out=False, seed=0) if p.chat]
    assert max(sum(subject in text for text in asked) for subject in ("black holes", "dogs", "chess")) <= 8


def test_training_subjects_leave_out_the_benchmarks_questions():
    """bench.py --chat measures drafts on CHAT_PROMPTS: no training subject is theirs."""
    topics = {"France": r"France|Paris", "rainbow": r"rainbows?", "the sea": r"seas?\b|oceans?",
              "Python": r"Python", "the sky": r"sky\b", "prime number": r"prime numbers?", "a cat": r"cats?\b",
              "vaccines": r"vaccines?"}
    for topic, pattern in topics.items():
        assert any(topic in question for question in CHAT_PROMPTS), topic  # the benchmark's own
        assert not [s for s in SUBJECTS if re.search(rf"\b({pattern})", s, re.IGNORECASE)], topic


def test_target_generations_record_the_targets_top_tokens(tiny_pair):
    """Greedy answers: the target's top token at every position is the token it produced."""
    target = AutoModelForCausalLM.from_pretrained(tiny_pair / "target").eval()
    tokenizer = load_tokenizer(tiny_pair / "target")
    prompts = prompt_set(5, 0.0, held_out=True, seed=0)
    sequences = target_generations(target, tokenizer, prompts, 10, 3, (tokenizer.eos_token_id,), 4, progress=False)
    assert len(sequences) == 5
    for s in sequences:
        assert s.ids[:s.start] == tokenizer.encode(prompts[sequences.index(s)].text)
        assert s.top_ids[:, 0].tolist() == s.continuation and s.top_ids.shape == (len(s.continuation), 4)
        assert torch.all(s.top_logprobs[:, :-1] >= s.top_logprobs[:, 1:])


def test_draft_report_and_files(draft, tiny_pair):
    out, report = draft
    assert json.loads((out / DRAFT_REPORT).read_text()) == json.loads(json.dumps(report))
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["saguaro_output_vocab"] == 160
    assert (out / "tokenizer.json").read_text() == (tiny_pair / "target" / "tokenizer.json").read_text()
    assert report["decode_weights"]["draft"] < report["decode_weights"]["target"]
    acceptance = report["acceptance"]
    assert acceptance["k"] == 4 and 0.0 <= acceptance["agreement"] <= 1.0 and acceptance["tokens_scored"] > 0
    assert report["loss"]["final"] < report["loss"]["first"]


def test_tokens_outside_the_output_vocabulary_get_probability_zero(draft, tiny_pair):
    out, _ = draft
    pipeline = Pipeline.load(tiny_pair / "target", out)
    cache = pipeline.draft.new_cache(16)
    ids = torch.tensor(pipeline.encode("The with statement"))
    logits = pipeline.draft.forward(cache, ids, torch.arange(len(ids)))
    scored = pipeline.draft.model.output_rows < 160
    assert int(scored.sum()) == 160
    assert torch.all(logits[:, ~scored] == UNSCORED) and torch.all(logits[:, scored] > UNSCORED)
    assert torch.all(torch.softmax(logits, -1)[:, ~scored] == 0)


@pytest.mark.parametrize("engines", ["torch", "onnxruntime"])
def test_speculative_decoding_with_the_draft_is_exact(draft, tiny_pair, tmp_path, engines):
    out, _ = draft
    if engines == "torch":
        pipeline = Pipeline.load(tiny_pair / "target", out)
    else:
        (tmp_path / "pair").mkdir()
        (tmp_path / "pair" / "target").symlink_to(tiny_pair / "target")
        (tmp_path / "pair" / "draft").symlink_to(out)
        pipeline = Pipeline.load(engines=build_engines_cli(tmp_path / "pair", tmp_path / "engines"))
    # the acceptance the report measured travels with the draft (the load policy starts from it)
    histogram = json.loads((out / DRAFT_REPORT).read_text())["acceptance"]["accepted_histogram"]
    assert pipeline.draft.info.acceptance == pytest.approx(acceptance_by_depth(histogram))
    assert len(pipeline.draft.info.acceptance) >= 1
    for prompt in ("The with statement", "A class definition", "Exceptions are"):
        ids = pipeline.encode(prompt)
        expected = pipeline.generate(ids, DecodeOptions(mode="autoregressive", max_tokens=24), SamplingParams())
        for mode in ("speculative", "ssd"):
            got = pipeline.generate(ids, DecodeOptions(mode=mode, max_tokens=24), SamplingParams())
            assert got.output_ids == expected.output_ids, (engines, mode, prompt)
