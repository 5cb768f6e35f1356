"""Exactness does not depend on company: a request decoded in a batch, whatever else is in
it, joins or leaves, gives exactly what it gives alone (greedy tokens identical, seeded
samples identical), on torch engines and on ONNX Runtime engines."""
import threading

import pytest

from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.pipeline import Pipeline
from saguaro.runtime.sampling import SamplingParams

PROMPTS = ["The with statement", "A class definition defines", "x", "Exceptions are raised",
           "The import system", "In a for loop,", "Comparisons", "Lambda expressions are",
           "The del statement", "String literals are", "Boolean operations", "The pass statement"]
SETTINGS = [  # mode, K, branching, sampling, max_tokens: every kind of request in one batch
    # adapt_k: K per round from the load policy, which depends on the company; a seeded
    # sampled request keeps its K whatever it asks, so the seed replays exactly
    (dict(mode="ssd", num_draft_tokens=4, fanout=(3,), adapt_k=True), SamplingParams(), 40),
    (dict(mode="speculative", num_draft_tokens=2, adapt_k=True), SamplingParams(temperature=0.8, seed=3), 25),
    (dict(mode="autoregressive"), SamplingParams(), 30),
    (dict(mode="ssd", num_draft_tokens=3, budget="auto", adapt_k=True),
     SamplingParams(temperature=1.0, top_k=20, seed=9), 35),
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


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def pipeline(request, tiny_pair, tiny_engines):
    loaded = (Pipeline.load(tiny_pair / "target", tiny_pair / "draft") if request.param == "torch"
              else Pipeline.load(engines=tiny_engines))
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
