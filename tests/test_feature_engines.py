"""ONNX Runtime feature drafts (an EAGLE-3 head) against the torch reference.

A pair built with a feature head for its draft: the target's model graph also returns the
head's feature layers (`hidden_states`), which must be the torch target's `Features`; the
head's graph must compute `FeatureHead.forward_packed` (logits over the target vocabulary,
`UNSCORED` outside the head's, and its own `hidden_out`), its `project` graph the head's
fc. Greedy SD and SSD over the pair give the target's own tokens, and the draft is fed what
the torch pair's is fed (the features flow the same way). int8 and int4 builds load and
decode.
Tolerance as in test_export_ort.py.
"""
import dataclasses
import json

import onnx
import pytest
import torch
from checkpoints import build_engines_cli, random_head
from torch_calls import KEEPS_THE_GIL, TorchCalls

from saguaro.compiler import fused_export
from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import BuildConfig, ConfigError
from saguaro.runtime.core.contracts import Step, VerifyStep
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import UNSCORED, SamplingParams
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.onnxruntime_engine import OnnxRuntimeEngine, OnnxRuntimeFeatureDraft
from saguaro.runtime.engines.torch_engine import TorchEngine, TorchFeatureDraft
from saguaro.runtime.models.checkpoint import load_checkpoint
from saguaro.runtime.pipeline import Pipeline

ATOL = 1e-4
K = 4
MAX_BRANCHES = 16  # SSD below fans 3 branches out at each of K + 1 depths
PROMPT = [1, 5, 9, 14, 3, 22, 7, 11, 6, 18, 4, 8]
PROMPTS = ["The with statement", "A class definition defines", "Exceptions are raised", "x"]
GREEDY = SamplingParams()


