"""ONNX Runtime engines against the torch reference: forward, verify, branch plan, KV gather.

Tolerance: logits of an fp32 ORT engine agree with the eager torch engine to within
`ATOL` (measured: about 2e-7 on these models), and greedy choices are identical. The
fused verification and branch plan inside the graphs must give exactly the reference
op's outputs, for greedy and for sampling with fixed uniforms.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import BuildConfig
from saguaro.plugins.branch_draft.reference import commit_indices, plan_branches, step_mask
from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.runtime.core.contracts import Step
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.onnxruntime_engine import SCORED_INPUT
from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.pipeline import Pipeline

ATOL = 1e-4
K = 4
PROMPT = [1, 5, 9, 14, 3, 22, 7, 11, 6, 18, 4, 8]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=5, top_p=0.9)]


def engine_config(pair, precision="fp32", **limits) -> BuildConfig:
    return BuildConfig(name=f"test-{precision}", target=pair / "target", draft=pair / "draft",
                       precision=precision, max_draft_tokens=8, max_branches=16, max_context=128, **limits)


@pytest.fixture(scope="session")
def fp32_engines(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "fp32"
    build_engines(engine_config(tiny_pair), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def engines(fp32_engines):
    return load_engine_pair(fp32_engines)


@pytest.fixture(scope="module")
def references(tiny_pair):
    return TorchEngine(tiny_pair / "target"), TorchEngine(tiny_pair / "draft")


def prefilled(engine, ids, capacity=128):
    cache = engine.new_cache(capacity)
    logits = engine.forward(cache, torch.tensor(ids), torch.arange(len(ids)))
    return cache, logits


def assert_same_logits(got, want):
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL, rtol=0), f"max diff {(got - want).abs().max():.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("role", [0, 1], ids=["target", "draft"])
def test_prefill_and_decode_match_torch(engines, references, role):
    ort_engine, torch_engine = engines[role], references[role]
    ort_cache, ort_logits = prefilled(ort_engine, PROMPT)
    torch_cache, torch_logits = prefilled(torch_engine, PROMPT)
    assert_same_logits(ort_logits, torch_logits)
    token = int(torch_logits[-1].argmax())
    for step in range(6):  # single-token decode, greedy
        position = torch.tensor([len(PROMPT) + step])
        got = ort_engine.forward(ort_cache, torch.tensor([token]), position)
        want = torch_engine.forward(torch_cache, torch.tensor([token]), position)
        assert_same_logits(got, want)
        token = int(want[0].argmax())
    assert ort_cache.length == torch_cache.length == len(PROMPT) + 6


def test_truncate_fork_and_gather_keep_the_right_entries(engines, references):
    (ort_engine, _), (torch_engine, _) = engines, references
    ort_cache, _ = prefilled(ort_engine, PROMPT)
    torch_cache, _ = prefilled(torch_engine, PROMPT)
    ort_twin, torch_twin = ort_cache.fork(), torch_cache.fork()
    ort_cache.truncate(7)
    torch_cache.truncate(7)
    tokens, positions = torch.tensor([4, 9]), torch.tensor([7, 8])
    assert_same_logits(ort_engine.forward(ort_cache, tokens, positions),
                       torch_engine.forward(torch_cache, tokens, positions))
    assert ort_twin.length == len(PROMPT)  # the fork did not follow the truncation
    for cache in (ort_twin, torch_twin):  # a target cache gathers without a GatherKV graph
        cache.gather(3, torch.tensor([5, 8, 10]))
    tokens, positions = torch.tensor([2]), torch.tensor([11])
    assert_same_logits(ort_engine.forward(ort_twin, tokens, positions),
                       torch_engine.forward(torch_twin, tokens, positions))
    with pytest.raises(ValueError, match="truncate"):
        ort_cache.truncate(ort_cache.length + 1)


def greedy_continuation(engine, cache, token: int, position: int, count: int) -> torch.Tensor:
    cache, tokens = cache.fork(), []
    for step in range(count):
        token = int(engine.forward(cache, torch.tensor([token]), torch.tensor([position + step]))[-1].argmax())
        tokens.append(token)
    return torch.tensor(tokens)


@pytest.mark.parametrize("rejected_at", [0, 2, K])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "t0.8", "t1.2-k5-p0.9"])
def test_verify_matches_the_reference_op(engines, references, rejected_at, sampling):
    """The K+1 verify graph (forward + FusedVerify) returns the reference op's (a, t)."""
    (ort_engine, _), (torch_engine, _) = engines, references
    ort_cache, _ = prefilled(ort_engine, PROMPT[:-1])
    torch_cache, _ = prefilled(torch_engine, PROMPT[:-1])
    start, last = len(PROMPT) - 1, PROMPT[-1]
    drafts = greedy_continuation(torch_engine, torch_cache, last, start, K)
    if rejected_at < K:
        drafts[rejected_at] = (drafts[rejected_at] + 1) % torch_engine.info.vocab_size
    tokens, positions = torch.cat((torch.tensor([last]), drafts)), torch.arange(start, start + K + 1)
    target_logits = torch_engine.forward(torch_cache.fork(), tokens, positions)
    generator = torch.Generator().manual_seed(rejected_at)
    for _ in range(4):
        q = torch.softmax(torch.randn(K, target_logits.shape[-1], generator=generator) * 3, -1)
        uniforms = torch.rand(K + 1, generator=generator)
        want = fused_verify(target_logits, drafts, q, uniforms, sampling.temperature, sampling.top_k, sampling.top_p)
        got = ort_engine.verify(ort_cache.fork(), tokens, positions, drafts, None if sampling.greedy else q,
                                uniforms, sampling)
        assert (got.accepted, got.bonus) == (int(want[0]), int(want[1]))
    if sampling.greedy:
        assert got.accepted == rejected_at


