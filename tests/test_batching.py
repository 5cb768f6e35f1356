"""Exactness does not depend on company: a request decoded in a batch, whatever else is in
it, joins or leaves, gives exactly what it gives alone (greedy tokens identical, seeded
samples identical), on torch engines and on ONNX Runtime engines at fp32 and int8, with
the load policy choosing greedy requests' K (sampled ones pin theirs); requests that stop at their end token stop
at the same token in a batch as alone."""
import dataclasses
import threading

import pytest
from checkpoints import build_small_engines
from torch_calls import KEEPS_THE_GIL, TorchCalls

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline

PROMPTS = ["The with statement", "A class definition defines", "x", "Exceptions are raised",
           "The import system", "In a for loop,", "Comparisons", "Lambda expressions are",
           "The del statement", "String literals are", "Boolean operations", "The pass statement"]
SETTINGS = [  # mode, K, branching, sampling, max_tokens: every kind of request in one batch
    # adapt_k: K per round from the load policy, which depends on the company; greedy
    # output does not depend on K, a seeded sampled request's does, so the sampled ones pin
    # their K (adapt_k off) and their seeds replay exactly
    (dict(mode="ssd", num_draft_tokens=4, fanout=(3,), adapt_k=True), SamplingParams(), 40),
    (dict(mode="speculative", num_draft_tokens=2), SamplingParams(temperature=0.8, seed=3), 25),
    (dict(mode="autoregressive"), SamplingParams(), 30),
    (dict(mode="ssd", num_draft_tokens=3, budget="auto"), SamplingParams(temperature=1.0, top_k=20, seed=9), 35),
    (dict(mode="ssd", num_draft_tokens=5, budget=6, saguaro_factor=0.5), SamplingParams(temperature=0.7, seed=1), 20),
    (dict(mode="autoregressive"), SamplingParams(temperature=0.9, top_p=0.9, seed=4), 45),
    (dict(mode="ssd", num_draft_tokens=1, fanout=(2, 2)), SamplingParams(), 15),
    (dict(mode="speculative", num_draft_tokens=6, adapt_k=True), SamplingParams(), 50),
]


def requests(pipeline, count: int, on_tokens=None):
    made = []
    for index in range(count):
        options, sampling, max_tokens = SETTINGS[index % len(SETTINGS)]
        prompt = pipeline.encode(PROMPTS[index % len(PROMPTS)])
        made.append(pipeline.request(prompt, DecodeOptions(**options, max_tokens=max_tokens, eos_token_id=-1),
                                     sampling, on_tokens=on_tokens))
    return made


@pytest.fixture(scope="module")
def int8_engines(tiny_pair, tmp_path_factory):
    """int8 engines of the tiny pair with 16 KV slots: a batch of 16 as the issue ran it."""
    return build_small_engines(tiny_pair, tmp_path_factory.mktemp("int8") / "engines", "batching-int8",
                               max_draft_tokens=8, max_branches=16, precision="int8", max_batch=16, max_context=256)


@pytest.fixture(scope="module", params=["torch", "onnxruntime", "onnxruntime-int8"])
def pipeline(request, tiny_pair, tiny_engines, int8_engines):
    if request.param == "torch":
        loaded = Pipeline.load(tiny_pair / "target", tiny_pair / "draft")
    else:
        loaded = Pipeline.load(engines=tiny_engines if request.param == "onnxruntime" else int8_engines)
    yield loaded
    loaded.close()


def alone(pipeline, request):
    return pipeline.submit(request).result().output_ids  # nothing else in flight


@pytest.mark.parametrize("count", [1, 3, 8, 12])  # 12: more than the KV slots, so some wait
def test_a_request_in_a_batch_gives_what_it_gives_alone(pipeline, count):
    batch = requests(pipeline, count)
    expected = [alone(pipeline, request) for request in batch]
    futures = [pipeline.submit(request) for request in batch]
    assert [future.result().output_ids for future in futures] == expected


