"""How the modes relate, seeded determinism, and bad input rejected before any work."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from checkpoints import make_checkpoint

from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.plugins.probs import logits_to_probs, sample_from
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import (
    ACCEPT_STREAM,
    BONUS_STREAM,
    DRAFT_STREAM,
    UNSCORED,
    SamplingParams,
    keyed_uniforms,
    pick_tokens,
)
from saguaro.runtime.mode_comparison import compare_modes
from saguaro.runtime.models.checkpoint import CheckpointError
from saguaro.runtime.pipeline import Pipeline, RequestError

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 9, 14, 22, 5, 31]
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "target", vocab_size=40, hidden=32, layers=2, seed=0, logit_scale=4.0)
    draft = make_checkpoint(root / "draft", vocab_size=40, hidden=16, seed=1, logit_scale=4.0)
    return Pipeline.load(target, draft)


def run(pipeline, sampling=SAMPLED, **options):
    return pipeline.generate(PROMPT, DecodeOptions(max_tokens=30, eos_token_id=-1, **options), sampling)


def textbook_speculative_decoding(target, draft, prompt, k, sampling, max_tokens):
    """Speculative decoding written the plain way, as an oracle for the runtime's loop: no
    KV cache reuse (every forward runs over the whole sequence), no worker, no speculator
    or verifier; only the reference ops and the same keyed randomness."""
    def logits_of(engine, ids):
        return engine.forward(engine.new_cache(len(ids)), torch.tensor(ids), torch.arange(len(ids)))

    ids, sampling = list(prompt), sampling.with_seed()  # greedy decoding uses no uniform
    while len(ids) - len(prompt) < max_tokens:
        verified = min(k, max_tokens - (len(ids) - len(prompt)) - 1)
        drafts, qs = [], []
        for _ in range(verified):
            token, q = pick_tokens(logits_of(draft, ids + drafts)[-1], sampling, None, torch.tensor(len(ids + drafts)))
            drafts.append(int(token))
            qs.append(q)
        rows = logits_of(target, ids + drafts)[len(ids) - 1:]
        positions = torch.arange(len(ids), len(ids) + verified)
        uniforms = torch.cat((keyed_uniforms(sampling.seed, ACCEPT_STREAM, positions),
                              keyed_uniforms(sampling.seed, BONUS_STREAM, [len(ids)])))
        accepted, bonus = fused_verify(rows, torch.tensor(drafts, dtype=torch.int64),
                                       torch.stack(qs) if qs and not sampling.greedy else None, uniforms,
                                       sampling.temperature, sampling.top_k, sampling.top_p)
        ids += drafts[:int(accepted)] + [int(bonus)]
    return ids[len(prompt):]


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_speculative_decoding_and_ssd_without_prespeculation_match_the_textbook_loop(pipeline, sampling):
    expected = textbook_speculative_decoding(pipeline.target, pipeline.draft, PROMPT, 3, sampling, 30)
    sd = run(pipeline, sampling, mode="speculative", num_draft_tokens=3)
    ssd_off = run(pipeline, sampling, mode="ssd", num_draft_tokens=3, prespeculate=False)
    zero_fanout = run(pipeline, sampling, mode="ssd", num_draft_tokens=3, fanout=(0,))
    for generation in (sd, ssd_off, zero_fanout):
        assert generation.output_ids == expected
        assert generation.stats.cache_hits == generation.stats.cache_misses == 0
    assert ssd_off.stats.accepted_histogram == sd.stats.accepted_histogram


def test_an_all_zero_fanout_means_no_prespeculation(tiny_engines):
    """A fan-out placing no branch is speculative decoding, on every engine (ONNX Runtime
    used to fail on the empty branch tensors)."""
    assert not DecodeOptions(fanout=(0,)).prespeculating and DecodeOptions(fanout=(1, 0, 0, 0, 0)).prespeculating
    engines = Pipeline.load(engines=tiny_engines)
    prompt = engines.encode("The with statement")
    sd = engines.generate(prompt, DecodeOptions(mode="speculative", max_tokens=24, eos_token_id=-1), SamplingParams())
    for fanout in ((0,), (0, 0, 0, 0, 0)):
        ssd = engines.generate(prompt, DecodeOptions(fanout=fanout, max_tokens=24, eos_token_id=-1), SamplingParams())
        assert ssd.output_ids == sd.output_ids and ssd.stats.cache_hits == ssd.stats.cache_misses == 0


@pytest.mark.parametrize("branching", [dict(fanout=(2,)), dict(budget=6), dict(fanout=(3,), saguaro_factor=0.5)])
def test_ssd_samples_exactly_what_speculative_decoding_samples(tiny_pair, branching):
    """Randomness is keyed by position, so a hit branch holds the very draft a miss would
    have drafted: pre-speculation changes the speed, never the sampled text."""
    tiny = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    prompt, sampling = tiny.encode("The with statement"), SamplingParams(temperature=0.7, seed=5)

    def run_tiny(mode):
        return tiny.generate(prompt, DecodeOptions(mode=mode, num_draft_tokens=3, max_tokens=64, eos_token_id=-1,
                                                   **branching), sampling)

    sd, ssd = run_tiny("speculative"), run_tiny("ssd")
    assert ssd.output_ids == sd.output_ids
    assert ssd.stats.accepted_histogram == sd.stats.accepted_histogram
    assert ssd.stats.cache_hits > 0


def test_saguaro_sampling_samples_the_same_text_whatever_the_budget(tiny_pair):
    """Saguaro rescales a fixed number of the draft's tokens, so q (and the text for a seed)
    does not depend on the fan-out or budget; only the speed does."""
    tiny = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    prompt, sampling = tiny.encode("The with statement"), SamplingParams(temperature=0.7, seed=5)
    texts = {}
    for name, branching in [("speculative", dict(mode="speculative")), ("fanout 1", dict(fanout=(1,))),
                            ("fanout 3", dict(fanout=(3,))), ("budget 8", dict(budget=8)),
                            ("budget auto", dict(budget="auto"))]:
        options = DecodeOptions(**{"mode": "ssd", **branching}, num_draft_tokens=3, max_tokens=48,
                                eos_token_id=-1, saguaro_factor=0.5)
        texts[name] = tiny.generate(prompt, options, sampling).output_ids
    assert all(ids == texts["speculative"] for ids in texts.values()), texts
    plain = tiny.generate(prompt, DecodeOptions(mode="speculative", num_draft_tokens=3, max_tokens=48,
                                                eos_token_id=-1), sampling).output_ids
    assert plain != texts["speculative"], "Saguaro sampling should change q, and so the text"


def test_a_fanout_wider_than_the_vocabulary_is_capped(tmp_path):
    target = make_checkpoint(tmp_path / "target", vocab_size=6, hidden=32, seed=0, logit_scale=3.0)
    draft = make_checkpoint(tmp_path / "draft", vocab_size=6, hidden=16, seed=1, logit_scale=3.0)
    small = Pipeline.load(target, draft)
    sampling = SamplingParams(temperature=1.0, seed=3)
    expected = small.generate([1, 2], DecodeOptions(mode="speculative", num_draft_tokens=2, max_tokens=20,
                                                    eos_token_id=-1), sampling).output_ids
    for branching in (dict(fanout=(8,)), dict(budget="auto"), dict(budget=30)):
        generation = small.generate([1, 2], DecodeOptions(num_draft_tokens=2, max_tokens=20, eos_token_id=-1,
                                                          **branching), sampling)
        assert generation.output_ids == expected
        if "fanout" in branching:  # capped at every depth, it covers every outcome
            assert generation.stats.cache_misses == 0 and generation.stats.cache_hits > 0


@pytest.mark.parametrize("k", [7, 8])
def test_plain_speculative_decoding_runs_at_the_engines_largest_k(tiny_engines, k):
    engines = Pipeline.load(engines=tiny_engines)
    prompt = engines.encode("The with statement")
    greedy = engines.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=24), SamplingParams())
    sd = engines.generate(prompt, DecodeOptions(mode="speculative", num_draft_tokens=k, max_tokens=24),
                          SamplingParams())
    assert sd.output_ids == greedy.output_ids


def test_unseeded_sampling_draws_a_fresh_seed_and_reports_it(pipeline):
    unseeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
    first, second = run(pipeline, unseeded, mode="ssd", num_draft_tokens=2), run(pipeline, unseeded, mode="ssd",
                                                                                 num_draft_tokens=2)
    assert first.seed is not None and second.seed is not None and first.seed != second.seed
    assert first.output_ids != second.output_ids
    replay = run(pipeline, SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=first.seed),
                 mode="ssd", num_draft_tokens=2)
    assert replay.output_ids == first.output_ids and replay.seed == first.seed
    assert run(pipeline, SAMPLED, mode="ssd", num_draft_tokens=2).seed == SAMPLED.seed


def test_k_zero_is_autoregressive_decoding(pipeline):
    for sampling in (SamplingParams(), SAMPLED):
        ar = run(pipeline, sampling, mode="autoregressive")
        for mode in ("speculative", "ssd"):
            k0 = run(pipeline, sampling, mode=mode, num_draft_tokens=0)
            assert k0.output_ids == ar.output_ids
            assert k0.stats.rounds == len(ar.output_ids) - 1  # the first token comes with the prefill


def test_seeded_sampling_is_deterministic_and_seed_dependent(pipeline):
    first = run(pipeline, mode="ssd", num_draft_tokens=2, saguaro_factor=0.5)
    again = run(pipeline, mode="ssd", num_draft_tokens=2, saguaro_factor=0.5)
    other = run(pipeline, SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=12),
                mode="ssd", num_draft_tokens=2, saguaro_factor=0.5)
    assert first.output_ids == again.output_ids
    assert first.output_ids != other.output_ids


def test_cancellation_and_streaming_callback(pipeline):
    streamed = []
    generation = pipeline.generate(PROMPT, DecodeOptions(max_tokens=30, eos_token_id=-1), SAMPLED,
                                   on_tokens=streamed.append, cancelled=lambda: len(streamed) >= 2)
    assert generation.finish_reason == "cancelled"
    assert sum(streamed, []) == generation.output_ids and len(streamed) == 2


@pytest.mark.parametrize("make, message", [
    (lambda: DecodeOptions(num_draft_tokens=-1), "num_draft_tokens"),
    (lambda: DecodeOptions(mode="beam"), "decoding mode"),
    (lambda: DecodeOptions(max_tokens=0), "max_tokens"),
    (lambda: DecodeOptions(num_draft_tokens=2, fanout=(1, 2)), "fanout"),
    (lambda: DecodeOptions(saguaro_factor=1.5), "saguaro"),
    (lambda: DecodeOptions(budget="many"), "budget"),
    (lambda: DecodeOptions(budget=0), "budget"),
    (lambda: SamplingParams(temperature=-0.1), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.2), "top_p"),
    (lambda: SamplingParams(top_k=-3), "top_k"),
    (lambda: SamplingParams(seed=-1), "seed"),
    (lambda: DecodeOptions(saguaro_factor=0.5, saguaro_top=0), "saguaro top"),
])
def test_bad_options_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_prompts_are_named(pipeline):
    options = DecodeOptions()
    with pytest.raises(RequestError, match="empty"):
        pipeline.generate([], options, SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        pipeline.encode("")
    with pytest.raises(RequestError, match="does not fit the context"):
        pipeline.generate([5] * pipeline.max_context, options, SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        pipeline.generate([5, 4000], options, SamplingParams())


def test_mismatched_pairs_are_refused(tmp_path, pipeline):
    other_vocab = make_checkpoint(tmp_path / "v48", vocab_size=48)
    with pytest.raises(CheckpointError, match="vocab_size 48 differs"):
        Pipeline.load(pipeline.target.info.path, other_vocab)
    other_words = make_checkpoint(tmp_path / "words", vocab_size=40, word_prefix="z")
    with pytest.raises(CheckpointError, match="tokenizer"):
        Pipeline.load(pipeline.target.info.path, other_words)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2' is not supported \(supported: llama, mistral, qwen2, qwen3\)"):
        Pipeline.load(pipeline.target.info.path, tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match="does not exist"):
        Pipeline.load(pipeline.target.info.path, tmp_path / "nowhere")


def generate_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_json_contract(tiny_pair):
    result = generate_cli("--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"),
                          "--mode", "ssd", "-k", "3", "--fixed-k", "--fanout", "2", "--prompt", "The with statement",
                          "--max-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert {"prompt_ids", "output_ids", "text", "stats"} <= output.keys()
    assert 0 < len(output["output_ids"]) <= 12 and output["stats"]["tokens"] == len(output["output_ids"])
    # every round but the last looks its outcome up in the speculation cache
    assert output["stats"]["cache_hits"] + output["stats"]["cache_misses"] == output["stats"]["rounds"] - 1


@pytest.mark.parametrize("args, message", [
    (["--num-draft-tokens", "-1"], "num_draft_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--prompt", ""], "prompt is empty"),
    (["--fanout", "x"], "--fanout"),
    (["--mode", "ssd", "--compare", "ssd"], "--compare ssd: that is the --mode being run"),
    (["--compare", "autoregressive", "--repeats", "0"], "--repeats must be at least 1"),
])
def test_cli_rejects_bad_input_with_exit_code_2(tiny_pair, args, message):
    result = generate_cli("--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"), *args)
    assert result.returncode == 2 and message in result.stderr


def test_cli_compares_two_modes_in_one_process_and_checks_their_tokens(tiny_pair):
    result = generate_cli("--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"),
                          "--mode", "ssd", "--prompt", "The with statement", "--max-tokens", "12",
                          "--compare", "autoregressive", "--repeats", "2", "--json")
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    comparison, (generation,) = output["comparison"], output["generations"]
    assert generation["stats"]["mode"] == "ssd" and comparison["repeats"] == 2
    assert comparison["same_tokens"] is True  # greedy SSD is the target's own output
    speeds = comparison["tokens_per_s"]
    assert speeds["ssd"] > 0 and speeds["autoregressive"] > 0
    assert comparison["ratio"] == pytest.approx(speeds["ssd"] / speeds["autoregressive"], rel=1e-3)
    human = generate_cli("--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"),
                         "--mode", "ssd", "--prompt", "The with statement", "--max-tokens", "12",
                         "--compare", "autoregressive", "--repeats", "1")
    assert human.returncode == 0, human.stderr
    assert "[compare] ssd" in human.stdout and "the same tokens" in human.stdout


def test_a_comparison_runs_each_mode_untimed_first_then_turns_the_order_and_sums_the_runs():
    """Neither mode always runs first (a shared machine's speed drifts), and neither is timed
    on its first run (an engine's first forwards cost more)."""
    calls, clock = [], iter(range(100))

    def generate(requests):
        calls.append(requests[0])
        return [SimpleNamespace(output_ids=[1] * (3 if requests[0] == "ssd" else 2))]

    with patch("saguaro.runtime.mode_comparison.time.perf_counter", lambda: float(next(clock))):
        comparison = compare_modes(generate, lambda options: [options.mode], DecodeOptions(mode="ssd"),
                                   DecodeOptions(mode="autoregressive"), repeats=3, greedy=False)
    assert calls == ["ssd", "autoregressive", "ssd", "autoregressive", "autoregressive", "ssd", "ssd",
                     "autoregressive"]
    assert comparison.first.tokens == 9 and comparison.second.tokens == 6
    assert comparison.first.seconds == comparison.second.seconds == 3  # each timed run: one tick
    assert comparison.ratio == pytest.approx(1.5) and comparison.same_tokens is None


def test_a_draft_scoring_part_of_the_vocabulary_samples_from_those_tokens_alone():
    """A reduced-vocabulary draft (its other logits UNSCORED): q over its tokens, spread
    with zeros elsewhere, is the whole row's distribution, and each token is the one the
    whole row's inverse CDF gives for the same uniform."""
    scored = torch.tensor([2, 5, 7, 11, 30, 49])
    logits = torch.full((3, 50), UNSCORED)
    logits[:, scored] = torch.randn(3, len(scored), generator=torch.Generator().manual_seed(1)) * 2
    positions = torch.arange(3) + 10
    for sampling in (SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.2, top_k=3, top_p=0.9, seed=4)):
        tokens, q = pick_tokens(logits, sampling, None, positions)
        assert q is not None and q.shape == logits.shape
        torch.testing.assert_close(q, logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p),
                                   rtol=1e-5, atol=1e-7)
        assert set(tokens.tolist()) <= set(scored.tolist()) and not q[:, [0, 1, 3, 48]].any()
        assert torch.equal(tokens, sample_from(q, keyed_uniforms(sampling.seed, DRAFT_STREAM, positions)))
