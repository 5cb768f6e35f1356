"""N-gram matches leading a draft model (`--draft-method ngram+model`): a round whose first
token the sequence's own tokens propose is drafted by matching alone, with no forward of
the model; the other rounds are the model's. Decoding over it stays exact, greedy and
sampled, and the model's cache catches up on the rounds it sat out."""
import numpy as np
import pytest
import torch
from checkpoints import random_head
from test_lossless_sampling import (
    PLAIN,
    WINDOW,
    chi_square_rejects,
    empirical_counts,
    enumerable_pair,
    exact_law,
)

from saguaro.runtime.control.round_report import Plan
from saguaro.runtime.core.contracts import Draft
from saguaro.runtime.core.ngram import matched_chain
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.decoding.decoder import Sequence
from saguaro.runtime.decoding.speculator import LEAD_FADING, LeadChoice, Speculator
from saguaro.runtime.pipeline import Pipeline, RequestError

GREEDY = SamplingParams()
REPEATING_TEXT = "The with statement is used to wrap the with statement. The with statement is"


def test_a_chain_follows_the_repeat_and_stops_where_nothing_matches():
    assert matched_chain(np.array([5, 6, 7, 8, 5, 6]), 3, 2, 4) == [7, 8, 5]
    assert matched_chain(np.array([5, 6, 7, 8, 5, 6]), 9, 2, 4) == [7, 8, 5, 6, 7, 8, 5, 6, 7]  # a loop, to k
    assert matched_chain(np.array([1, 2, 3, 9, 1, 2]), 4, 2, 4) == [3, 9, 1, 2]
    assert matched_chain(np.array([1, 2, 3, 4]), 4, 2, 4) == []
    assert matched_chain(np.array([4, 1, 2, 3, 1, 2]), 4, 2, 4) == [3, 1, 2, 3]


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    return random_head(tiny_pair / "target", tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def led(tiny_pair, head_dir):
    loaded = Pipeline.load(tiny_pair / "target", head_dir, draft_method="ngram+model")
    yield loaded
    loaded.close()


def test_a_match_drafts_the_round_without_the_model_and_no_match_leaves_it_to_the_model(led):
    assert led.draft.info.reads_features and led.draft.info.ngram_lead == (2, 4)
    speculator = Speculator(led.draft, GREEDY, None, 64)
    matched = speculator.match([11, 12, 13, 14, 11, 12], 4)
    assert matched is not None and matched.matched and matched.tokens.tolist() == [13, 14, 11, 12]
    assert speculator.cache.length == 0  # no forward of the model
    assert speculator.match([21, 22, 23, 24], 4) is None
    assert speculator.match([11, 12, 13, 14, 11, 12], 0) is None
    short = speculator.match([11, 12, 13, 11, 12, 9, 12, 13], 4)  # "12 13" -> 11 -> "13 11" -> 12, then "11 12" -> 9...
    assert short is not None and short.tokens.tolist() == [11, 12, 9, 12] and not short.stopped


def test_a_sampled_match_has_a_one_hot_q_and_a_plain_model_draft_never_matches(led, tiny_pair):
    sampled = Speculator(led.draft, SamplingParams(temperature=0.8, seed=1), None, 64)
    matched = sampled.match([3, 4, 5, 3, 4], 2)
    assert matched is not None and matched.probs is not None
    assert torch.equal(matched.probs.argmax(-1), matched.tokens) and matched.probs.sum().item() == 2.0
    assert matched.stopped is False and len(matched.prefix(1)) == 1 and matched.prefix(1).matched
    plain = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    try:
        assert Speculator(plain.draft, GREEDY, None, 64).match([3, 4, 5, 3, 4], 2) is None
    finally:
        plain.close()


def test_matches_lead_while_accepted_at_least_as_often_as_the_models_drafts():
    choice = LeadChoice()
    assert choice.matches_lead  # a tie: matches cost no forward
    for _ in range(3):
        choice.observe(False, 4, 4)  # the model's drafts all accepted
        choice.observe(True, 1, 0)   # the matches' first token rejected
    assert not choice.matches_lead
    for _ in range(30):  # the model gets worse, the matches better: what is recent counts
        choice.observe(False, 1, 0)
        choice.observe(True, 4, 3)
    assert choice.matches_lead
    choice.observe(True, 0, 0)  # nothing verified: nothing measured
    assert choice.rate(True) == pytest.approx(choice.accepted[True] / choice.verified[True])


def test_a_round_scores_the_match_it_found_against_what_was_committed(led):
    speculator = Speculator(led.draft, GREEDY, None, 64)
    ids = [11, 12, 13, 14, 11, 12]
    for _ in range(4):  # the model's drafts accepted whole, four rounds running
        speculator.observe_round(ids, Draft(torch.tensor([1, 2]), None, torch.zeros(2, 8)), 2)
    found = speculator.match(ids, 4)  # the chain is 13 14 11 12; the model leads (2 of 2 against 1 of 2)
    assert found is None and speculator.lead.rate(False) > speculator.lead.rate(True)
    model_draft = Draft(torch.tensor([13, 14]), None, torch.zeros(2, 8))
    speculator.observe_round(ids + [13, 14, 11], model_draft, 2)  # the target wrote what the chain said
    assert speculator.lead.verified[True] == pytest.approx(LEAD_FADING * 2 + 3)  # 3 of 3 committed agreed
    assert speculator.lead.accepted[True] == pytest.approx(LEAD_FADING * 1 + 3)
    speculator.observe_round(ids + [13, 14, 11, 12], model_draft, 2)  # no match was looked up since
    assert speculator.lead.verified[True] == pytest.approx(LEAD_FADING * 2 + 3)


def test_a_match_drafts_the_k_the_policy_priced_for_matches(led):
    ids = led.encode(REPEATING_TEXT)
    sequence = Sequence(led.request(ids, DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=True), GREEDY),
                        led.target, led.draft)
    sequence.prepare(Plan(2))  # the policy priced no K for matches (under load they must not draft)
    assert sequence.proposal is None  # left to the model's drafting
    sequence.prepare(Plan(0))
    assert sequence.proposal is sequence.empty
    sequence.prepare(Plan(1, probe=True, matched_tokens=3))  # a probe measures the model: no match
    assert sequence.proposal is None
    sequence.prepare(Plan(0, undrafted="priced", matched_tokens=3))  # the model does not pay, matches do
    assert sequence.proposal is not None and sequence.proposal.matched and sequence.round_draft_tokens == 3
    assert sequence.plan.draft_tokens == 3 and sequence.plan.undrafted is None  # the round drafts
    assert not sequence.speculates  # the model's cache has not seen the match: no branches
    pinned = Sequence(led.request(ids, DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=False), GREEDY),
                      led.target, led.draft)
    pinned.prepare(Plan(4))  # K pinned: matches draft it
    assert pinned.proposal is not None and pinned.proposal.matched and pinned.round_draft_tokens == 4
    fresh = Sequence(led.request([21, 22, 23, 24], DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=True),
                                 GREEDY), led.target, led.draft)
    fresh.prepare(Plan(2, matched_tokens=2))
    assert fresh.proposal is None  # no match: left to the model's drafting
    for each in (sequence, pinned, fresh):
        each.finish()


