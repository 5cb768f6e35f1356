"""Decoding over a feature draft (an EAGLE-3 head reading the target's hidden states):
greedy SD and SSD equal the target alone, and the draft reads the target's features where
they are known and its own predictions where they are not."""
from pathlib import Path

import pytest
import torch
from checkpoints import random_head

from saguaro.runtime.core.contracts import Rows
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.decoding.speculator import DraftFeatures
from saguaro.runtime.engines.torch_engine import TorchEngine, TorchFeatureDraft
from saguaro.runtime.pipeline import Pipeline

PROMPTS = ["The with statement", "A class definition defines", "Exceptions are raised", "x",
           "In a for loop,", "The import system"]
MAX_TOKENS = 20
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory) -> Path:
    return random_head(tiny_pair / "target", tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def pipeline(tiny_pair, head_dir):
    return Pipeline.load(tiny_pair / "target", head_dir)


def test_the_pipeline_loads_a_head_as_a_feature_draft_and_the_target_returns_its_layers(pipeline):
    assert isinstance(pipeline.draft, TorchFeatureDraft)
    assert pipeline.draft.info.reads_features
    assert pipeline.target.info.feature_layers == pipeline.draft.head.shape.feature_layers


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_sd_and_ssd_over_a_feature_draft_equal_the_target_alone(pipeline, k):
    reference = DecodeOptions(mode="autoregressive", max_tokens=MAX_TOKENS)
    modes = [DecodeOptions(mode="speculative", num_draft_tokens=k, max_tokens=MAX_TOKENS),
             DecodeOptions(mode="ssd", num_draft_tokens=k, fanout=(3,), max_tokens=MAX_TOKENS)]
    prompts = [pipeline.encode(prompt) for prompt in PROMPTS]
    expected = [pipeline.generate(ids, reference, GREEDY).output_ids for ids in prompts]
    for options in modes:
        requests = [pipeline.request(ids, options, GREEDY) for ids in prompts]
        got = pipeline.generate_batch(requests)  # decoded together, rounds batched
        assert [g.output_ids for g in got] == expected, options
        assert sum(g.stats.cache_misses for g in got) > 0 or options.mode == "speculative"


class RecordingDraft:
    """The feature draft, keeping every step's tokens, positions, fed features and the
    features it predicted (all its steps here are one sequence's)."""

    def __init__(self, draft: TorchFeatureDraft):
        self.draft, self.steps = draft, []

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def forward_rows(self, steps) -> list[Rows]:
        fed = [(step.tokens.clone(), step.positions.clone(), step.hidden.clone()) for step in steps]
        rows = self.draft.forward_rows(steps)
        self.steps += [(*inputs, out.hidden.clone()) for inputs, out in zip(fed, rows)]
        return rows


def target_features(target: TorchEngine, draft: TorchFeatureDraft, ids: list[int]) -> torch.Tensor:
    """The target's projected features at every position of `ids`, computed in one pass."""
    shape, text = target.model.shape, torch.tensor(ids)
    empty = torch.zeros(shape.num_layers, 1, shape.num_kv_heads, 0, shape.head_dim)
    mask = torch.ones(len(text), len(text), dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        *_, features = target.model.hidden_concat(text[None], torch.arange(len(text))[None], mask, empty, empty,
                                                  target.info.feature_layers)
        return draft.project(features[0])


def test_syncs_feed_the_targets_features_and_drafts_the_drafts_own(tiny_pair, head_dir):
    """A sync of committed tokens feeds each the target's feature of the position before
    it (as the target alone computes it; zeros at position 0); a drafted token is fed the
    feature the draft predicted at the row it was drafted from."""
    target = TorchEngine(tiny_pair / "target")
    recording = RecordingDraft(TorchFeatureDraft(head_dir, target))
    pipeline = Pipeline(target, recording)
    ids = pipeline.encode(PROMPTS[1])
    out = pipeline.generate(ids, DecodeOptions(mode="speculative", num_draft_tokens=3, max_tokens=12), GREEDY)
    true = target_features(target, recording.draft, ids + out.output_ids)
    kinds, previous = {"target's": 0, "own": 0}, None
    for tokens, positions, fed, predicted in recording.steps:
        wanted = torch.stack([true[p - 1] if p > 0 else torch.zeros_like(true[0]) for p in positions.tolist()])
        if torch.allclose(fed, wanted, rtol=1e-4, atol=1e-5):
            kinds["target's"] += 1
        else:
            assert len(tokens) == 1 and previous is not None, "a sync fed features other than the target's"
            torch.testing.assert_close(fed[0], previous[-1])
            kinds["own"] += 1
        previous = predicted
    assert kinds["target's"] > 0 and kinds["own"] > 0, kinds


def test_rounds_after_a_hit_count_as_prespeculated_and_split_the_acceptance(tiny_pair):
    """Every hit's branch is the next round's draft (but for a generation's last round),
    and the accepted tokens split between pre-speculated and fresh drafts."""
    pipeline = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    options = DecodeOptions(mode="ssd", num_draft_tokens=3, fanout=(3,), max_tokens=40, eos_token_id=-1)
    stats = pipeline.generate(pipeline.encode(PROMPTS[0]), options, GREEDY).stats
    assert stats.cache_hits > 0
    assert stats.cache_hits - 1 <= stats.hit_rounds <= stats.cache_hits
    fresh_drafted = stats.drafted_tokens - stats.hit_drafted
    total = stats.prespeculated_acceptance * stats.hit_drafted + stats.fresh_acceptance * fresh_drafted
    assert total == pytest.approx(stats.accepted_tokens)


class CountingProjection:
    """An engine's `project` (a fixed linear map), counting its calls."""

    hidden_size = 4

    def __init__(self):
        self.weight, self.calls = torch.randn(6, self.hidden_size, generator=torch.Generator().manual_seed(0)), 0

    def project(self, features: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return features @ self.weight


def test_features_are_projected_when_a_draft_needs_them_in_one_call():
    """Rounds that draft nothing only keep the target's features; the next draft projects
    all it lacks at once, and reads what projecting each round's on arrival would give,
    a rolled-back tail replaced."""
    engine, rows = CountingProjection(), torch.randn(9, 6, generator=torch.Generator().manual_seed(1))
    features = DraftFeatures(engine)
    features.observe(0, rows[:5])       # a prompt
    for position in range(5, 8):        # three rounds with nothing drafted (numpy rows, as ONNX Runtime gives them)
        features.observe(position, rows[position:position + 1].numpy())
    features.observe(7, rows[8:9])      # position 7 again: a rollback replaced it
    assert engine.calls == 0
    expected = torch.cat([rows[:7], rows[8:9]]) @ engine.weight
    fed = features.before(1, 8)         # tokens at 1..8: the features of 0..7
    assert engine.calls == 1
    torch.testing.assert_close(fed, expected)
    features.observe(3, rows[:2])       # a rollback into what was projected
    torch.testing.assert_close(features.before(0, 5)[1:], torch.cat([expected[:3], rows[:1] @ engine.weight]))
    assert engine.calls == 2