def test_verify_appends_k_plus_1_entries_and_rejects_too_long_drafts(engines):
    cache, _ = prefilled(engines[0], PROMPT[:-1])
    drafts = torch.tensor([3, 4, 5])
    engines[0].verify(cache, torch.tensor([PROMPT[-1], 3, 4, 5]), torch.arange(11, 15), drafts, None,
                      torch.rand(4), SamplingParams())
    assert cache.length == len(PROMPT) + 3
    with pytest.raises(ValueError, match="max_draft_tokens 8"):
        engines[0].verify(cache, torch.zeros(10, dtype=torch.int64), torch.arange(10),
                          torch.zeros(9, dtype=torch.int64), None, torch.rand(10), SamplingParams())


def test_branch_plan_tree_forwards_and_commit_match_torch(engines, references):
    """Pre-speculation as the speculator runs it: glue, plan, K tree steps, commit a branch."""
    draft, reference = engines[1], references[1]
    context = len(PROMPT)
    ort_cache, _ = prefilled(draft, PROMPT)
    torch_cache, logits = prefilled(reference, PROMPT)
    drafts = torch.tensor([7, 3, 12, 5])
    for cache, engine in ((ort_cache, draft), (torch_cache, reference)):  # d_1..d_K (d_K is the glue)
        scores = engine.forward(cache, drafts, torch.arange(context, context + K))
    scores = torch.cat((logits[-1:], scores))
    fanout = torch.tensor([3, 2, 0, 1, 2])
    plan = draft.plan_branches(scores, drafts, fanout, context)
    want = plan_branches(scores, drafts, fanout, context)
    for name in ("depth", "token", "rank", "positions", "window_mask"):
        assert torch.equal(getattr(plan, name), getattr(want, name)), name
    fed = plan.token
    for step in range(K):
        mask = step_mask(plan.window_mask, context, step, plan.branches, K)
        got = draft.forward(ort_cache, fed, plan.positions[step], mask)
        expected = reference.forward(torch_cache, fed, plan.positions[step], mask)
        assert_same_logits(got, expected)
        fed = expected.argmax(-1)
    branch = 3  # a depth-1 key: d_1 accepted, then the branch's token
    sources = commit_indices(context, K, plan.branches, branch, K)
    for cache in (ort_cache, torch_cache):
        cache.gather(context + int(plan.depth[branch]), sources)
    assert ort_cache.length == torch_cache.length == context + 1 + K
    after = torch.tensor([int(fed[branch])]), torch.tensor([context + 1 + K])
    assert_same_logits(draft.forward(ort_cache, *after), reference.forward(torch_cache, *after))


def test_branch_plan_rejects_more_branches_than_built(engines):
    with pytest.raises(ValueError, match="max_branches 16"):
        engines[1].plan_branches(torch.randn(K + 1, 20), torch.arange(K), torch.full((K + 1,), 4), 10)


