"""The model pair maker: corpus split, tokenizer, deterministic training, acceptance
figures, the saved tiny pair (the session fixture `tiny_pair`) and the CLI."""

import json
import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from saguaro.modelmaker.acceptance import accepted_lengths, held_out_prompts, summarize
from saguaro.modelmaker.corpus import load_corpus, load_topics, split_by_topic
from saguaro.modelmaker.model_pair import PRESETS
from saguaro.modelmaker.tokenizer import SPECIAL_TOKENS, train_tokenizer
from saguaro.modelmaker.train import (
    TrainSettings,
    distill_draft,
    encode_documents,
    fit,
    llama_config,
    new_model,
    target_continuations,
    train_target,
    warmup_cosine,
)

TINY = PRESETS["tiny"]
FEW_STEPS = TrainSettings(steps=3, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1)
TRICKY_TEXTS = [
    "naïve – 東京",
    "def f(x):\n\treturn x  # two  spaces, a tab\n\n",
    "  leading spaces, trailing newline\n",
    "emoji 🐍 and ÅÄÖ, ümlaut, ß, ½ — «quotes»",
    "spaces before marks: a , b . c ! d ? it 's , do n't",  # what "clean-up" would rewrite
]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(corpus.train_texts(), TINY.vocab_size)


@pytest.fixture(scope="module")
def stream(tokenizer, corpus):
    return encode_documents(tokenizer, corpus.train_texts()[:10])


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- corpus and tokenizer ---------------------------------------------------------------


def test_split_holds_out_every_tenth_topic_and_nothing_else():
    topics = load_topics()
    split = split_by_topic(topics)
    names = sorted(topics)
    assert list(split.held_out) == names[9::10]
    assert set(split.train).isdisjoint(split.held_out)
    assert set(split.train) | set(split.held_out) == set(names)


def test_tokenizer_round_trips_text(tokenizer):
    for text in TRICKY_TEXTS:
        plain = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(plain) == text
        with_bos = tokenizer(text)["input_ids"]
        assert with_bos == [tokenizer.bos_token_id] + plain
        assert tokenizer.decode(with_bos, skip_special_tokens=True) == text
        assert tokenizer.unk_token_id not in plain


def test_tokenizer_has_the_special_tokens_and_vocab_size(tokenizer):
    assert len(tokenizer) == TINY.vocab_size
    specials = ("bos", "eos", "unk", "pad")
    assert [getattr(tokenizer, f"{name}_token") for name in specials] == list(SPECIAL_TOKENS)
    assert [getattr(tokenizer, f"{name}_token_id") for name in specials] == [0, 1, 2, 3]


def test_tokenizer_survives_save_and_auto_load(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 3)
    for text in TRICKY_TEXTS:
        ids = loaded(text)["input_ids"]
        assert ids == tokenizer(text)["input_ids"]
        assert loaded.decode(ids, skip_special_tokens=True) == text


def test_documents_are_wrapped_in_bos_and_eos(tokenizer):
    stream = encode_documents(tokenizer, ["ab", "cd"]).tolist()
    ab, cd = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "cd"))
    assert stream == [0, *ab, 1, 0, *cd, 1]


# --- deterministic training -----------------------------------------------------------


def test_target_training_is_deterministic_per_seed(tokenizer, stream):
    config = llama_config(TINY.target, tokenizer, TINY.max_positions)
    first, first_losses = train_target(config, stream, FEW_STEPS, seed=0, progress=False)
    again, again_losses = train_target(config, stream, FEW_STEPS, seed=0, progress=False)
    other, _ = train_target(config, stream, FEW_STEPS, seed=1, progress=False)
    assert same_weights(first, again) and first_losses == again_losses
    assert not same_weights(first, other)
    assert not same_weights(first, new_model(config, seed=0))  # the steps did train


def test_draft_distillation_is_deterministic_per_seed(tokenizer, stream):
    target, _ = train_target(
        llama_config(TINY.target, tokenizer, TINY.max_positions), stream, FEW_STEPS, 0, False
    )
    settings = replace(TINY.draft_training, train=FEW_STEPS, pool_size=6, prompt_len=8)
    pool = target_continuations(target, stream, settings, seed=0)
    assert pool.shape == (6, FEW_STEPS.seq_len)
    assert torch.equal(pool, target_continuations(target, stream, settings, seed=0))

    config = llama_config(TINY.draft, tokenizer, TINY.max_positions)
    first, _ = distill_draft(config, target, stream, pool, settings, seed=0, progress=False)
    again, _ = distill_draft(config, target, stream, pool, settings, seed=0, progress=False)
    other, _ = distill_draft(config, target, stream, pool, settings, seed=1, progress=False)
    assert same_weights(first, again)
    assert not same_weights(first, other)


# --- acceptance -------------------------------------------------------------------------


def slow_steps(model: torch.nn.Module, seconds: float):
    """A loss whose every step takes `seconds`."""
    def batch_loss() -> torch.Tensor:
        time.sleep(seconds)
        return model(torch.ones(1, 2)).sum()
    return batch_loss


def test_training_with_a_deadline_takes_the_steps_that_fit_and_ends_its_decay_there():
    model, settings = torch.nn.Linear(2, 1), TrainSettings(steps=400, batch_size=1, seq_len=0, lr=1e-2, warmup_steps=5)
    started = time.monotonic()
    losses = fit(model, settings, slow_steps(model, 0.005), False, "test", deadline=started + 0.5)
    elapsed = time.monotonic() - started
    assert 20 < len(losses) < 400 and elapsed < 0.7  # about 0.5 s of 5 ms steps, not 2 s of 400
    assert len(fit(model, settings, slow_steps(model, 0.0), False, "test")) == 400  # no deadline: every step
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = warmup_cosine(optimizer, settings, total=lambda: len(losses))
    for _ in range(len(losses)):
        optimizer.step()  # no gradients, nothing moves: the order torch expects of a schedule
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(settings.min_lr_ratio)  # decayed at the cut


