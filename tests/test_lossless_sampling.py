"""Sampled output is distributed exactly as the target's, in every speculative mode.

The models are small enough to enumerate: 4 tokens, so the exact law of the first four
generated tokens (256 outcomes) comes from 85 target forwards. Each configuration below
samples a few thousand seeded generations and must pass a chi-square test against that
law. The first token comes with the prefill (drawn as a round without drafts draws its
bonus); the configurations are chosen so that every rule of the algorithm is exercised
inside the three tokens after it:

- K = 2 rounds verify two drafts, so acceptance past depth 0 is tested, and a second
  round verifies drafts after a rejection (the generation runs one token past the window
  so that round is never clipped);
- K = 1 rounds reach a second verified round after an all-accept;
- SSD branch hits feed verified rounds, with a fan-out that covers every outcome
  (K = 1, fan-out (3, 4) on 4 tokens: every rejection's bonus differs from the draft),
  with Saguaro sampling, and with top-k / top-p filtering.

The same check runs on ONNX Runtime fp32 engines of an 8-token pair: the law of four
tokens (4096 outcomes), K = 4 and K = 3 with pre-speculation, Saguaro sampling and both
filters. A deliberately biased verification rule fails the same test, which shows it has teeth;
`tests/mutation_check.py` shows that realistic bugs in the sampling path fail it too.
"""
import math

import pytest
import torch
from checkpoints import build_small_engines, make_checkpoint

from saguaro.plugins.probs import logits_to_probs
from saguaro.runtime.core.contracts import VerifyResult
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline

PROMPT = [1, 2, 3]
VOCAB = 4
WINDOW = 4          # tokens whose joint law is checked
SAMPLES = 3000      # seeded generations per configuration


def enumerable_pair(root, draft_method: str = "model") -> Pipeline:
    """A pair over `VOCAB` tokens, whose law over `WINDOW` tokens can be enumerated."""
    target = make_checkpoint(root / "target", vocab_size=VOCAB, hidden=32, seed=0, logit_scale=4.0)
    draft = make_checkpoint(root / "draft", vocab_size=VOCAB, hidden=16, seed=1, logit_scale=4.0)
    return Pipeline.load(target, draft, draft_method=draft_method)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return enumerable_pair(tmp_path_factory.mktemp("enumerable"))


def next_token_probs(engine, ids, sampling) -> torch.Tensor:
    cache = engine.new_cache(len(ids))
    logits = engine.forward(cache, torch.tensor(ids), torch.arange(len(ids)))[-1]
    return logits_to_probs(logits.double(), sampling.temperature, sampling.top_k, sampling.top_p)


def exact_law(engine, sampling, prefix=(), depth: int = WINDOW, prompt=PROMPT, vocab: int = VOCAB) -> torch.Tensor:
    """P(the next `depth` tokens after prompt + prefix), `[V] * depth`, under the target alone."""
    first = next_token_probs(engine, list(prompt) + list(prefix), sampling)
    if depth == 1:
        return first
    return torch.stack([first[x] * exact_law(engine, sampling, (*prefix, x), depth - 1, prompt, vocab)
                        for x in range(vocab)])


def empirical_counts(pipeline, options, sampling, samples: int = SAMPLES, prompt=PROMPT, vocab: int = VOCAB,
                     window: int = WINDOW):
    counts = torch.zeros([vocab] * window, dtype=torch.float64)
    hits = lookups = 0
    for seed in range(samples):
        run = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        generation = pipeline.generate(list(prompt), options, run)
        counts[tuple(generation.output_ids[:window])] += 1
        hits += generation.stats.cache_hits
        lookups += generation.stats.cache_hits + generation.stats.cache_misses
    return counts, hits / max(lookups, 1)


