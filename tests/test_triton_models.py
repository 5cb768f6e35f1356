"""The Triton Python models' own logic, without a server: `model_repo/*/1/model.py` run
against a stand-in for `triton_python_backend_utils` (tests/fake_triton.py).

What the real-server tests (test_server.py) cannot isolate: the generation registry and
the cancellation relay, the error path of every request, the metrics lock, and shutdown.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import fake_triton
from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.pipeline import Pipeline
from saguaro.runtime.sampling import SamplingParams

FINAL = fake_triton.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@pytest.fixture(scope="module")
def ssd_module():
    return fake_triton.load_model("ssd")


@pytest.fixture(scope="module")
def long_pair(tiny_pair, tmp_path_factory):
    from checkpoints import with_longer_context

    return with_longer_context(tiny_pair, tmp_path_factory.mktemp("long"), 4096)


@pytest.fixture
def ssd(ssd_module, long_pair):
    model = ssd_module.TritonPythonModel()
    model.initialize(fake_triton.model_args("ssd", {
        "engines_dir": "", "target_dir": str(long_pair / "target"), "draft_dir": str(long_pair / "draft"),
        "default_decoding_mode": "ssd", "default_num_draft_tokens": "4", "default_fanout": "3",
        "default_budget": "", "max_concurrency": "4"}))
    yield model
    model.finalize()


def generation_request(prompt_ids, max_tokens, stream=False, **extra) -> fake_triton.Request:
    inputs = {"input_ids": np.array([prompt_ids], np.int32), "max_tokens": np.array([[max_tokens]], np.int32),
              "stream": np.array([[stream]], bool)}
    inputs.update({name: np.array([[value]]) for name, value in extra.items()})
    return fake_triton.Request(inputs)


def wait_final(request, timeout_s: float = 60.0) -> list:
    assert request.sender.done.wait(timeout_s), "the request never got its final response"
    return request.sender.responses()


def output_ids(responses) -> list[int]:
    return [int(i) for r in responses if not r.has_error() for i in r.outputs()["output_ids"].reshape(-1)]


# --- the generation registry ------------------------------------------------------------

def test_generations_are_registered_cancelled_by_id_and_forgotten(ssd_module):
    generations = ssd_module.Generations()
    (first, first_event), (second, second_event) = generations.start(), generations.start()
    assert first != second
    generations.cancel(second)
    assert second_event.is_set() and not first_event.is_set()
    generations.end(first)
    generations.cancel(first)  # an ended generation: nothing to cancel, no error
    assert not first_event.is_set() and first not in generations.events


# --- requests end to end through the model -----------------------------------------------

def test_a_streamed_request_sends_each_round_then_a_final_response(ssd, long_pair):
    prompt = [1, 7, 9, 11]
    request = generation_request(prompt, 12, stream=True)
    ssd.execute([request])
    responses = wait_final(request)
    expected = Pipeline.load(target=long_pair / "target", draft=long_pair / "draft").generate(
        prompt, DecodeOptions(max_tokens=12), SamplingParams())
    assert output_ids(responses) == expected.output_ids
    flags = [flags for _, flags in request.sender.sent]
    assert flags[-1] == FINAL and all(f == 0 for f in flags[:-1]) and len(flags) >= 2
    final = responses[-1].outputs()
    assert final["finish_reason"].reshape(-1)[0] == b"length" and final["is_final"].reshape(-1)[0]
    assert sum(final["accepted_histogram"].reshape(-1)) == expected.stats.rounds
    ids = {int(r.outputs()["generation_id"].reshape(-1)[0]) for r in responses}
    assert len(ids) == 1, "every response of a generation carries its one id"


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
    assert ssd.metrics.by_reason["rejected"].value >= 1


def test_a_failing_generation_ends_with_an_internal_error(ssd, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("engine exploded")
    monkeypatch.setattr(ssd.pipeline, "generate", broken)
    request = generation_request([1, 5], 4)
    ssd.execute([request])
    response, = wait_final(request)
    assert response.error().code() == fake_triton.TritonError.INTERNAL
    assert "engine exploded" in response.error().message()
    deadline = time.monotonic() + 5  # the worker updates the metrics just after its final response
    while ssd.metrics.in_flight.value != 0:
        assert time.monotonic() < deadline, "the failed generation stayed in flight"
        time.sleep(0.01)
    assert ssd.metrics.by_reason["failed"].value == 1


def test_the_cancellation_relay_stops_the_generation_it_names(ssd):
    request = generation_request([1, 5, 6], 3000, stream=True)
    ssd.execute([request])
    deadline = time.monotonic() + 30
    while not request.sender.responses():
        assert time.monotonic() < deadline, "no round streamed"
        time.sleep(0.01)
    generation_id = int(request.sender.responses()[0].outputs()["generation_id"].reshape(-1)[0])
    relay = fake_triton.Request({"cancel_generation_id": np.array([[generation_id]], np.uint64)})
    ssd.execute([relay])
    assert relay.sender.sent == [(None, FINAL)]
    responses = wait_final(request, timeout_s=10)
    final = responses[-1].outputs()
    assert final["finish_reason"].reshape(-1)[0] == b"cancelled"
    assert len(output_ids(responses)) < 3000


def test_finalize_ends_running_generations_with_a_final_response(ssd):
    requests = [generation_request([1, 5, 6 + i], 3000) for i in range(6)]  # more than the 4 workers
    ssd.execute(requests)
    time.sleep(0.2)
    ssd.finalize()
    for request in requests:
        responses = wait_final(request, timeout_s=10)
        assert responses[-1].outputs()["finish_reason"].reshape(-1)[0] == b"cancelled"


# --- metrics ------------------------------------------------------------------------------

def test_metric_updates_from_many_threads_never_overlap(ssd_module, monkeypatch):
    monkeypatch.setattr(fake_triton.Metric, "update_seconds", 0.001)
    monkeypatch.setattr(fake_triton.Metric, "overlaps", 0)
    metrics = ssd_module.SsdMetrics("ssd", "1")
    outcome = SimpleNamespace(output_ids=[1, 2, 3], finish_reason="length",
                              stats={"rounds": 2, "accepted_histogram": [0, 1, 1], "cache_hits": 1,
                                     "cache_misses": 1, "tokens_per_s": 50.0})

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
    assert fake_triton.Metric.overlaps == 0
    assert metrics.counters["generated_tokens"].value == 8 * 5 * 3
    assert metrics.by_reason["length"].value == 40 and metrics.in_flight.value == 0


# --- postprocessing -----------------------------------------------------------------------

@pytest.fixture
def postprocessing(tiny_pair, monkeypatch):
    module = fake_triton.load_model("postprocessing")
    model = module.TritonPythonModel()
    model.initialize(fake_triton.model_args("postprocessing", {"tokenizer_dir": str(tiny_pair / "target"),
                                                               "generation_model": "ssd"}))
    return model


def postprocessing_request(ids, generation_id: int, cancelled: bool = False) -> fake_triton.Request:
    return fake_triton.Request({"TOKENS_BATCH": np.array([ids], np.int32), "PREFIX_IDS": np.zeros((1, 0), np.int32),
                                "IS_FINAL": np.array([[True]]), "GENERATION_ID": np.array([[generation_id]], np.uint64)},
                               cancelled=cancelled)


def test_postprocessing_relays_a_cancelled_request_to_the_generation_model(postprocessing, monkeypatch):
    relayed = []

    def handler(request, decoupled):
        relayed.append((request.model_name, int(request.inputs["cancel_generation_id"].as_numpy().reshape(-1)[0]),
                        decoupled))
        return iter([fake_triton.InferenceResponse()])
    monkeypatch.setattr(fake_triton.module, "bls_handler", handler)
    ids = postprocessing.codec.encode_word("the with statement")
    live, = postprocessing.execute([postprocessing_request(ids, 41)])
    cancelled, = postprocessing.execute([postprocessing_request(ids, 42, cancelled=True)])
    assert relayed == [("ssd", 42, True)]
    text = postprocessing.codec.decode(ids)
    for response in (live, cancelled):  # a cancelled request still gets its text, not an error
        assert not response.has_error() and response.outputs()["OUTPUT"].reshape(-1)[0].decode() == text
