"""The Triton Python models' own logic, without a server: `model_repo/*/1/model.py` run
against a stand-in for `triton_python_backend_utils` (tests/fake_triton.py).

What the real-server tests (test_server.py) cannot isolate: the cancellation relay, the
heartbeats of non-streamed requests, the drain request, the error path of every request,
the metrics lock, and shutdown.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from types import SimpleNamespace

import fake_triton
import numpy as np
import pytest

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline
from saguaro.serving.lifecycle import CONTROL_TOKEN_ENV, DrainReport, drain_inputs

FINAL = fake_triton.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@pytest.fixture(scope="module")
def ssd_module():
    return fake_triton.load_model("ssd")


@pytest.fixture(scope="module")
def long_pair(tiny_pair, tmp_path_factory):
    from checkpoints import with_longer_context

    return with_longer_context(tiny_pair, tmp_path_factory.mktemp("long"), 4096)


TOKEN = "test-token"


def ssd_parameters(pair, **overrides: str) -> dict:
    """The `ssd` model's parameters over the checkpoints of `pair`, SSD at K = 4 by default."""
    return {"engines_dir": "", "target_dir": str(pair / "target"), "draft_dir": str(pair / "draft"),
            "default_decoding_mode": "ssd", "default_num_draft_tokens": "4", "default_fanout": "3",
            "default_budget": "", **overrides}


@pytest.fixture
def ssd(ssd_module, long_pair, monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)  # as the launcher sets it for the server
    model = ssd_module.TritonPythonModel()
    model.initialize(fake_triton.model_args("ssd", ssd_parameters(long_pair, max_concurrency="4")))
    yield model
    model.finalize()
    gc.unfreeze()  # the model froze the heap as a server's process does; this one goes on testing


def test_the_model_freezes_what_it_loaded_after_collecting_the_loadings_garbage(ssd_module, long_pair):
    class Node:
        pass

    gc.unfreeze()
    loaded, garbage = Node(), Node()
    garbage.cycle = garbage  # freed only by the collector
    garbage_left = weakref.ref(garbage)
    del garbage
    model = ssd_module.TritonPythonModel()
    try:
        model.initialize(fake_triton.model_args("ssd", ssd_parameters(long_pair, max_concurrency="1")))
        assert garbage_left() is None, "garbage of the loading was frozen, never to be collected"
        assert gc.get_freeze_count() > 0
        assert not any(tracked is loaded for tracked in gc.get_objects()), "the loaded heap is still walked"
        made_after = Node()
        assert any(tracked is made_after for tracked in gc.get_objects())
    finally:
        model.finalize()
        gc.unfreeze()


def generation_request(prompt_ids, max_tokens, stream=False, **extra) -> fake_triton.Request:
    inputs = {"input_ids": np.array([prompt_ids], np.int32), "max_tokens": np.array([[max_tokens]], np.int32),
              "stream": np.array([[stream]], bool)}
    inputs.update({name: np.array([[value]]) for name, value in extra.items()})
    return fake_triton.Request(inputs)


def wait_final(request, timeout_s: float = 60.0) -> list:
    assert request.sender.done.wait(timeout_s), "the request never got its final response"
    return request.sender.responses()