def test_requests_joining_and_leaving_mid_flight_change_nothing(pipeline):
    first_round = threading.Event()
    early = requests(pipeline, 3, on_tokens=lambda tokens: first_round.set())
    late = requests(pipeline, 8)[3:]
    expected = [alone(pipeline, request) for request in early + late]
    first_round.clear()
    futures = [pipeline.submit(request) for request in early]
    assert first_round.wait(30)  # the early ones are decoding: the late ones join a running batch
    futures += [pipeline.submit(request) for request in late]
    assert [future.result().output_ids for future in futures] == expected


def test_a_cancelled_request_leaves_and_the_others_finish_unchanged(pipeline):
    batch = requests(pipeline, 4)
    expected = [alone(pipeline, request) for request in batch]
    stop = threading.Event()
    doomed = pipeline.request(pipeline.encode(PROMPTS[5]), DecodeOptions(max_tokens=200, eos_token_id=-1),
                              SamplingParams(), on_tokens=lambda tokens: stop.set(), cancelled=stop.is_set)
    futures = [pipeline.submit(doomed)] + [pipeline.submit(request) for request in batch]
    cancelled = futures[0].result()
    assert cancelled.finish_reason == "cancelled" and len(cancelled.output_ids) < 200
    assert [future.result().output_ids for future in futures[1:]] == expected