def test_ssd_over_ort_engines_is_token_identical_to_target_greedy(fp32_engines, tiny_pair):
    reference = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    compiled = Pipeline.load(engines=fp32_engines)
    hits = 0
    for prompt in (PROMPT, PROMPT[:3], [1]):
        want = reference.generate(prompt, DecodeOptions(mode="autoregressive", max_tokens=20), SamplingParams())
        for options in (DecodeOptions(mode="ssd", num_draft_tokens=3, fanout=(3,), max_tokens=20),
                        DecodeOptions(mode="speculative", num_draft_tokens=K, max_tokens=20),
                        DecodeOptions(mode="autoregressive", max_tokens=20)):
            got = compiled.generate(prompt, options, SamplingParams())
            assert got.output_ids == want.output_ids, options
            hits += got.stats.cache_hits
    assert hits > 0, "the hit path (KV gather of a committed branch) was never exercised"


def test_seeded_sampling_over_ort_engines_matches_torch_engines(fp32_engines, tiny_pair):
    """Same seed, same uniforms: with logits equal to ~1e-7, every accept/reject test and
    inverse-CDF draw lands the same way, so the sampled tokens match too."""
    reference = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    compiled = Pipeline.load(engines=fp32_engines)
    sampling = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=7)
    options = DecodeOptions(mode="ssd", num_draft_tokens=3, fanout=(2,), saguaro_factor=0.5, max_tokens=16)
    for prompt in (PROMPT, PROMPT[:4]):
        want = reference.generate(prompt, options, sampling)
        assert compiled.generate(prompt, options, sampling).output_ids == want.output_ids


@pytest.mark.parametrize("precision, bits", [("int8", 8), ("int4", 4), ("w8a8", 8)])
def test_quantised_builds_load_and_run(tiny_pair, tmp_path, precision, bits):
    out = tmp_path / precision
    build_engines(engine_config(tiny_pair, precision), out, show_progress=False)
    graph = onnx.load(str(out / "target" / "model.onnx")).graph
    assert not [node for node in graph.node if node.op_type == "MatMul"]
    if precision == "w8a8":
        weights = {tensor.name: tensor for tensor in graph.initializer}
        integer = [node for node in graph.node if node.op_type == "MatMulInteger"]
        # uint8 weights around 128 (u8 x u8): MLAS's u8 x s8 kernel saturates on x86 CPUs without VNNI
        assert integer and all(weights[node.input[1]].data_type == onnx.TensorProto.UINT8 and len(node.input) == 4
                               for node in integer)
    else:
        quantised = [node for node in graph.node if node.op_type == "MatMulNBits"]
        assert quantised and all(onnx.helper.get_attribute_value(a) == bits
                                 for n in quantised for a in n.attribute if a.name == "bits")
    pipeline = Pipeline.load(engines=out)
    generation = pipeline.generate(PROMPT, DecodeOptions(mode="ssd", num_draft_tokens=3, max_tokens=12),
                                   SamplingParams())
    assert len(generation.output_ids) == 12 or generation.finish_reason == "eos"
    assert all(0 <= t < pipeline.target.info.vocab_size for t in generation.output_ids)


def test_stripped_tensorrt_graphs_pass_the_checker_and_name_their_plugins(tiny_pair, tmp_path):
    """What TensorRT's parser gets: plugin nodes with their attributes, no function bodies."""
    from saguaro.compiler.builder import export_model, inspect_checkpoint
    from saguaro.compiler.tensorrt_builder import strip_plugin_functions

    config = engine_config(tiny_pair, backend="tensorrt")
    expected = {("target", "verify"): {"FusedVerify"}, ("draft", "branch_draft"): {"BranchDraft"}}
    paths = {role: export_model(config, inspect_checkpoint(role, tiny_pair / role), tmp_path / role, tmp_path / "work")
             for role in ("target", "draft")}
    for (role, stem), plugins in expected.items():
        stripped = strip_plugin_functions(onnx.load(str(paths[role][stem])))  # weights inline
        onnx.checker.check_model(stripped)
        assert not [f.name for f in stripped.functions if f.domain == "saguaro"]
        nodes = [node for node in stripped.graph.node if node.domain == "saguaro"]
        assert {node.op_type for node in nodes} == plugins
        for node in nodes:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes["plugin_namespace"] == b"saguaro" and attributes["plugin_version"] == b"1"
            if node.op_type == "BranchDraft":
                assert attributes["max_branches"] == 16