def metrics_settle(ssd, settled, timeout_s: float = 10.0) -> None:
    """Waits until the model's outbox has sent what `settled()` (a condition on the
    metrics) asks for: the metrics of a request go out after its final response."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = threading.Event()
        ssd.outbox.post(done.set)  # after everything posted before it
        assert done.wait(timeout_s), "the outbox never got through its work"
        if settled():
            return
        assert time.monotonic() < deadline, "the metrics never settled"
        time.sleep(0.01)


def wait_streaming(request, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not request.sender.responses():
        assert time.monotonic() < deadline, "no round was sent"
        time.sleep(0.01)


def finish_reason(responses) -> str:
    return responses[-1].outputs()["finish_reason"].reshape(-1)[0].decode()


def output_ids(responses) -> list[int]:
    return [int(i) for r in responses if not r.has_error() for i in r.outputs()["output_ids"].reshape(-1)]


# --- requests end to end through the model -----------------------------------------------

def test_a_streamed_request_sends_each_round_then_a_final_response(ssd, long_pair):
    prompt = [1, 7, 9, 11]
    request = generation_request(prompt, 12, stream=True, num_draft_tokens=np.int32(4))  # K pinned: same rounds
    ssd.execute([request])
    responses = wait_final(request)
    expected = Pipeline.load(target=long_pair / "target", draft=long_pair / "draft").generate(
        prompt, DecodeOptions(max_tokens=12, num_draft_tokens=4), SamplingParams())
    assert output_ids(responses) == expected.output_ids
    flags = [flags for _, flags in request.sender.sent]
    assert flags[-1] == FINAL and all(f == 0 for f in flags[:-1]) and len(flags) >= 2
    final = responses[-1].outputs()
    assert final["finish_reason"].reshape(-1)[0] == b"length" and final["is_final"].reshape(-1)[0]
    assert sum(final["accepted_histogram"].reshape(-1)) == expected.stats.rounds
    ids = {int(r.outputs()["generation_id"].reshape(-1)[0]) for r in responses}
    assert len(ids) == 1, "every response of a generation carries its one id"


def test_an_ngram_drafting_model_loads_no_draft_and_answers_as_the_target(ssd_module, long_pair, monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    model = ssd_module.TritonPythonModel()
    model.initialize(fake_triton.model_args("ssd", ssd_parameters(long_pair, draft_dir="", draft_method="ngram",
                                                                  default_decoding_mode="speculative")))
    try:
        assert model.pipeline.draft.info.backend == "ngram"
        prompt = [1, 7, 9, 11, 1, 7, 9]  # "1 7 9" repeats: the draft has something to propose
        request = generation_request(prompt, 12, num_draft_tokens=np.int32(4))
        model.execute([request])
        responses = wait_final(request)
        alone = Pipeline.load(target=long_pair / "target", draft=long_pair / "draft").generate(
            prompt, DecodeOptions(mode="autoregressive", max_tokens=12), SamplingParams())
        assert output_ids(responses) == alone.output_ids
    finally:
        model.finalize()
        gc.unfreeze()


def test_a_batched_request_answers_each_prompt_with_its_batch_index_and_closes_once(ssd, long_pair):
    """tensorrtllm_backend's batched requests: prompts padded to the longest (input_lengths
    says each one's length), one response per prompt and round, FINAL once, after the last."""
    prompts = [[1, 7, 9, 11], [1, 5], [1, 8, 8]]
    padded = np.zeros((3, 4), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = prompt
    request = fake_triton.Request({"input_ids": padded, "input_lengths": np.array([[4], [2], [3]], np.int32),
                                   "max_tokens": np.array([[6], [9], [5]], np.int32),
                                   "stream": np.array([[True]] * 3), "num_draft_tokens": np.array([[2]] * 3, np.int32)})
    ssd.execute([request])
    responses = wait_final(request)
    pipeline = Pipeline.load(target=long_pair / "target", draft=long_pair / "draft")
    for index, (prompt, max_tokens) in enumerate(zip(prompts, (6, 9, 5))):
        mine = [r for r in responses if int(r.outputs()["batch_index"][0, 0]) == index]
        expected = pipeline.generate(prompt, DecodeOptions(max_tokens=max_tokens, num_draft_tokens=2), SamplingParams())
        assert output_ids(mine) == expected.output_ids
        assert mine[-1].outputs()["finish_reason"].size == 1
        assert all(int(r.outputs()["num_input_tokens"][0, 0]) == len(prompt) for r in mine)
    flags = [flags for _, flags in request.sender.sent]
    assert flags.count(FINAL) == 1 and flags[-1] == FINAL


def test_a_bad_prompt_in_a_batch_refuses_the_whole_request_naming_the_item(ssd):
    request = fake_triton.Request({"input_ids": np.array([[1, 2], [1, 9999]], np.int32),
                                   "max_tokens": np.array([[4], [4]], np.int32)})
    ssd.execute([request])
    (response, flags), = request.sender.sent
    assert flags == FINAL and "batch item 1: input 'input_ids'" in response.error().message()


def test_perf_metrics_and_log_probs_ride_on_every_response(ssd):
    request = generation_request([1, 7, 9], 10, stream=True, return_perf_metrics=True, return_log_probs=True,
                                 num_draft_tokens=np.int32(3))
    ssd.execute([request])
    responses = wait_final(request)
    running = 0.0
    for response in responses:
        outputs = response.outputs()
        assert outputs["output_log_probs"].shape == (1, 1, outputs["output_ids"].size)
        running += float(outputs["output_log_probs"].sum())
        assert outputs["cum_log_probs"][0, 0] == pytest.approx(running, abs=1e-4)
        assert np.all(outputs["output_log_probs"] <= 0)
        assert outputs["arrival_time_ns"][0, 0] <= outputs["first_scheduled_time_ns"][0, 0] \
            <= outputs["first_token_time_ns"][0, 0] <= outputs["last_token_time_ns"][0, 0]
    final = responses[-1].outputs()
    histogram = final["accepted_histogram"].reshape(-1)
    accepted = sum(a * n for a, n in enumerate(histogram))
    assert int(final["total_accepted_draft_tokens"][0, 0]) == accepted
    drafted = int(final["total_draft_tokens"][0, 0])
    assert 0 < drafted <= 3 * sum(histogram) and final["acceptance_rate"][0, 0] == pytest.approx(accepted / drafted)
    assert int(final["kv_cache_alloc_new_blocks"][0, 0]) == 2 and int(final["kv_cache_reused_blocks"][0, 0]) == 0


def test_without_asking_the_perf_and_log_prob_outputs_are_empty(ssd):
    request = generation_request([1, 7], 4)
    ssd.execute([request])
    final = wait_final(request)[-1].outputs()
    assert not {"cum_log_probs", "output_log_probs", "acceptance_rate", "arrival_time_ns", "batch_index"} & set(final)
    assert int(final["num_output_tokens"][0, 0]) == 4 and final["finish_reason"].size == 1


def test_a_direct_client_gets_only_the_outputs_it_asked_for(ssd):
    request = fake_triton.Request({"input_ids": np.array([[1, 7]], np.int32), "max_tokens": np.array([[4]], np.int32)},
                                  requested=["output_ids", "finish_reason"])
    ssd.execute([request])
    assert set(wait_final(request)[-1].outputs()) == {"output_ids", "finish_reason"}


def test_a_text_request_is_tokenized_and_answered_in_text(ssd_module, long_pair, monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    model = ssd_module.TritonPythonModel()
    model.initialize(fake_triton.model_args("ssd", {
        "engines_dir": "", "target_dir": str(long_pair / "target"), "draft_dir": str(long_pair / "draft"),
        "tokenizer_dir": str(long_pair / "target"), "default_num_draft_tokens": "2", "max_concurrency": "2"}))
    try:
        pipeline = Pipeline.load(target=long_pair / "target", draft=long_pair / "draft")
        expected = pipeline.generate(pipeline.encode("the quick"), DecodeOptions(max_tokens=12), SamplingParams())
        streamed = fake_triton.Request({"text_input": np.array([[b"the quick"]], object),
                                        "max_tokens": np.array([[12]], np.int32), "stream": np.array([[True]])})
        whole = fake_triton.Request({"text_input": np.array([[b"the quick"]], object),
                                     "max_tokens": np.array([[12]], np.int32)})
        model.execute([streamed, whole])
        pieces = [r.outputs()["text_output"][0].decode() for r in wait_final(streamed)]
        assert "".join(pieces) == pipeline.decode(expected.output_ids)
        assert wait_final(whole)[-1].outputs()["text_output"][0].decode() == pipeline.decode(expected.output_ids)
    finally:
        model.finalize()


def test_a_model_that_is_not_decoupled_answers_once_and_refuses_streams(ssd_module, long_pair, monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    model = ssd_module.TritonPythonModel()
    model.initialize(fake_triton.model_args("ssd", {
        "engines_dir": "", "target_dir": str(long_pair / "target"), "draft_dir": str(long_pair / "draft"),
        "max_concurrency": "2"}, decoupled=False))
    try:
        once, streamed = generation_request([1, 7], 6), generation_request([1, 7], 6, stream=True)
        model.execute([once, streamed])
        (response, flags), = wait_final(once) and once.sender.sent
        assert flags == FINAL and response.outputs()["output_ids"].size == 6
        (refusal, _), = streamed.sender.sent
        assert "decoupled" in refusal.error().message()
    finally:
        model.finalize()


@pytest.mark.parametrize("inputs, named", [
    ({"max_tokens": np.array([[4]], np.int32)}, "input_ids"),
    ({"input_ids": np.array([[1, 2]], np.int32)}, "max_tokens"),
    ({"input_ids": np.array([[1, 2]], np.int32), "max_tokens": np.array([[4]], np.int32),
      "decoding_mode": np.array([[b"fast"]], object)}, "decoding_mode"),
])
def test_a_bad_request_gets_one_final_error_naming_the_input(ssd, inputs, named):
    request = fake_triton.Request(inputs)
    ssd.execute([request])
    (response, flags), = request.sender.sent
    assert flags == FINAL and response.has_error()
    assert response.error().code() == fake_triton.TritonError.INVALID_ARG and named in response.error().message()
    metrics_settle(ssd, lambda: ssd.metrics.by_reason["rejected"].value >= 1)


def test_a_failing_generation_ends_with_an_internal_error(ssd, monkeypatch):
    """A round that fails (the target's forward here) fails the requests in it, each with
    a final error, and the scheduler serves on."""
    def broken(*args, **kwargs):
        raise RuntimeError("engine exploded")
    monkeypatch.setattr(ssd.pipeline.target, "verify_batch", broken)
    request = generation_request([1, 5], 4)
    ssd.execute([request])
    *before, response = wait_final(request)  # the prefill's first token went out before the round
    assert not any(earlier.has_error() for earlier in before)
    assert response.error().code() == fake_triton.TritonError.INTERNAL
    assert "engine exploded" in response.error().message()
    metrics_settle(ssd, lambda: ssd.metrics.in_flight.value == 0 and "failed" in ssd.metrics.by_reason
                   and ssd.metrics.by_reason["failed"].value == 1)
    monkeypatch.undo()
    again = generation_request([1, 5], 4)
    ssd.execute([again])
    assert not wait_final(again)[-1].has_error()


def test_a_request_not_streamed_sends_heartbeats_then_everything_at_once(ssd):
    request = generation_request([1, 7, 9, 11], 12, end_id=-1)
    ssd.execute([request])
    responses = wait_final(request)
    heartbeats, final = responses[:-1], responses[-1].outputs()
    assert heartbeats and all(r.outputs()["output_ids"].size == 0 for r in heartbeats)
    assert final["output_ids"].size == 12 and int(final["num_output_tokens"][0, 0]) == 12
    assert int(final["num_input_tokens"][0, 0]) == 4


@pytest.mark.parametrize("streamed", [True, False])
def test_the_cancellation_relay_stops_the_generation_it_names(ssd, streamed):
    request = generation_request([1, 5, 6], 3000, stream=streamed)
    ssd.execute([request])
    wait_streaming(request)
    generation_id = int(request.sender.responses()[0].outputs()["generation_id"].reshape(-1)[0])
    relay = fake_triton.Request({"cancel_generation_id": np.array([[generation_id]], np.uint64)})
    ssd.execute([relay])
    assert relay.sender.sent == [(None, FINAL)]
    responses = wait_final(request, timeout_s=10)
    assert finish_reason(responses) == "cancelled"
    assert len(output_ids(responses)) < 3000


def test_a_direct_request_cancelled_by_triton_stops(ssd):
    request = generation_request([1, 5, 6], 3000, stream=True)
    ssd.execute([request])
    wait_streaming(request)
    request.cancelled = True  # what Triton reports once the client cancels a direct request
    responses = wait_final(request, timeout_s=10)
    assert finish_reason(responses) == "cancelled" and len(output_ids(responses)) < 3000


def drain_request(token: str = TOKEN, timeout_s: float = 0.5) -> fake_triton.Request:
    return fake_triton.Request(drain_inputs(token, timeout_s))


def drain_report(request) -> DrainReport:
    (response,) = wait_final(request, timeout_s=30)
    return DrainReport.from_json(response.outputs()["drain_report"].reshape(-1)[0].decode())


def paced(pipeline, monkeypatch, seconds_per_round: float) -> None:
    """Rounds that take a known time, so that what finishes before a deadline is certain."""
    make_request = pipeline.request

    def slow(prompt_ids, options, sampling, on_tokens=None, cancelled=lambda: False, **hooks):
        def each_round(tokens):
            time.sleep(seconds_per_round)
            on_tokens(tokens)
        return make_request(prompt_ids, options, sampling, on_tokens=each_round, cancelled=cancelled, **hooks)
    monkeypatch.setattr(pipeline, "request", slow)


def test_a_drain_lets_short_requests_finish_and_stops_long_ones_at_the_deadline(ssd, monkeypatch):
    paced(ssd.pipeline, monkeypatch, 0.02)
    short = generation_request([1, 5, 6], 8, stream=True, end_id=-1, decoding_mode=b"autoregressive")
    long = generation_request([1, 5], 3000)
    ssd.execute([short, long])
    wait_streaming(short)
    wait_streaming(long)
    drain = drain_request(timeout_s=1.0)
    ssd.execute([drain])
    late = generation_request([1, 5], 4)
    ssd.execute([late])
    (refused, flags), = late.sender.sent
    assert flags == FINAL and refused.error().code() == fake_triton.TritonError.UNAVAILABLE
    assert "shutting down" in refused.error().message()
    report = drain_report(drain)
    assert (report.in_flight, report.finished, report.stopped_at_deadline, report.still_running) == (2, 1, 1, 0)
    assert finish_reason(wait_final(short)) == "length" and len(output_ids(short.sender.responses())) == 8
    long_responses = wait_final(long)
    assert finish_reason(long_responses) == "shutdown"
    assert 0 < long_responses[-1].outputs()["output_ids"].size < 3000  # the text so far is delivered


def test_a_drain_of_an_idle_model_answers_at_once(ssd):
    drain = drain_request(timeout_s=30)
    ssd.execute([drain])
    report = drain_report(drain)
    assert report.complete and report.in_flight == 0 and report.waited_s < 5


def test_a_drain_request_without_the_token_is_refused_and_changes_nothing(ssd):
    drain = drain_request(token="guess")
    ssd.execute([drain])
    (response, flags), = drain.sender.sent
    assert response.error().code() == fake_triton.TritonError.INVALID_ARG
    assert "control_token" in response.error().message()
    request = generation_request([1, 5], 4)
    ssd.execute([request])
    assert finish_reason(wait_final(request)) == "length"


def test_finalize_ends_running_generations_with_a_final_response(ssd):
    requests = [generation_request([1, 5, 6 + i], 3000) for i in range(6)]  # more than the 4 workers
    ssd.execute(requests)
    time.sleep(0.2)
    ssd.finalize()
    for request in requests:
        assert finish_reason(wait_final(request, timeout_s=10)) == "shutdown"


# --- metrics ------------------------------------------------------------------------------

def test_metric_updates_from_many_threads_never_overlap(ssd_module, monkeypatch):
    monkeypatch.setattr(fake_triton.Metric, "update_seconds", 0.001)
    monkeypatch.setattr(fake_triton.Metric, "overlaps", 0)
    outbox = ssd_module.Outbox()
    metrics = ssd_module.SsdMetrics("ssd", "1", outbox.post)
    outcome = SimpleNamespace(output_ids=[1, 2, 3], finish_reason="length",
                              stats={"rounds": 2, "accepted_histogram": [0, 1, 1], "drafted_tokens": 4,
                                     "cache_hits": 1, "cache_misses": 1, "tokens_per_s": 50.0})

    def worker():
        for _ in range(5):
            metrics.change_in_flight(1)
            metrics.record(outcome)
            metrics.count_request("rejected")
            metrics.change_in_flight(-1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outbox.close()  # everything gathered is sent
    assert fake_triton.Metric.overlaps == 0
    assert metrics.counters["generated_tokens"].value == 8 * 5 * 3
    assert metrics.counters["verified_draft_tokens"].value == 8 * 5 * 4
    assert metrics.counters["accepted_draft_tokens"].value == 8 * 5 * 3
    assert metrics.by_reason["length"].value == 40 and metrics.in_flight.value == 0


def test_metrics_gathered_while_the_outbox_is_busy_go_out_in_one_flush(ssd_module):
    """Each update is a message to the server: a busy outbox sends many requests' figures
    as one increment per counter, one flush waiting at a time."""
    posted = []
    metrics = ssd_module.SsdMetrics("ssd", "1", posted.append)
    outcome = SimpleNamespace(output_ids=[1, 2, 3], finish_reason="length",
                              stats={"rounds": 3, "accepted_histogram": [1], "drafted_tokens": 0,
                                     "cache_hits": 0, "cache_misses": 0, "tokens_per_s": 50.0})
    for _ in range(10):
        metrics.change_in_flight(1)
        metrics.observe_round(batch_size=4, queued=2, undrafted="held", alone=True)
        metrics.record(outcome)
        metrics.change_in_flight(-1)
    assert len(posted) == 1 and metrics.counters["generated_tokens"].value == 0  # nothing sent yet
    posted.pop()()
    generated = metrics.counters["generated_tokens"]
    assert generated.value == 30 and generated.updates == 1  # one increment for ten requests
    assert metrics.counters["verified_draft_tokens"].updates == 0  # a 0 is not sent
    assert metrics.batch_size.observed == [4] * 10 and metrics.queued.value == 2
    assert metrics.undrafted["held"].value == 10 and metrics.undrafted["priced"].updates == 0
    assert metrics.alone_rounds.value == 10 and metrics.alone_rounds.updates == 1
    assert metrics.in_flight.value == 0 and metrics.by_reason["length"].value == 10
    metrics.count_request("rejected")
    assert len(posted) == 1  # the next update posts the next flush


# --- postprocessing -----------------------------------------------------------------------

@pytest.fixture
def postprocessing(tiny_pair, monkeypatch):
    module = fake_triton.load_model("postprocessing")
    model = module.TritonPythonModel()
    model.initialize(fake_triton.model_args("postprocessing", {"tokenizer_dir": str(tiny_pair / "target"),
                                                               "generation_model": "ssd"}))
    return model


FIGURES = {"FINISH_REASON": np.array([[b"length"]], object), "ACCEPTED_HISTOGRAM": np.array([[1, 2]], np.int32),
           "CACHE_HITS": np.array([[3]], np.int32), "CACHE_MISSES": np.array([[0]], np.int32),
           "TOKENS_PER_S": np.array([[9.5]], np.float32), "NUM_INPUT_TOKENS": np.array([[4]], np.int32),
           "NUM_OUTPUT_TOKENS": np.array([[5]], np.int32), "SAMPLING_SEED": np.array([[77]], np.uint64),
           "BATCH_INDEX": np.array([[2]], np.int32), "SEQUENCE_INDEX": np.array([[0]], np.int32),
           "CUM_LOG_PROBS": np.array([[-1.5]], np.float32), "OUTPUT_LOG_PROBS": np.array([[[-1.0, -0.5]]], np.float32),
           "KV_CACHE_ALLOC_NEW_BLOCKS": np.array([[2]], np.int32), "KV_CACHE_REUSED_BLOCKS": np.array([[0]], np.int32),
           "KV_CACHE_ALLOC_TOTAL_BLOCKS": np.array([[2]], np.int32), "ARRIVAL_TIME_NS": np.array([[10]], np.int64),
           "FIRST_SCHEDULED_TIME_NS": np.array([[11]], np.int64), "FIRST_TOKEN_TIME_NS": np.array([[12]], np.int64),
           "LAST_TOKEN_TIME_NS": np.array([[13]], np.int64), "ACCEPTANCE_RATE": np.array([[0.5]], np.float32),
           "TOTAL_ACCEPTED_DRAFT_TOKENS": np.array([[3]], np.int32), "TOTAL_DRAFT_TOKENS": np.array([[6]], np.int32)}


def postprocessing_request(ids, generation_id: int, cancelled: bool = False, final: bool = True) -> fake_triton.Request:
    empty = {name: np.zeros((1,) + (0,) * (array.ndim - 1), array.dtype) for name, array in FIGURES.items()}
    return fake_triton.Request({"TOKENS_BATCH": np.array([ids], np.int32).reshape(1, -1),
                                "PREFIX_IDS": np.zeros((1, 0), np.int32), "IS_FINAL": np.array([[final]]),
                                "GENERATION_ID": np.array([[generation_id]], np.uint64),
                                **(FIGURES if final else empty)}, cancelled=cancelled)


def test_postprocessing_relays_a_cancelled_request_to_the_generation_model(postprocessing, monkeypatch):
    relayed = []

    def handler(request, decoupled):
        relayed.append((request.model_name, int(request.inputs["cancel_generation_id"].as_numpy().reshape(-1)[0]),
                        decoupled))
        return iter([fake_triton.InferenceResponse()])
    monkeypatch.setattr(fake_triton.module, "bls_handler", handler)
    ids = postprocessing.codec.encode_word("the with statement")
    live, cancelled = postprocessing_request(ids, 41), postprocessing_request(ids, 42, cancelled=True)
    assert postprocessing.execute([live, cancelled]) is None  # decoupled: answers through the senders
    assert relayed == [("ssd", 42, True)]
    text = postprocessing.codec.decode(ids)
    for request in (live, cancelled):  # a cancelled request still gets its text, not an error
        (response, flags), = request.sender.sent
        assert flags == FINAL and not response.has_error()
        assert response.outputs()["OUTPUT"].reshape(-1)[0].decode() == text


def test_postprocessing_passes_the_figures_through_to_the_client(postprocessing):
    request = postprocessing_request(postprocessing.codec.encode_word("x"), 1)
    postprocessing.execute([request])
    (response, _), = request.sender.sent
    outputs = response.outputs()
    for name, array in FIGURES.items():
        np.testing.assert_array_equal(outputs[name.lower()], array)


def test_postprocessing_answers_a_heartbeat_with_nothing_but_relays_its_cancellation(postprocessing, monkeypatch):
    relayed = []
    monkeypatch.setattr(fake_triton.module, "bls_handler",
                        lambda request, decoupled: relayed.append(request) or iter([fake_triton.InferenceResponse()]))
    quiet, cancelled = postprocessing_request([], 7, final=False), postprocessing_request([], 8, True, final=False)
    postprocessing.execute([quiet, cancelled])
    assert quiet.sender.sent == [(None, FINAL)] and cancelled.sender.sent == [(None, FINAL)]  # no client response
    assert len(relayed) == 1


# --- preprocessing ------------------------------------------------------------------------

@pytest.fixture
def preprocessing(tiny_pair):
    model = fake_triton.load_model("preprocessing").TritonPythonModel()
    model.initialize(fake_triton.model_args("preprocessing", {"tokenizer_dir": str(tiny_pair / "target"),
                                                              "bos_token_id": "", "max_context": "64"}))
    return model


@pytest.mark.parametrize("inputs, named", [
    ({}, ["text_input", "max_tokens"]),
    ({"REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)}, ["text_input"]),
    ({"QUERY": np.array([[b"the quick"]], object)}, ["max_tokens"]),
    ({"QUERY": np.array([[b"x" * 400]], object), "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)}, ["text_input"]),
])
def test_preprocessing_names_what_the_client_sent(preprocessing, inputs, named):
    response, = preprocessing.execute([fake_triton.Request(inputs)])
    assert response.has_error() and all(f"'{name}'" in response.error().message() for name in named)


def test_preprocessing_encodes_a_complete_request(preprocessing):
    request = fake_triton.Request({"QUERY": np.array([[b"the quick"]], object),
                                   "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)})
    response, = preprocessing.execute([request])
    assert not response.has_error()
    assert response.outputs()["INPUT_ID"].reshape(-1).tolist() == preprocessing.codec.encode("the quick")


def test_the_outbox_sends_urgent_work_first_each_kind_in_the_order_posted(ssd_module):
    """First tokens, final responses and errors go ahead of routine updates and metrics
    already waiting; routine work posted after urgent work still runs after it (a
    request's metrics after its final response), and closing runs everything left."""
    from saguaro.serving.responses import Urgent

    outbox, ran, busy = ssd_module.Outbox(), [], threading.Event()
    outbox.post(busy.wait)  # the sender is busy while the rest is posted
    outbox.post(lambda: ran.append("update 1"))
    outbox.post(Urgent(lambda: ran.append("final 1")))
    outbox.post(lambda: ran.append("metrics of 1"))
    outbox.post(Urgent(lambda: ran.append("first tokens of 2")))
    busy.set()
    outbox.close()
    assert ran == ["final 1", "first tokens of 2", "update 1", "metrics of 1"]