def feature_config(pair, head_dir, precision: str = "fp32", **settings) -> BuildConfig:
    return BuildConfig(name=f"features-{precision}", target=pair / "target", draft=head_dir, precision=precision,
                       max_draft_tokens=K, max_branches=MAX_BRANCHES, max_context=64, max_batch=4, **settings)


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    return random_head(tiny_pair / "target", tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def fp32_dir(tiny_pair, head_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("feature_engines") / "fp32"
    build_engines(feature_config(tiny_pair, head_dir), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def engines(fp32_dir):
    return load_engine_pair(fp32_dir)


@pytest.fixture(scope="module")
def references(tiny_pair, head_dir):
    target = TorchEngine(tiny_pair / "target")
    return target, TorchFeatureDraft(head_dir, target)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL, rtol=0), f"max diff {(got - want).abs().max():.2e}"


def test_the_manifest_records_the_feature_layers_and_the_heads_shape(fp32_dir, engines, references):
    target, draft = engines
    head = references[1].head
    models = json.loads((fp32_dir / "manifest.json").read_text())["models"]
    assert models["target"]["feature_layers"] == list(head.shape.feature_layers)
    assert models["draft"]["kind"] == "feature_head"
    assert models["draft"]["shape"] == json.loads(json.dumps(dataclasses.asdict(head.shape)))
    assert set(models["draft"]["graphs"]) == {"model", "project", "branch_draft"}
    assert type(target) is OnnxRuntimeEngine and isinstance(draft, OnnxRuntimeFeatureDraft)
    assert target.info.feature_layers == head.shape.feature_layers and not target.info.reads_features
    assert draft.info.reads_features and draft.info.feature_layers == ()
    assert draft.hidden_size == head.shape.hidden_size
    assert draft.info.eos_token_ids == target.info.eos_token_ids


def test_without_a_feature_head_the_target_graph_is_unchanged(tiny_pair):
    """The features are one Concat and one output more; nothing else in the graph moves."""
    checkpoint = load_checkpoint(tiny_pair / "target")
    state = dict(checkpoint.model.state_dict())
    plain = fused_export.model_graph(checkpoint.shape, state, "fp32", 64).graph
    featured = fused_export.model_graph(checkpoint.shape, state, "fp32", 64, (0, 2, 1)).graph
    assert [o.name for o in plain.output] == ["logits"] + [f"present_{kind}.{layer}" for layer in range(2)
                                                           for kind in ("key", "value")]
    assert [o.name for o in featured.output if o.name != "hidden_states"] == [o.name for o in plain.output]
    assert [n.op_type for n in featured.node] == [n.op_type for n in plain.node] + ["Concat"]


def test_the_targets_hidden_states_are_its_features(engines, references):
    """Prefill, one-token steps (GQA's padded path) and a verify: the rows' hidden states
    are the torch target's features at the head's layers; a verify keeps the committed rows."""
    (target, _), (reference, _) = engines, references
    ort_cache, torch_cache = target.new_cache(64), reference.new_cache(64)
    steps = [(PROMPT, 0)] + [([token], len(PROMPT) + i) for i, token in enumerate([3, 17, 2])]
    for tokens, start in steps:
        positions = torch.arange(start, start + len(tokens))
        (got,) = target.forward_rows([Step(ort_cache, torch.tensor(tokens), positions)])
        (want,) = reference.forward_rows([Step(torch_cache, torch.tensor(tokens), positions)])
        assert_close(got.logits, want.logits)
        assert_close(got.hidden, want.hidden)
    start = len(PROMPT) + 3
    drafts = torch.tensor([5, 6, 7])
    verify = [VerifyStep(Step(cache, torch.tensor([9, 5, 6, 7]), torch.arange(start, start + 4)), drafts, None,
                         torch.rand(4), GREEDY) for cache in (ort_cache.fork(), torch_cache.fork())]
    (got,), (want,) = target.verify_batch(verify[:1]), reference.verify_batch(verify[1:])
    assert (got.accepted, got.bonus) == (want.accepted, want.bonus)
    assert got.hidden.shape[0] == got.accepted + 1
    assert_close(got.hidden, want.hidden)


def test_the_head_graph_computes_the_heads_forward(engines, references):
    """A fed prefill, steps fed the head's own features, and a step fed none (zeros): the
    same logits (UNSCORED in the same columns), hidden_out and projection as the torch head."""
    (_, draft), (_, reference) = engines, references
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(len(PROMPT), reference.head.shape.feature_width, generator=generator)
    assert_close(draft.project(features), reference.project(features))
    ort_cache, torch_cache = draft.new_cache(64), reference.new_cache(64)
    hidden = reference.project(features)
    steps = [(PROMPT, 0, hidden)]
    for step in range(3):
        steps.append(([4 + step], len(PROMPT) + step, None))
    previous = hidden
    for tokens, start, fed in steps:
        positions = torch.arange(start, start + len(tokens))
        fed_ort = fed if fed is not None or start == len(PROMPT) + 2 else previous[-1:]
        (got,) = draft.forward_rows([Step(ort_cache, torch.tensor(tokens), positions, hidden=fed_ort)])
        (want,) = reference.forward_rows([Step(torch_cache, torch.tensor(tokens), positions, hidden=fed_ort)])
        assert_close(got.logits, want.logits)
        assert torch.equal(got.logits == UNSCORED, want.logits == UNSCORED)
        assert (want.logits == UNSCORED).sum(-1).eq(reference.head.shape.vocab_size // 2).all()
        assert_close(got.hidden, want.hidden)
        previous = want.hidden
    with pytest.raises(TypeError, match="does not verify"):
        draft.verify_batch([])


def test_the_head_graph_scores_its_rows_and_the_engine_spreads_them(fp32_dir, engines, references):
    """The graph returns the head's `draft_vocab_size` scores per position (spreading them
    over the vocabulary inside the graph had been a third of a step); its metadata names
    each row's token, the head's `d2t` map, which the engine spreads them onto."""
    (_, draft), head = engines, references[1].head
    model = onnx.load(str(fp32_dir / "draft" / "model.onnx"), load_external_data=False)
    (logits,) = [output for output in model.graph.output if output.name == "logits"]
    assert logits.type.tensor_type.shape.dim[-1].dim_value == head.shape.draft_vocab_size < head.shape.vocab_size
    assert draft.scored_tokens is not None
    assert torch.equal(draft.scored_tokens, torch.arange(head.shape.draft_vocab_size) + head.d2t)
    scores = torch.randn(2, 3, head.shape.draft_vocab_size)
    spread = draft.spread(scores)
    assert torch.equal(spread[..., draft.scored_tokens], scores)
    assert int((spread == UNSCORED).sum()) == 2 * 3 * (head.shape.vocab_size - head.shape.draft_vocab_size)


@pytest.mark.parametrize("k", [1, K])
def test_greedy_sd_and_ssd_over_the_feature_pair_equal_the_target_alone(engines, k):
    pipeline = Pipeline(*engines)
    reference = DecodeOptions(mode="autoregressive", max_tokens=16)
    prompts = [pipeline.encode(prompt) for prompt in PROMPTS]
    expected = [pipeline.generate(ids, reference, GREEDY).output_ids for ids in prompts]
    for options in (DecodeOptions(mode="speculative", num_draft_tokens=k, max_tokens=16),
                    DecodeOptions(mode="ssd", num_draft_tokens=k, fanout=(3,), max_tokens=16)):
        got = pipeline.generate_batch([pipeline.request(ids, options, GREEDY) for ids in prompts])
        assert [g.output_ids for g in got] == expected, options
        assert sum(g.stats.cache_misses for g in got) > 0 or options.mode == "speculative"


class Recorder:
    """A draft engine that keeps what each of its steps was fed: tokens, positions, features."""

    def __init__(self, engine):
        self.engine, self.fed = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward_rows(self, steps):
        self.fed += [(step.tokens.tolist(), step.positions.tolist(), step.hidden.clone()) for step in steps]
        return self.engine.forward_rows(steps)


@pytest.mark.parametrize("mode", ["speculative", "ssd"])
def test_the_ort_draft_is_fed_what_the_torch_draft_is_fed(engines, references, mode):
    """Step by step, the same tokens at the same positions with the same features: the
    target's (projected) for committed tokens, the head's own for drafts and branches, so
    the ORT pair drafts what the torch pair drafts (greedy output alone would not show it:
    it is the target's whatever the draft reads)."""
    options = DecodeOptions(mode=mode, num_draft_tokens=K, fanout=(3,), max_tokens=12)
    fed = []
    for target, draft in (engines, references):
        recorder = Recorder(draft)
        pipeline = Pipeline(target, recorder)
        for prompt in PROMPTS[:2]:
            pipeline.generate(pipeline.encode(prompt), options, GREEDY)
        fed.append(recorder.fed)
    got, want = fed
    assert [(tokens, positions) for tokens, positions, _ in got] == [(t, p) for t, p, _ in want]
    for (_, _, got_features), (_, _, want_features) in zip(got, want):
        assert_close(got_features, want_features)
    assert len(got) > 10


def test_a_round_without_drafts_gives_the_targets_features_with_no_torch_call(engines):
    """A greedy round with nothing drafted, on a target that returns feature layers: its
    token and features are those of the same forward's rows, read from the graph's arrays
    with no torch call that would release the GIL (an SSD request keeps them for its
    draft at every round, drafting or not)."""
    from saguaro.runtime.decoding.speculator import empty_draft
    from saguaro.runtime.decoding.verifier import Verifier

    target, histories = engines[0], [PROMPT[:5], PROMPT[3:9]]
    verifiers = [Verifier(target, GREEDY, 0) for _ in histories]
    twins = [Verifier(target, GREEDY, 0).cache for _ in histories]
    target.forward_rows([verifier.prefill(ids[:-1]) for verifier, ids in zip(verifiers, histories)])  # all but `last`
    target.forward_rows([Step(cache, torch.tensor(ids[:-1]), torch.arange(len(ids) - 1))
                         for cache, ids in zip(twins, histories)])
    nothing = empty_draft(target.info.vocab_size, GREEDY)
    with TorchCalls() as calls:
        outcomes = target.verify_batch([verifier.round(ids, nothing, 0) for verifier, ids in zip(verifiers, histories)])
    assert set(calls.names) <= KEEPS_THE_GIL, calls.names
    rows = target.forward_rows([Step(cache, torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]))
                                for cache, ids in zip(twins, histories)])
    for outcome, row in zip(outcomes, rows):
        assert (outcome.accepted, outcome.bonus) == (0, int(row.logits[0].argmax()))
        assert_close(torch.from_numpy(outcome.hidden), row.hidden[:1])
    for verifier in verifiers:
        verifier.cache.release()
    for cache in twins:
        cache.release()


def graph_ops(path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("precision", ["int8", "int4", "w8a8"])
def test_quantised_feature_pairs_load_and_decode(tiny_pair, head_dir, tmp_path, precision):
    """int8 through the build script (as users build), int4 and w8a8 in process: the head's graphs
    are quantised, and greedy SSD gives that target's own tokens."""
    out = tmp_path / precision
    if precision == "int8":
        limits = ("--max-draft-tokens", str(K), "--max-branches", str(MAX_BRANCHES), "--max-context", "64")
        build_engines_cli(tiny_pair, out, "--precision", "int8", *limits, "--max-batch", "2", draft=head_dir)
    else:
        build_engines(feature_config(tiny_pair, head_dir, precision), out, show_progress=False)
    quantised_matmul = "MatMulInteger" if precision == "w8a8" else "MatMulNBits"
    for graph in ("model", "project"):
        assert quantised_matmul in graph_ops(out / "draft" / f"{graph}.onnx")
    pipeline = Pipeline(*load_engine_pair(out))
    assert isinstance(pipeline.draft, OnnxRuntimeFeatureDraft) and pipeline.target.info.feature_layers
    ssd = DecodeOptions(mode="ssd", num_draft_tokens=K, fanout=(2,), max_tokens=12)
    for prompt in PROMPTS[:2]:
        ids = pipeline.encode(prompt)
        alone = pipeline.generate(ids, DecodeOptions(mode="autoregressive", max_tokens=12), GREEDY).output_ids
        assert pipeline.generate(ids, ssd, GREEDY).output_ids == alone


def test_a_feature_head_is_built_for_onnxruntime_only(tiny_pair, head_dir, tmp_path):
    with pytest.raises(ConfigError, match="onnxruntime only"):
        build_engines(feature_config(tiny_pair, head_dir, "fp16", backend="tensorrt"), tmp_path / "out",
                      show_progress=False)
