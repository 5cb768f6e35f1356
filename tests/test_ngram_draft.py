"""The n-gram draft (`--draft-method ngram`): what it proposes, its token caches, and that
decoding over it stays exact: greedy output token-identical to the target alone, sampled
output distributed as the target's (the chi-square test of `test_lossless_sampling`)."""
import json

import numpy as np
import pytest
import torch
from test_lossless_sampling import (
    PLAIN,
    WINDOW,
    chi_square_rejects,
    empirical_counts,
    enumerable_pair,
    exact_law,
)

from saguaro.runtime import cli
from saguaro.runtime.core.contracts import Step
from saguaro.runtime.core.ngram import propose
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.decoding.speculator import Speculator, lockstep
from saguaro.runtime.engines.ngram_draft import TokenCache, row_contexts
from saguaro.runtime.pipeline import Pipeline, RequestError


def test_proposes_what_followed_the_latest_longest_match():
    context = np.array([5, 1, 2, 9, 7, 1, 2, 8, 3, 1, 2])
    assert propose(context, 4, 1) == 8  # "1 2" occurs twice before the end: the latest one wins
    longer = np.array([4, 1, 2, 6, 0, 1, 2, 8, 4, 1, 2])
    assert propose(longer, 4, 1) == 6  # "4 1 2" is a longer match than the latest "1 2"
    assert propose(np.array([1, 2, 3, 4]), 4, 1) is None
    assert propose(np.array([3, 9, 1, 2, 3]), 4, 2) is None  # only a one-token match, and min n is 2
    assert propose(np.array([3, 9, 1, 2, 3]), 4, 1) == 9


def test_token_cache_rolls_back_commits_a_branch_and_forks():
    cache = TokenCache(8)
    cache.append(np.array([1, 2, 3, 4, 5, 6]))
    cache.truncate(5)
    assert cache.tokens[:cache.length].tolist() == [1, 2, 3, 4, 5]
    cache.gather(2, torch.tensor([4, 3]))
    assert cache.tokens[:cache.length].tolist() == [1, 2, 5, 4]
    twin = cache.fork()
    twin.append(np.array([7]))
    assert cache.length == 4 and twin.tokens[:twin.length].tolist() == [1, 2, 5, 4, 7]
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(6)
    with pytest.raises(ValueError, match="cannot take"):
        cache.append(np.arange(5))


def test_a_tree_row_matches_against_its_own_branch_only():
    cache = TokenCache(16)
    cache.append(np.array([7, 8, 9]))
    # two branches after the context: rows 0 and 1 are branch A (tokens 4, 5), row 2 is branch B (6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    step = Step(cache, torch.tensor([4, 5, 6]), torch.tensor([3, 4, 3]), mask)
    assert [c.tolist() for c in row_contexts(cache, step)] == [[7, 8, 9, 4], [7, 8, 9, 4, 5], [7, 8, 9, 6]]


@pytest.fixture(scope="module")
def ngram_pipeline(tiny_engines):
    loaded = Pipeline.load(engines=tiny_engines, draft_method="ngram")
    yield loaded
    loaded.close()


def test_drafting_stops_where_nothing_matches(ngram_pipeline):
    draft = ngram_pipeline.draft
    speculator = Speculator(draft, SamplingParams(), None, 64)
    repeating = [11, 12, 13, 14, 11, 12]
    proposal = lockstep(draft, [speculator.draft(repeating, 4)])[0]
    assert proposal.tokens.tolist() == [13, 14, 11, 12]  # the repeat continued, token by token
    fresh = Speculator(draft, SamplingParams(), None, 64)
    assert len(lockstep(draft, [fresh.draft([21, 22, 23, 24], 4)])[0]) == 0  # no n-gram repeats: no drafts


@pytest.mark.parametrize("mode", ["speculative", "ssd"])
def test_greedy_output_is_the_targets_and_repeats_are_accepted(ngram_pipeline, mode):
    prompt = ngram_pipeline.encode("The with statement is used to wrap the with statement. The with statement is")
    options = DecodeOptions(mode=mode, num_draft_tokens=4, max_tokens=48, eos_token_id=-1)
    alone = ngram_pipeline.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=48, eos_token_id=-1),
                                    SamplingParams())
    drafted = ngram_pipeline.generate(prompt, options, SamplingParams())
    assert drafted.output_ids == alone.output_ids
    assert drafted.stats.accepted_tokens > 0, "no n-gram draft was accepted: the exactness check tested nothing"
    # the load policy learns how often the draft proposes: rounds it stopped short are counted
    shared = ngram_pipeline.schedulers[0].decoder.load_policy.shared[True]
    assert 0 < sum(shared.proposed) < sum(shared.asked)


@pytest.fixture(scope="module")
def enumerable_ngram(tmp_path_factory):
    return enumerable_pair(tmp_path_factory.mktemp("enumerable_ngram"), draft_method="ngram")


REPEATING_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # "1 2" is followed by 3, "2 3" by 1: every round proposes
LONGER = dict(max_tokens=WINDOW + 1, eos_token_id=-1)


@pytest.mark.parametrize("options", [DecodeOptions(mode="speculative", num_draft_tokens=2, **LONGER),
                                     DecodeOptions(mode="ssd", num_draft_tokens=2, fanout=(2,), **LONGER)],
                         ids=["speculative K=2", "ssd K=2"])
def test_sampled_output_follows_the_targets_law(enumerable_ngram, options):
    counts, _ = empirical_counts(enumerable_ngram, options, PLAIN, samples=2000, prompt=REPEATING_PROMPT)
    rejects, statistic = chi_square_rejects(counts, exact_law(enumerable_ngram.target, PLAIN, prompt=REPEATING_PROMPT))
    assert not rejects, f"chi-square {statistic:.1f} says the output is not the target's law"
    generation = enumerable_ngram.generate(REPEATING_PROMPT, options, SamplingParams(temperature=1.0, seed=0))
    assert generation.stats.drafted_tokens > 0, "the n-gram draft proposed nothing: the law was tested without drafts"


def test_loading_needs_no_draft_model_and_names_a_bad_method(tiny_pair):
    loaded = Pipeline.load(target=tiny_pair / "target", draft_method="ngram")
    try:
        assert loaded.draft.info.backend == "ngram" and loaded.draft.info.on_host
    finally:
        loaded.close()
    with pytest.raises(RequestError, match="draft method must be one of model, ngram, ngram\\+model; got 'eagle'"):
        Pipeline.load(target=tiny_pair / "target", draft_method="eagle")


def test_generate_cli_drafts_by_ngram(tiny_engines, capsys):
    assert cli.main(["--engines", str(tiny_engines), "--draft-method", "ngram", "--mode", "speculative",
                     "--max-tokens", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["tokens"] == 16
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--engines", str(tiny_engines), "--draft-method", "eagle"])
    assert exit_info.value.code == 2
    assert "--draft-method" in capsys.readouterr().err