@pytest.mark.parametrize("role", [0, 1], ids=["target", "draft"])
def test_a_batched_forward_gives_each_sequence_its_own_result(engines, references, role):
    """One ragged batch (own lengths, own query lengths, one tree-masked row, a gap of an
    idle slot between rows) equals each sequence run alone, on ONNX Runtime and torch;
    the idle slot's cache is untouched."""
    for engine in (engines[role], references[role]):
        contexts = [PROMPT, PROMPT[:3], PROMPT[:7]]
        caches = [prefilled(engine, ids)[0] for ids in contexts]
        idle = caches.pop(1)
        idle_entries = engine.pool.entries(idle.slot).copy()
        tree = torch.ones(3, len(PROMPT[:7]) + 3, dtype=torch.bool)
        tree[1, -3], tree[2, -2] = False, False
        steps = [Step(caches[0], torch.tensor([4, 6]), torch.tensor([12, 13])),
                 Step(caches[1], torch.tensor([9, 9, 2]), torch.tensor([7, 7, 8]), tree)]
        alone = []
        for step in steps:
            twin = step.cache.fork()
            alone.append(engine.forward(twin, step.tokens, step.positions, step.mask))
        for got, want in zip(engine.forward_batch(steps), alone):
            assert_same_logits(got, want)
        assert (engine.pool.entries(idle.slot) == idle_entries).all()
        assert [cache.length for cache in caches] == [len(PROMPT) + 2, 7 + 3]


@pytest.mark.parametrize("role", [0, 1], ids=["target", "draft"])
def test_a_last_only_step_is_scored_alone_beside_full_ones(engines, role):
    """In one batch with a full step, a `last_only` step (a prefill, a draft's sync) gets
    its last row's logits only, the same row as when every row is scored, and the full
    step all its rows; the graph computes the lm_head for the asked rows only."""
    engine = engines[role]
    assert SCORED_INPUT in {graph_input.name for graph_input in engine.sessions["model"].get_inputs()}
    syncing, verifying = (prefilled(engine, ids)[0] for ids in (PROMPT[:5], PROMPT[:8]))
    twins = [syncing.fork(), verifying.fork()]
    sync_tokens, verify_tokens = torch.tensor([3, 8, 2, 6]), torch.tensor([4, 6, 1])
    got = engine.forward_rows([Step(syncing, sync_tokens, torch.arange(5, 9), last_only=True),
                               Step(verifying, verify_tokens, torch.arange(8, 11))])
    want = engine.forward_rows([Step(twins[0], sync_tokens, torch.arange(5, 9)),
                                Step(twins[1], verify_tokens, torch.arange(8, 11))])
    assert got[0].logits.shape == (1, want[0].logits.shape[-1]) and want[0].logits.shape[0] == 4
    assert_same_logits(got[0].logits, want[0].logits[-1:])
    assert_same_logits(got[1].logits, want[1].logits)
    assert syncing.length == twins[0].length == 9


def test_per_token_int8_computes_what_it_promises():
    """w8a8: each row quantised by its own largest magnitude (round half to even, uint8
    around 128), the weight by each column's, integer sums scaled back: the graph's result
    equals that computed in numpy to float rounding, and is close to the fp32 product."""
    from saguaro.compiler.fused_export import finished_model
    from saguaro.compiler.graph_writer import GraphWriter
    from saguaro.compiler.quantization import per_token_int8

    generator = np.random.default_rng(0)
    weight = generator.standard_normal((48, 24)).astype(np.float32)
    weight[:, 3] = 0  # a column of zeros keeps a usable scale
    rows = generator.standard_normal((2, 3, 48)).astype(np.float32)
    rows[1, 2] = 0  # so does a row of zeros
    g = GraphWriter()
    g.node("MatMul", ["x", g.constant("w", weight)], ["y"])
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 48])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 24])
    model = per_token_int8(finished_model(g, "one_matmul", [x], [y]))
    assert {node.op_type for node in model.graph.node} >= {"QuantizeLinear", "MatMulInteger"}
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": rows})[0]

    row_scale = np.maximum(np.abs(rows).max(-1, keepdims=True) / np.float32(127), np.float32(1e-30))
    column_scale = np.abs(weight).max(0) / 127
    column_scale[column_scale == 0] = 1
    integer_rows = np.round(rows / row_scale).astype(np.int64)
    integer_weight = np.round(weight / column_scale).astype(np.int64)
    want = (integer_rows @ integer_weight).astype(np.float32) * row_scale * column_scale.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got - rows @ weight).max() < 0.03 * np.abs(rows @ weight).max()
    assert not got[1, 2].any() and not got[..., 3].any()