def chi_square_rejects(counts: torch.Tensor, law: torch.Tensor, alpha_z: float = 3.09) -> tuple[bool, float]:
    """Pearson chi-square at alpha = 0.001 (z = 3.09), cells expected < 5 pooled."""
    expected, observed = law.flatten() * counts.sum(), counts.flatten()
    if observed[law.flatten() == 0].sum() > 0:
        return True, math.inf  # an impossible outcome happened
    small = expected < 5
    cells_e = torch.cat((expected[~small], expected[small].sum().view(1)))
    cells_o = torch.cat((observed[~small], observed[small].sum().view(1)))
    keep = cells_e > 0
    statistic = float(((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square quantile
    critical = dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic > critical, statistic


PLAIN = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=3, top_p=0.9)
LONGER = dict(max_tokens=WINDOW + 1, eos_token_id=-1)  # a round inside the window is never clipped

# name -> (options, sampling, least hit rate the configuration must show)
CONFIGURATIONS = {
    "speculative K=2": (DecodeOptions(mode="speculative", num_draft_tokens=2, **LONGER), PLAIN, 0.0),
    "speculative K=1": (DecodeOptions(mode="speculative", num_draft_tokens=1, **LONGER), PLAIN, 0.0),
    "ssd K=2 fan-out 2": (DecodeOptions(mode="ssd", num_draft_tokens=2, fanout=(2,), **LONGER), PLAIN, 0.3),
    "ssd K=1 fan-out covers all": (DecodeOptions(mode="ssd", num_draft_tokens=1, fanout=(VOCAB - 1, VOCAB),
                                                 **LONGER), PLAIN, 1.0),
    "ssd K=2 saguaro": (DecodeOptions(mode="ssd", num_draft_tokens=2, fanout=(1,), saguaro_factor=0.4,
                                      saguaro_top=2, **LONGER),
                        PLAIN, 0.2),
    "ssd K=2 budget, top-k/top-p": (DecodeOptions(mode="ssd", num_draft_tokens=2, budget=3, **LONGER),
                                    FILTERED, 0.2),
}


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_speculative_modes_sample_the_target_distribution(pipeline, name):
    options, sampling, least_hit_rate = CONFIGURATIONS[name]
    counts, hit_rate = empirical_counts(pipeline, options, sampling)
    rejects, statistic = chi_square_rejects(counts, exact_law(pipeline.target, sampling))
    assert not rejects, f"{name}: chi-square {statistic:.1f} says the output is not the target's law"
    assert hit_rate >= least_hit_rate, f"{name}: only {hit_rate:.0%} of lookups hit; branch hits are not tested"


class BiasedVerify:
    """Wraps the target engine with the naive rule "accept the draft when the target
    gives it at least as much probability as some fixed bar" — not lossless."""

    def __init__(self, engine):
        self.engine, self.info, self.tokenizer = engine, engine.info, engine.tokenizer

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def verify_batch(self, steps):
        return [self.biased(logits, item) for logits, item in
                zip(self.engine.forward_batch([item.step for item in steps]), steps)]

    def biased(self, logits, item):
        p = logits_to_probs(logits, item.sampling.temperature)
        accepted = 0
        while accepted < len(item.draft_tokens) and p[accepted, item.draft_tokens[accepted]] > 0.05:
            accepted += 1
        seed = int(item.uniforms[-1] * 1e9)
        bonus = torch.multinomial(p[accepted], 1, generator=torch.Generator().manual_seed(seed))
        return VerifyResult(accepted, int(bonus))


def test_the_chi_square_test_catches_a_biased_rule(pipeline):
    options, sampling, _ = CONFIGURATIONS["ssd K=1 fan-out covers all"]
    biased = Pipeline(BiasedVerify(pipeline.target), pipeline.draft)
    counts, _ = empirical_counts(biased, options, sampling, samples=1000)
    rejects, statistic = chi_square_rejects(counts, exact_law(pipeline.target, sampling))
    assert rejects, f"a biased rule passed (chi-square {statistic:.1f}): the test has no power"


# The same check on compiled engines: ONNX Runtime fp32 engines of an 8-token pair, the
# law of 4 tokens (4096 outcomes), K up to 4 (every round verifies past depth 2, and the
# 5-token generation reaches a second round after a rejection or an all-accept).
ORT_VOCAB, ORT_WINDOW, ORT_PROMPT, ORT_SAMPLES = 8, 4, [1, 2, 3, 5], 2000
ORT_LONGER = dict(max_tokens=ORT_WINDOW + 1, eos_token_id=-1)
ORT_CONFIGURATIONS = {
    "speculative K=4": (DecodeOptions(mode="speculative", num_draft_tokens=4, **ORT_LONGER), PLAIN, 0.0),
    "ssd K=3 fan-out 2, saguaro, top-k/top-p": (
        DecodeOptions(mode="ssd", num_draft_tokens=3, fanout=(2,), saguaro_factor=0.5, saguaro_top=2,
                      **ORT_LONGER), SamplingParams(temperature=0.9, top_k=6, top_p=0.95), 0.05),
}


@pytest.fixture(scope="module")
def ort_pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("enumerable_ort")
    make_checkpoint(root / "target", vocab_size=ORT_VOCAB, hidden=64, heads=4, kv_heads=2, seed=0, logit_scale=8.0)
    make_checkpoint(root / "draft", vocab_size=ORT_VOCAB, hidden=32, heads=2, kv_heads=1, seed=1, logit_scale=8.0)
    loaded = Pipeline.load(engines=build_small_engines(root, root / "engines", "enumerable", max_draft_tokens=4,
                                                       max_branches=16))
    yield loaded
    loaded.close()


def ort_law(pipeline, sampling):
    return exact_law(pipeline.target, sampling, depth=ORT_WINDOW, prompt=ORT_PROMPT, vocab=ORT_VOCAB)


@pytest.mark.parametrize("name", ORT_CONFIGURATIONS)
def test_onnxruntime_engines_sample_the_target_distribution(ort_pipeline, name):
    options, sampling, least_hit_rate = ORT_CONFIGURATIONS[name]
    counts, hit_rate = empirical_counts(ort_pipeline, options, sampling, ORT_SAMPLES, ORT_PROMPT, ORT_VOCAB, ORT_WINDOW)
    rejects, statistic = chi_square_rejects(counts, ort_law(ort_pipeline, sampling))
    assert not rejects, f"{name}: chi-square {statistic:.1f} says the output is not the target's law"
    assert hit_rate >= least_hit_rate, f"{name}: only {hit_rate:.0%} of lookups hit"


def test_the_chi_square_test_catches_a_biased_rule_on_onnxruntime_engines(ort_pipeline):
    options, sampling, _ = ORT_CONFIGURATIONS["speculative K=4"]
    biased = Pipeline(BiasedVerify(ort_pipeline.target), ort_pipeline.draft)
    counts, _ = empirical_counts(biased, options, sampling, 600, ORT_PROMPT, ORT_VOCAB, ORT_WINDOW)
    rejects, statistic = chi_square_rejects(counts, ort_law(ort_pipeline, sampling))
    assert rejects, f"a biased rule passed (chi-square {statistic:.1f}): the test has no power"