def test_requests_that_stop_at_their_end_token_stop_there_in_a_batch(pipeline):
    """Each request's end token is one it emits a third of the way in when nothing stops
    it: alone it stops there (finish reason eos), and in a batch of 8 exactly the same."""
    ending = []
    for request in requests(pipeline, 8):
        tokens = alone(pipeline, request)
        eos = tokens[len(tokens) // 3]
        options = dataclasses.replace(request.options, eos_token_id=eos)
        ending.append(pipeline.request(request.prompt_ids, options, request.sampling))
    expected = [pipeline.submit(request).result() for request in ending]
    for generation in expected:
        assert generation.finish_reason == "eos"
        assert generation.output_ids.index(generation.output_ids[-1]) == len(generation.output_ids) - 1
    futures = [pipeline.submit(request) for request in ending]
    got = [future.result() for future in futures]
    assert [(g.output_ids, g.finish_reason) for g in got] == [(g.output_ids, g.finish_reason) for g in expected]


def test_greedy_int8_output_is_the_same_alone_in_a_batch_of_16_and_autoregressive(int8_engines):
    """The issue's case: int8 engines, the default settings (the load policy picks each
    round's K), 16 greedy prompts at once; each gives what it gives alone, and what plain
    autoregressive decoding of the same engines gives."""
    pipeline = Pipeline.load(engines=int8_engines)
    try:
        prompts = [pipeline.encode(text) for text in (PROMPTS + PROMPTS[:4])]
        options = DecodeOptions(mode="ssd", num_draft_tokens=4, adapt_k=True, max_tokens=60, eos_token_id=-1)
        autoregressive = DecodeOptions(mode="autoregressive", max_tokens=60, eos_token_id=-1)
        expected = [pipeline.generate(prompt, autoregressive, SamplingParams()).output_ids for prompt in prompts]
        alone_ids = [pipeline.generate(prompt, options, SamplingParams()).output_ids for prompt in prompts]
        batch = pipeline.generate_batch([pipeline.request(prompt, options, SamplingParams()) for prompt in prompts])
        assert alone_ids == expected
        assert [generation.output_ids for generation in batch] == expected
    finally:
        pipeline.close()


def test_a_failing_round_observer_does_not_stop_the_decoding_thread(tiny_pair, caplog):
    """An observer (metrics, a test hook) that raises is logged; the scheduler thread runs on
    and every request completes with its output."""
    with Pipeline.load(tiny_pair / "target", tiny_pair / "draft") as loaded:
        made = requests(loaded, 3)
        expected = [alone(loaded, request) for request in made]

        def broken(batch, report):
            raise RuntimeError("observer broke")

        loaded.observe_rounds(broken)
        got = [future.result(timeout=120).output_ids for future in [loaded.submit(r) for r in requests(loaded, 3)]]
        assert got == expected
        assert "the round observer failed" in caplog.text


def test_a_slot_freed_by_a_round_is_filled_in_the_next_one(tiny_engines):
    """Requests of several lengths, more than the KV slots: once the batch was first full,
    no round runs with a slot empty while a request waits for one."""
    with Pipeline.load(engines=tiny_engines) as loaded:
        slots = loaded.max_active
        rounds = []  # (batch size, requests still waiting after it)
        reports = []  # each round's report, as its observer got it
        loaded.observe_rounds(lambda batch, report: (rounds.append((len(batch), loaded.queued)), reports.append(report)))
        made = [loaded.request(loaded.encode(PROMPTS[index % len(PROMPTS)]),
                               DecodeOptions(mode="autoregressive", max_tokens=3 + 2 * index, eos_token_id=-1),
                               SamplingParams()) for index in range(3 * slots)]
        loaded.generate_batch(made)
    first_full = next(index for index, (size, _) in enumerate(rounds) if size == slots)
    short = [(size, waiting) for size, waiting in rounds[first_full:] if size < slots and waiting]
    assert not short, f"rounds with a free slot while requests waited: {short}"
    # autoregressive rounds: one token verified per request, nothing drafted
    assert [(report.requests, report.verified_tokens) for report in reports] == [(size, size) for size, _ in rounds]
    assert not any(report.drafted for report in reports)


def test_a_ragged_batch_packs_row_by_slot_with_idle_rows_padding_and_masks():
    """Slots 0, 2 and 3 of a pool step (slot 1 idle): a causal step of 2 tokens after 3
    cached, a tree step with its own mask, and a prompt step that scores its last token
    only. Each row holds its tokens left-aligned; padded positions and the idle row see
    column 0 only."""
    import torch

    from saguaro.runtime.core.contracts import Step
    from saguaro.runtime.engines.batching import pack_steps
    from saguaro.runtime.engines.kv_cache import KVPool

    pool = KVPool(layers=1, kv_heads=1, head_dim=2, slots=4, capacity=16)
    caches = [pool.allocate(16) for _ in range(4)]
    caches[0].length, caches[2].length = 3, 1
    tree = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # two branches off one
    packed = pack_steps([
        Step(caches[2], torch.tensor([7, 8, 9]), torch.tensor([1, 2, 2]), mask=tree),
        Step(caches[0], torch.tensor([5, 6]), torch.tensor([3, 4])),
        Step(caches[3], torch.tensor([11, 12]), torch.tensor([0, 1]), last_only=True),
    ])
    assert packed.first_slot == 0 and packed.rows == [2, 0, 3] and packed.counts == [3, 2, 2]
    assert packed.input_ids.tolist() == [[5, 6, 0], [0, 0, 0], [7, 8, 9], [11, 12, 0]]
    assert packed.position_ids.tolist() == [[3, 4, 0], [0, 0, 0], [1, 2, 2], [0, 1, 0]]
    assert packed.seqlens_k.tolist() == [4, 0, 3, 1] and packed.query_seqlens.tolist() == [2, 0, 3, 2]
    assert packed.total_sequence_length == 5
    only_first = [True, False, False, False, False]
    assert packed.attention_mask.tolist() == [
        [[True] * 4 + [False], [True] * 5, only_first],
        [only_first] * 3,
        [row + [False] for row in tree.tolist()],
        [[True, False, False, False, False], [True, True, False, False, False], only_first],
    ]
    assert packed.scored == [3, 2, 1]
    assert packed.scored_positions.tolist() == [[0, 1, 0], [0, 0, 0], [0, 1, 2], [1, 0, 0]]


def test_a_greedy_round_without_drafts_makes_no_torch_call_that_waits_for_the_gil(tiny_engines):
    """Each torch call releases the GIL and waits to take it back: in the server, behind the
    threads that send responses, the tensors that rounds of autoregressive steps built anew
    (and read back) had cost the scheduler's thread more than the batch's forward. A greedy
    round without drafts, from the verifier's steps to the engine's outcomes, only reads
    tensors' lengths, shapes and values as lists; its tokens are the target's argmax."""
    import torch

    from saguaro.runtime.core.contracts import Step
    from saguaro.runtime.decoding.speculator import empty_draft
    from saguaro.runtime.decoding.verifier import Verifier

    pipeline = Pipeline.load(engines=tiny_engines)
    target, histories = pipeline.target, [[5, 9, 2, 7], [3, 4], [8, 1, 6]]
    try:
        verifiers = [Verifier(target, SamplingParams(), 0) for _ in histories]
        checks = [Verifier(target, SamplingParams(), 0).cache for _ in histories]
        nothing = empty_draft(target.info.vocab_size, SamplingParams())
        prompts = target.forward_rows([verifier.prefill(ids) for verifier, ids in zip(verifiers, histories)])
        for verifier, ids, rows in zip(verifiers, histories, prompts):
            ids.append(verifier.first_token(ids, nothing, rows.logits).bonus)
        target.forward_rows([Step(cache, torch.tensor(ids[:-1]), torch.arange(len(ids) - 1))
                             for cache, ids in zip(checks, histories)])
        for _ in range(2):  # the second round reuses the first one's tensors
            with TorchCalls() as calls:
                outcomes = target.verify_batch([verifier.round(ids, nothing, 0)
                                                for verifier, ids in zip(verifiers, histories)])
            assert set(calls.names) <= KEEPS_THE_GIL, calls.names
            rows = target.forward_rows([Step(cache, torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]))
                                        for cache, ids in zip(checks, histories)])
            assert [(outcome.accepted, outcome.bonus) for outcome in outcomes] == [
                (0, int(row.logits[0].argmax())) for row in rows]
            for ids, outcome in zip(histories, outcomes):
                ids.append(outcome.bonus)
    finally:
        pipeline.close()


