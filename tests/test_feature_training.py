"""Training a feature head on a target's own answers: the batched collection, the unrolled
training-time-test steps against the head's runtime form, the round replay, and a short
training on the tiny pair that must raise held-out agreement."""
import dataclasses
import json
import time

import pytest
import torch

from saguaro.modelmaker import feature_draft
from saguaro.modelmaker.feature_answers import Answer, collect_answers
from saguaro.modelmaker.feature_chains import batch_of, chain_mask, unrolled
from saguaro.modelmaker.feature_draft import (
    PASSES,
    PRESETS,
    draft_vocabulary,
    encoded_prompts,
    feature_loss,
    initial_head,
    layer_copied,
    make_feature_draft,
    target_answers,
    train_head,
    training_pace,
    training_room,
)
from saguaro.modelmaker.feature_report import acceptance, round_lengths
from saguaro.modelmaker.train import TrainSettings
from saguaro.runtime.models.checkpoint import load_checkpoint
from saguaro.runtime.models.feature_head import is_feature_head, load_feature_head

TINY = dataclasses.replace(PRESETS["quick"], draft_vocab_size=200, train_prompts=24, held_out_prompts=8,
                           new_tokens=12, generation_batch=8, threads=2, minutes=None,
                           train=TrainSettings(steps=30, batch_size=8, seq_len=0, lr=3e-3, warmup_steps=3))
LAYERS = (0, 1, 2)


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_checkpoint(tiny_pair / "target")


@pytest.fixture(scope="module")
def answers(target):
    train = collect_answers(target.model, encoded_prompts(target.tokenizer, TINY, False), TINY.new_tokens, 8,
                            target.eos_token_ids, TINY.soft_top, LAYERS)
    held_out = collect_answers(target.model, encoded_prompts(target.tokenizer, TINY, True), TINY.new_tokens, 8,
                               target.eos_token_ids, 1, LAYERS)
    return train, held_out


def test_answers_stop_where_room_says_more_is_not_worth_it_but_the_first_batch(target):
    """A bounded run answers no more prompts than leave training the steps they are worth
    (on a 2-core AVX2 host the quick preset's 192 answers had left it 50 steps)."""
    prompts = encoded_prompts(target.tokenizer, TINY, False)[:12]
    asked: list[tuple[int, float]] = []

    def none_more(count: int, ends: float) -> bool:
        asked.append((count, ends))
        return False

    started = time.monotonic()
    late = collect_answers(target.model, prompts, TINY.new_tokens, 4, target.eos_token_ids, 4, LAYERS, room=none_more)
    assert len(late) == 4 and len(asked) == 1
    count, ends = asked[0]
    assert count == 8 and ends > time.monotonic() > started  # the next batch's end, at the pace so far
    timely = collect_answers(target.model, prompts, TINY.new_tokens, 4, target.eos_token_ids, 4, LAYERS,
                             room=lambda count, ends: count <= 8)
    assert len(timely) == 8 and [a.ids for a in timely[:4]] == [a.ids for a in late]


def test_training_room_leaves_the_steps_answers_are_worth():
    settings = dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, steps=100, batch_size=4))
    room = training_room(settings, step_seconds=0.5, deadline=1000.0)
    # 40 answers are worth PASSES * 40 / 4 = 80 steps, 40 s: room until 960
    assert room(40, 960.0) and not room(40, 960.5)
    # many answers are worth at most the preset's 100 steps (50 s)
    assert room(4000, 950.0) and not room(4000, 950.5)
    assert PASSES == 8


def test_training_pace_is_the_steps_after_the_first_slow_ones(monkeypatch):
    """A fresh process's first training steps are slow; the pace that sizes the answers is
    the steps after them (timing the first two had stopped the quick preset at 128 of its
    192 answers)."""
    layer = torch.nn.Linear(2, 1)
    calls = []

    def draws(head, answers, settings, bf16):
        def batch_loss():
            calls.append(None)
            time.sleep(0.2 if len(calls) <= 3 else 0.01)
            return layer(torch.ones(2)).sum()
        return batch_loss

    monkeypatch.setattr(feature_draft, "loss_on_draws", draws)
    pace = training_pace(layer, [], TINY, bf16=False)
    assert len(calls) == 7 and 0.009 < pace < 0.1