def count_matches(monkeypatch) -> list[int]:
    """`[rounds matching drafted, rounds left to the model]`, as `Speculator.match` answered."""
    counted = [0, 0]
    original = Speculator.match

    def counting(self, ids, k):
        drafted = original(self, ids, k)
        if k:
            counted[drafted is None] += 1
        return drafted
    monkeypatch.setattr(Speculator, "match", counting)
    return counted


@pytest.mark.parametrize("mode", ["speculative", "ssd"])
def test_greedy_output_over_a_feature_head_is_the_targets(led, mode, monkeypatch):
    prompt = led.encode(REPEATING_TEXT)
    alone = led.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=40, eos_token_id=-1), GREEDY)
    matched = count_matches(monkeypatch)
    options = DecodeOptions(mode=mode, num_draft_tokens=4, fanout=(2,), max_tokens=40, eos_token_id=-1)
    drafted = led.generate(prompt, options, GREEDY)
    assert drafted.output_ids == alone.output_ids
    assert matched[0] > 0 and matched[1] > 0, "both kinds of round must have run"
    assert drafted.stats.accepted_tokens > 0


def continuing_a_repeat(pipeline, prompt: list[int]) -> list[int]:
    """`prompt` and the target's own greedy tokens after it, up to where the next one (the
    prefill's first token) makes a bigram the tokens before hold: the first round then
    starts on a match, in every mode (with SSD's pre-speculated drafts hitting after it, a
    fixed K may ask for no other match)."""
    greedy = pipeline.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=32), GREEDY).output_ids
    for taken in range(len(greedy)):
        extended = prompt + greedy[:taken]
        if (extended[-1], greedy[taken]) in set(zip(extended, extended[1:])):
            return extended
    raise AssertionError("the target's greedy continuation repeats no bigram")