def test_a_round_mixing_drafts_and_argmax_steps_costs_no_torch_call_per_argmax_step(tiny_engines):
    """Under the load policy a batch mixes requests that draft (a probe, say) with requests
    that take an autoregressive step: only the drafting rounds go through the FusedVerify
    graph, the others still read their argmax from the graph's arrays, so the torch calls
    that release the GIL do not grow with them; every outcome is the one verified alone."""
    import torch

    from saguaro.runtime.core.contracts import Draft
    from saguaro.runtime.decoding.speculator import empty_draft
    from saguaro.runtime.decoding.verifier import Verifier

    pipeline = Pipeline.load(engines=tiny_engines)
    target = pipeline.target
    nothing = empty_draft(target.info.vocab_size, SamplingParams())

    def verified(histories, batched: bool):
        verifiers = [Verifier(target, SamplingParams(), 0) for _ in histories]
        target.forward_rows([verifier.prefill(ids[:-1]) for verifier, ids in zip(verifiers, histories)])  # all but `last`
        drafted = Draft(torch.tensor([4, 4]), None, torch.zeros(2, target.info.vocab_size))
        rounds = [verifiers[0].round(histories[0], drafted, 2)] + [
            verifier.round(ids, nothing, 0) for verifier, ids in zip(verifiers[1:], histories[1:])]
        with TorchCalls() as calls:
            outcomes = target.verify_batch(rounds) if batched else [target.verify_batch([one])[0] for one in rounds]
        for verifier in verifiers:
            verifier.cache.release()
        return [(outcome.accepted, outcome.bonus) for outcome in outcomes], calls.names

    try:
        few = [[5, 9, 2, 7], [3, 4]]
        many = few + [[8, 1, 6], [2, 2, 9, 9], [7, 3]]
        few_outcomes, few_calls = verified(few, batched=True)
        many_outcomes, many_calls = verified(many, batched=True)
        def releasing(names):
            return sorted(name for name in names if name not in KEEPS_THE_GIL)
        assert releasing(few_calls) and releasing(many_calls) == releasing(few_calls)  # three more argmax steps
        assert many_outcomes == verified(many, batched=False)[0] and many_outcomes[:2] == few_outcomes
    finally:
        pipeline.close()