def test_batched_collection_is_greedy_decoding_one_at_a_time(target, answers):
    prompts = encoded_prompts(target.tokenizer, TINY, True)[:5]
    batched = collect_answers(target.model, prompts, TINY.new_tokens, 5, target.eos_token_ids, 4, LAYERS)
    alone = [collect_answers(target.model, [p], TINY.new_tokens, 1, target.eos_token_ids, 4, LAYERS)[0]
             for p in prompts]
    assert [a.ids for a in batched] == [a.ids for a in alone]
    for a, prompt in zip(batched, prompts):
        assert a.ids[:a.start] == prompt and a.top_ids[:, 0].tolist() == a.continuation
        # teacher-forced over the whole answer, the target's argmax is the answer itself
        assert target.model.forward_sequence(torch.tensor(a.ids))[a.start - 1:-1].argmax(-1).tolist() == a.continuation
        n = len(a.ids) - 1
        empty = torch.zeros(2, 1, 2, 0, target.shape.head_dim)
        with torch.no_grad():
            last, *_, features = target.model.hidden_concat(torch.tensor([a.ids[:n]]), torch.arange(n)[None],
                                                            torch.ones(n, n, dtype=torch.bool).tril()[None], empty,
                                                            empty, LAYERS)
        torch.testing.assert_close(a.features, features[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.finals, last[0], rtol=1e-4, atol=1e-4)  # what hidden_out is regressed on


def test_a_head_starts_as_the_target_layer_that_reads_its_highest_feature(target, answers):
    """Over layers (0, 1) the head starts as the target's layer 1: its first drafting step
    on the target's features returns what layer 1 returned at each position (feature 2)."""
    answer = answers[0][0]
    width = target.shape.hidden_size
    head = initial_head(target.model, (0, 1), torch.arange(200))
    assert layer_copied(target.model, (0, 1)) == 1 and layer_copied(target.model, LAYERS) == 1  # the last
    first_two = dataclasses.replace(answer, features=answer.features[:, :2 * width])
    with torch.no_grad():
        (hidden_out,) = unrolled(head, batch_of([first_two], 1, 1), 1)
    fed = len(answer.ids) - 1
    torch.testing.assert_close(hidden_out[0, :fed], answer.features[:, 2 * width:], rtol=1e-4, atol=1e-4)


def test_chain_mask_sees_the_prefix_and_its_own_chain():
    assert chain_mask(3, 1).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert chain_mask(3, 2).int().tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


def test_unrolled_steps_are_the_heads_runtime_drafting(target, answers):
    """Step 1 is the head on the target's features; step 2 at element e is the head's next
    step after e, fed its own hidden_out (what a runtime does when it drafts)."""
    train, _ = answers
    head = initial_head(target.model, LAYERS, torch.arange(200))
    with torch.no_grad():
        for parameter in head.midlayer.parameters():
            parameter.normal_(0, 0.2)
    answer = train[0]
    batch = batch_of([answer], 2, 1)
    first, second = unrolled(head, batch, 2)
    n, e = batch.width, batch.width // 2
    tokens, hidden = batch.ids[:, 1:n + 1], head.project(batch.features)
    empty = torch.zeros(1, 1, 2, 0, head.shape.head_dim)
    with torch.no_grad():
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        _, hidden_out, _, _ = head.forward_concat(tokens, hidden, torch.arange(1, n + 1)[None], mask, empty, empty)
        torch.testing.assert_close(first, hidden_out, rtol=1e-5, atol=1e-5)
        # the chain from element e: true features up to e, then its own hidden_out
        prefix_mask = torch.ones(e + 1, e + 1, dtype=torch.bool).tril()[None]
        _, _, keys, values = head.forward_concat(tokens[:, :e + 1], hidden[:, :e + 1], torch.arange(1, e + 2)[None],
                                                 prefix_mask, empty, empty)
        _, chained, _, _ = head.forward_concat(batch.ids[:, e + 2:e + 3], hidden_out[:, e:e + 1],
                                               torch.tensor([[e + 2]]), torch.ones(1, 1, e + 2, dtype=torch.bool),
                                               keys, values)
    torch.testing.assert_close(second[:, e], chained[:, 0], rtol=1e-5, atol=1e-5)


def test_feature_loss_compares_each_step_with_the_position_it_stands_for(answers):
    """Step j's hidden_out at element e stands for the target's last hidden state at position
    e + j: the loss is zero exactly there, over fed positions only (not the padding)."""
    train, _ = answers
    batch = batch_of(train[:3], 2, 1)
    for step in (1, 2):
        exact = batch.finals[:, step:step + batch.width].clone()
        assert feature_loss(exact, batch, step) == 0
        off_by_one = batch.finals[:, step - 1:step - 1 + batch.width]
        assert feature_loss(off_by_one, batch, step) > 0.01
        padding = ~batch.fed[:, step:step + batch.width]
        assert padding.any()  # the answers differ in length
        assert feature_loss(exact + 100.0 * padding.unsqueeze(-1), batch, step) == 0


def test_round_replay():
    answer = Answer(list(range(10)), 3, torch.zeros(9, 1), torch.zeros(9, 1), torch.zeros(7, 1), torch.zeros(7, 1))
    hits = [[True] * 10 for _ in range(3)]
    hits[1][2] = False  # the round whose bonus token is at position 3 accepts 1 of k=3
    # rounds: at 3 (accepts 1, next at 5), at 5 (accepts 3, next at 9), at 9: nothing left
    assert round_lengths(hits, answer, 3) == [1, 3]


def test_short_training_raises_held_out_agreement(target, answers):
    train, held_out = answers
    vocab = draft_vocabulary(train, TINY.draft_vocab_size, target.shape.vocab_size, target.eos_token_ids)
    head = initial_head(target.model, LAYERS, vocab)
    before = acceptance(head, held_out, 4)
    train_head(head, train, TINY, bf16=False, progress=False)
    after = acceptance(head, held_out, 4)
    assert after["agreement"] > before["agreement"] + 0.2 and after["mean_accepted"] > before["mean_accepted"]
    assert after["tokens_scored"] == sum(len(a.continuation) for a in held_out)


def test_a_bounded_run_times_its_steps_then_answers_what_they_leave_room_for(target):
    settings = dataclasses.replace(TINY, train_prompts=16, held_out_prompts=4, new_tokens=6, generation_batch=4)
    seconds: dict = {}
    train, held_out = target_answers(target, settings, LAYERS, False, False, seconds, deadline=time.monotonic())
    assert len(held_out) == 4 and len(train) == 4  # past its deadline: the first batch only
    assert seconds["pace"] > 0 and held_out[0].top_ids.shape[1] == settings.soft_top
    unbounded: dict = {}
    train, _ = target_answers(target, settings, LAYERS, False, False, unbounded)
    assert len(train) == 16 and "pace" not in unbounded


def test_draft_folder_is_a_release_format_head(tiny_pair, target, tmp_path):
    settings = dataclasses.replace(TINY, train_prompts=8, held_out_prompts=4, new_tokens=6,
                                   train=dataclasses.replace(TINY.train, steps=2))
    out = tmp_path / "head"
    report = make_feature_draft(tiny_pair / "target", out, settings, progress=False)
    assert is_feature_head(out) and (out / "tokenizer.json").is_file()
    assert json.loads((out / "draft.json").read_text()) == json.loads(json.dumps(report))
    assert report["kind"] == "feature" and report["target"] == str((tiny_pair / "target").resolve())
    assert report["feature_layers"] == [0, 1, 2] and set(report["step_seconds"]) >= {"target", "draft", "ratio"}
    head = load_feature_head(out, target.shape, target.model.model.embed_tokens.weight)
    assert head.shape.draft_vocab_size == report["output_vocab"] == 200


def test_make_models_kind_and_feature_layers(tmp_path):
    from saguaro.modelmaker.cli import draft_settings, parse_args

    common = ["--draft-for", str(tmp_path / "target"), "--out", str(tmp_path / "out")]
    assert parse_args(common).kind == "feature"  # the default: it beats the pruned draft on SmolLM2
    assert parse_args(common + ["--kind", "pruned", "--layers", "4"]).layers == 4
    args = parse_args(common + ["--feature-layers", "2,15,27", "--output-vocab", "1000"])
    assert args.feature_layers == (2, 15, 27) and draft_settings(args).draft_vocab_size == 1000
    assert draft_settings(args).minutes == PRESETS["full"].minutes == 29  # the full preset's bound
    assert draft_settings(parse_args(common + ["--preset", "quick", "--minutes", "5"])).minutes == 5
    assert draft_settings(parse_args(common + ["--minutes", "0"])).minutes is None  # 0: no bound
    for wrong in (["--kind", "pruned", "--feature-layers", "1,2"], ["--layers", "4"],
                  ["--kind", "feature", "--feature-layers", "2,x"], ["--minutes", "-1"], ["--minutes", "nan"],
                  ["--kind", "pruned", "--minutes", "5"]):
        with pytest.raises(SystemExit):
            parse_args(common + wrong)
