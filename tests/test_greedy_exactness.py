"""Greedy SD and SSD are token-identical to greedy decoding of the target alone."""
import pytest

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline

PROMPTS = [
    "The with statement", "A class definition defines", "Exceptions are raised", "The import system",
    "In a for loop,", "Assignment statements are used to", "The following identifiers",
    "If the syntax", "Objects are Python", "The return statement", "A function definition",
    "Comparisons", "The del statement", "String literals are", "Boolean operations",
    "The pass statement", "Numbers", "When a name is", "The try statement specifies",
    "Lambda expressions", "x", "Identifiers (also referred to as names) are described",
]
MAX_TOKENS = 24
GREEDY = SamplingParams()


def option_sets(k: int) -> list[DecodeOptions]:
    common = dict(num_draft_tokens=k, max_tokens=MAX_TOKENS)
    return [
        DecodeOptions(mode="speculative", **common),
        DecodeOptions(mode="ssd", fanout=(1,), **common),
        DecodeOptions(mode="ssd", fanout=(3,), **common),
        DecodeOptions(mode="ssd", fanout=tuple(range(k + 1, 0, -1)), **common),
        DecodeOptions(mode="ssd", budget=5, **common),
        DecodeOptions(mode="ssd", budget="auto", **common),
    ]


@pytest.fixture(scope="module")
def pipeline(tiny_pair):
    return Pipeline.load(tiny_pair / "target", tiny_pair / "draft")


@pytest.fixture(scope="module")
def references(pipeline):
    """Plain greedy decoding of the target for every prompt."""
    options = DecodeOptions(mode="autoregressive", max_tokens=MAX_TOKENS)
    return {prompt: pipeline.generate(pipeline.encode(prompt), options, GREEDY) for prompt in PROMPTS}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_sd_and_ssd_match_target_greedy(pipeline, references, k):
    hits = misses = 0
    for prompt in PROMPTS:
        expected = references[prompt]
        for options in option_sets(k):
            got = pipeline.generate(pipeline.encode(prompt), options, GREEDY)
            assert got.output_ids == expected.output_ids, f"{prompt!r} K={k} {options}"
            assert got.finish_reason == expected.finish_reason
            hits, misses = hits + got.stats.cache_hits, misses + got.stats.cache_misses
    assert hits > 0 and misses > 0, "both the hit and the miss path must have been exercised"


def test_generation_that_fills_the_context(pipeline):
    """Prompts that end a few tokens before the context limit: the last rounds shrink K."""
    max_context = pipeline.max_context
    text = " ".join(PROMPTS * 40)
    for room in (1, 2, 4, 7):
        prompt_ids = pipeline.encode(text)[: max_context - room]
        expected = pipeline.generate(prompt_ids, DecodeOptions(mode="autoregressive", max_tokens=64,
                                                               eos_token_id=-1), GREEDY)
        assert expected.finish_reason == "context" and len(expected.output_ids) == room
        for k in (1, 3, 5):
            for options in option_sets(k):
                options = DecodeOptions(**{**options.__dict__, "max_tokens": 64, "eos_token_id": -1})
                got = pipeline.generate(prompt_ids, options, GREEDY)
                assert got.output_ids == expected.output_ids and got.finish_reason == "context"


def test_generation_that_stops_at_eos(pipeline, references):
    """Declare a token the target emits mid-generation to be EOS: every mode stops right there."""
    for prompt in PROMPTS[:6]:
        tokens = references[prompt].output_ids
        eos, stop = tokens[5], tokens.index(tokens[5])
        ar = pipeline.generate(pipeline.encode(prompt), DecodeOptions(mode="autoregressive",
                               max_tokens=MAX_TOKENS, eos_token_id=eos), GREEDY)
        assert ar.output_ids == tokens[: stop + 1] and ar.finish_reason == "eos"
        for k in (1, 3, 5):
            for options in option_sets(k):
                options = DecodeOptions(**{**options.__dict__, "eos_token_id": eos})
                got = pipeline.generate(pipeline.encode(prompt), options, GREEDY)
                assert got.output_ids == ar.output_ids and got.finish_reason == "eos"
