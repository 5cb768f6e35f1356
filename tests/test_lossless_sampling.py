"""Sampled output is distributed exactly as the target's, in every speculative mode.

The models are small enough to enumerate: 6 tokens, so the exact law of the first two
generated tokens (36 outcomes) comes from 7 target forwards. Each mode's empirical law
over many seeded generations must pass a chi-square test against it; the same test run
on a deliberately biased verification rule must fail, which shows the test has teeth.
"""
import math

import pytest
import torch

from checkpoints import make_checkpoint
from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.pipeline import Pipeline
from saguaro.runtime.sampling import SamplingParams
from saguaro.plugins.probs import logits_to_probs

PROMPT = [1, 4, 5]
SAMPLES = 1200
VOCAB = 6


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("enumerable")
    target = make_checkpoint(root / "target", vocab_size=VOCAB, hidden=32, seed=0, logit_scale=12.0)
    draft = make_checkpoint(root / "draft", vocab_size=VOCAB, hidden=16, seed=1, logit_scale=12.0)
    return Pipeline.load(target, draft)


def next_token_probs(engine, ids, sampling):
    cache = engine.new_cache(len(ids))
    logits = engine.forward(cache, torch.tensor(ids), torch.arange(len(ids)))[-1]
    return logits_to_probs(logits.double(), sampling.temperature, sampling.top_k, sampling.top_p)


def exact_law(engine, sampling) -> torch.Tensor:
    """P(first two tokens = (x, y)) under the target alone, `[V, V]`."""
    first = next_token_probs(engine, PROMPT, sampling)
    return torch.stack([first[x] * next_token_probs(engine, PROMPT + [x], sampling) for x in range(VOCAB)])


def empirical_counts(pipeline, options, sampling) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seed in range(SAMPLES):
        run = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        x, y = pipeline.generate(PROMPT, options, run).output_ids
        counts[x, y] += 1
    return counts


def chi_square_rejects(counts: torch.Tensor, law: torch.Tensor, alpha_z: float = 3.09) -> tuple[bool, float]:
    """Pearson chi-square at alpha = 0.001 (z = 3.09), cells expected < 5 pooled."""
    expected, observed = law.flatten() * counts.sum(), counts.flatten()
    small = expected < 5
    if counts.flatten()[law.flatten() == 0].sum() > 0:
        return True, math.inf  # an impossible outcome happened
    cells_e = torch.cat((expected[~small], expected[small].sum().view(1)))
    cells_o = torch.cat((observed[~small], observed[small].sum().view(1)))
    keep = cells_e > 0
    statistic = float(((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square quantile
    critical = dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic > critical, statistic


MODES = {
    "speculative K=2": (DecodeOptions(mode="speculative", num_draft_tokens=2, max_tokens=2, eos_token_id=-1),
                        SamplingParams(temperature=1.0)),
    "ssd K=1 fanout 2": (DecodeOptions(mode="ssd", num_draft_tokens=1, fanout=(2,), max_tokens=2, eos_token_id=-1),
                         SamplingParams(temperature=1.0)),
    "ssd K=2 saguaro": (DecodeOptions(mode="ssd", num_draft_tokens=2, fanout=(1,), saguaro_factor=0.4,
                                      max_tokens=2, eos_token_id=-1), SamplingParams(temperature=1.0)),
    "ssd budget, top-k/top-p": (DecodeOptions(mode="ssd", num_draft_tokens=1, budget=3, max_tokens=2, eos_token_id=-1),
                                SamplingParams(temperature=0.8, top_k=4, top_p=0.9)),
}


@pytest.mark.parametrize("name", MODES)
def test_speculative_modes_sample_the_target_distribution(pipeline, name):
    options, sampling = MODES[name]
    law = exact_law(pipeline.target, sampling)
    rejects, statistic = chi_square_rejects(empirical_counts(pipeline, options, sampling), law)
    assert not rejects, f"{name}: chi-square {statistic:.1f} says the output is not the target's law"


class BiasedVerify:
    """Wraps the target engine with the naive rule "accept the draft when the target
    gives it at least as much probability as some fixed bar" — not lossless."""

    def __init__(self, engine):
        self.engine, self.info, self.tokenizer = engine, engine.info, engine.tokenizer

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def verify(self, cache, tokens, positions, draft_tokens, draft_probs, uniforms, sampling):
        logits = self.engine.forward(cache, tokens, positions)
        p = logits_to_probs(logits, sampling.temperature)
        accepted = 0
        while accepted < len(draft_tokens) and p[accepted, draft_tokens[accepted]] > 0.05:
            accepted += 1
        bonus = torch.multinomial(p[accepted], 1, generator=torch.Generator().manual_seed(int(uniforms[-1] * 1e9)))
        return accepted, int(bonus)


def test_the_chi_square_test_catches_a_biased_rule(pipeline):
    options, sampling = MODES["ssd K=1 fanout 2"]
    biased = Pipeline(BiasedVerify(pipeline.target), pipeline.draft)
    law = exact_law(pipeline.target, sampling)
    rejects, statistic = chi_square_rejects(empirical_counts(biased, options, sampling), law)
    assert rejects, f"a biased rule passed (chi-square {statistic:.1f}): the test has no power"