def test_accepted_lengths_replay_greedy_rounds():
    T, F = True, False
    # Round at 0 accepts 2 (then the bonus at 2); at 3 all 4; at 8 none; at 9 the path
    # ends after 2 matches, which does not decide the round, so it is not counted.
    assert accepted_lengths([T, T, F, T, T, T, T, T, F, T, T], k=4) == [2, 4, 0]
    assert accepted_lengths([F, F, F], k=4) == [0, 0, 0]
    assert accepted_lengths([T, T, T, T, T, T, T], k=2) == [2, 2]


def test_summary_counts_agreement_and_histogram():
    report = summarize([[True, True, False, True], [False]], k=2, prompt_tokens=4, new_tokens=4)
    assert report["agreement"] == pytest.approx(3 / 5)
    # Rounds: [2 (bonus at 2), then T at 3 ends undecided] and [0].
    assert report["accepted_histogram"] == [0.5, 0.0, 0.5]
    assert report["mean_accepted"] == pytest.approx(1.0)


def test_held_out_prompts_start_with_each_topic_opening(tokenizer, corpus):
    texts = corpus.held_out_texts()
    prompts = held_out_prompts(tokenizer, texts, prompt_tokens=16, max_prompts=len(texts) + 2)
    assert prompts.shape == (len(texts) + 2, 16)
    for row, text in zip(prompts, texts):
        assert row.tolist() == tokenizer.encode(text)[:16]


# --- the saved tiny pair ----------------------------------------------------------------


def test_pair_loads_from_both_folders(tiny_pair):
    for name in ("target", "draft"):
        folder = tiny_pair / name
        assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = model.config
        assert config.vocab_size == len(tokenizer) == TINY.vocab_size
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
            tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        ids = tokenizer("naïve – 東京", return_tensors="pt")["input_ids"]
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_target_and_draft_share_one_tokenizer(tiny_pair):
    target, draft = tiny_pair / "target", tiny_pair / "draft"
    files = sorted(p.name for p in target.iterdir() if "token" in p.name)
    assert "tokenizer.json" in files
    assert files == sorted(p.name for p in draft.iterdir() if "token" in p.name)
    for name in files:
        assert (target / name).read_bytes() == (draft / name).read_bytes()
    assert AutoTokenizer.from_pretrained(target).get_vocab() == AutoTokenizer.from_pretrained(
        draft
    ).get_vocab()


def test_draft_is_much_smaller_and_target_uses_grouped_query_attention(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair / "target")
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair / "draft")
    target_params = sum(p.numel() for p in target.parameters())
    draft_params = sum(p.numel() for p in draft.parameters())
    assert draft_params * 3 < target_params
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    report = json.loads((tiny_pair / "pair.json").read_text())
    assert report["params"] == {
        "target": target_params,
        "draft": draft_params,
        "ratio": round(target_params / draft_params, 2),
    }


def test_pair_report_has_acceptance_figures(tiny_pair):
    report = json.loads((tiny_pair / "pair.json").read_text())
    assert (report["size"], report["seed"]) == ("tiny", 0)
    acceptance = report["acceptance"]
    k = acceptance["k"]
    assert k == 4 and acceptance["tokens_scored"] > 0 and acceptance["rounds"] > 0
    assert 0.0 <= acceptance["agreement"] <= 1.0
    assert all(0.0 <= share <= 1.0 for share in acceptance["accepted_histogram"])
    assert len(acceptance["accepted_histogram"]) == k + 1
    assert sum(acceptance["accepted_histogram"]) == pytest.approx(1.0)
    assert 0.0 <= acceptance["mean_accepted"] / k <= 1.0
    mean_from_histogram = sum(a * s for a, s in enumerate(acceptance["accepted_histogram"]))
    assert acceptance["mean_accepted"] == pytest.approx(mean_from_histogram)
    for model in ("target", "draft"):
        losses = report["losses"][model]
        assert losses["final"] < losses["first"]  # training made progress


# --- the command line -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli():
    from saguaro.modelmaker import cli as make_models_cli

    return make_models_cli


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--size", "huge"], "huge"),
        (["--size", "tiny", "--seed", "-3"], "-3"),
        (["--size", "tiny", "--out", "{file}"], "{file}"),
        (["--size", "tiny", "--out", "{file}/below"], "{file}"),
    ],
)
def test_cli_rejects_bad_input_before_training(cli, monkeypatch, tmp_path, capsys, argv, named):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    monkeypatch.setattr(cli, "make_pair", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([arg.format(file=a_file) for arg in argv])
    assert exit_info.value.code == 2
    assert named.format(file=a_file) in capsys.readouterr().err


def test_cli_keeps_a_matching_pair_and_remakes_otherwise(cli, monkeypatch, tiny_pair, capsys):
    report = json.loads((tiny_pair / "pair.json").read_text())
    calls = []

    def fake_make_pair(size, out, seed, progress):
        calls.append(seed)
        return report

    monkeypatch.setattr(cli, "make_pair", fake_make_pair)
    assert cli.main(["--size", "tiny", "--out", str(tiny_pair)]) == 0
    assert calls == [] and "already holds" in capsys.readouterr().out
    assert cli.main(["--size", "tiny", "--out", str(tiny_pair), "--seed", "5"]) == 0
    assert cli.main(["--size", "tiny", "--out", str(tiny_pair), "--force"]) == 0
    assert calls == [5, 0]
    assert "greedy agreement" in capsys.readouterr().out