def test_greedy_output_on_compiled_engines_is_the_targets(tiny_engines, monkeypatch):
    pipeline = Pipeline.load(engines=tiny_engines, draft_method="ngram+model")
    try:
        prompt = continuing_a_repeat(pipeline, pipeline.encode(REPEATING_TEXT))
        alone = pipeline.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=32), GREEDY)
        matched = count_matches(monkeypatch)
        for mode, adapt_k in (("speculative", False), ("ssd", False), ("ssd", True)):
            options = DecodeOptions(mode=mode, num_draft_tokens=3, max_tokens=32, adapt_k=adapt_k)
            drafted = pipeline.generate(prompt, options, GREEDY)
            assert drafted.output_ids == alone.output_ids, (mode, adapt_k)
            assert matched[0] > 0, (mode, adapt_k)  # with the load policy too: matches priced apart draft
            matched[:] = [0, 0]
    finally:
        pipeline.close()


@pytest.fixture(scope="module")
def enumerable_led(tmp_path_factory):
    return enumerable_pair(tmp_path_factory.mktemp("enumerable_led"), draft_method="ngram+model")


# the prompt ends in 2 and "2 x" occurs in it for every token x: whatever the first token
# (the prefill's), the first round is a match; later rounds match or not by the sample
REPEATING_PROMPT = [2, 0, 1, 2, 1, 3, 2, 2, 0, 2, 3, 1, 2]


@pytest.mark.parametrize("options", [
    DecodeOptions(mode="speculative", num_draft_tokens=2, max_tokens=WINDOW + 1, eos_token_id=-1),
    DecodeOptions(mode="ssd", num_draft_tokens=2, fanout=(2,), max_tokens=WINDOW + 1, eos_token_id=-1)],
    ids=["speculative K=2", "ssd K=2"])
def test_sampled_output_follows_the_targets_law(enumerable_led, options, monkeypatch):
    matched = count_matches(monkeypatch)
    counts, _ = empirical_counts(enumerable_led, options, PLAIN, samples=2000, prompt=REPEATING_PROMPT)
    rejects, statistic = chi_square_rejects(counts, exact_law(enumerable_led.target, PLAIN, prompt=REPEATING_PROMPT))
    assert not rejects, f"chi-square {statistic:.1f} says the output is not the target's law"
    assert matched[0] >= 2000 and matched[1] > 0, "every sample's first round matched, and some later rounds did not"


def test_the_method_needs_a_draft_model(tiny_pair):
    with pytest.raises(RequestError, match="both target and draft"):
        Pipeline.load(target=tiny_pair / "target", draft_method="ngram+model")
    with pytest.raises(RequestError, match="model, ngram, ngram\\+model; got 'eagle'"):
        Pipeline.load(target=tiny_pair / "target", draft_method="eagle")
