"""End to end against a real Triton Inference Server (tritonserver 2.51 from nvidia-pytriton).

One server for the whole session, started by the same code as `scripts/serve.py --engines`
on free ports and stopped at the end (cleanly, leaving no shared-memory region behind).
It serves engines built from the test pair; every expected text comes from the runtime
in this process over the same engines.
"""
from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from saguaro.runtime.detokenizer import prefix_window, text_delta
from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.pipeline import Pipeline
from saguaro.runtime.sampling import SamplingParams
from saguaro.serving.client import MODEL, CompletionError, complete, ensemble_inputs
from saguaro.serving.launch import Ports, parse_args, serve
from saguaro.serving.model_repo import values_from_args
from checkpoints import build_engines_cli, with_longer_context

pytestmark = pytest.mark.server
REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick", "café 日本", "Ωmega", "lazy dog", "naïve 🌵", "over the", "brown fox", "jumps"]


@pytest.fixture(scope="session")
def served_engines(tiny_pair, tmp_path_factory):
    """The tiny pair with a 4096-token context, so one generation lasts long enough for
    concurrency and cancellation to be seen."""
    long_pair = with_longer_context(tiny_pair, tmp_path_factory.mktemp("long_pair"), 4096)
    return build_engines_cli(long_pair, tmp_path_factory.mktemp("engines") / "long", "--max-context", "4096")


@pytest.fixture(scope="session")
def pipeline(served_engines):
    return Pipeline.load(engines=served_engines)


@pytest.fixture(scope="session")
def server(served_engines, tmp_path_factory):
    args = parse_args(["--engines", str(served_engines)])
    triton = serve(values_from_args(args), tmp_path_factory.mktemp("triton"), Ports.free())
    try:
        yield triton
    finally:
        triton.stop()
    assert triton.stopped_cleanly, f"crashed, or a request was left in flight:\n{triton.log_tail()}"
    assert not triton.shm_regions(), "the stopped server left shared-memory regions"


@pytest.fixture
def client(server):
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}") as grpc_client:
        yield grpc_client


def reference(pipeline, prompt: str, max_tokens: int, mode: str = "ssd", end_id: int | None = None,
              sampling: SamplingParams = SamplingParams()):
    chunks = []
    options = DecodeOptions(mode=mode, max_tokens=max_tokens, eos_token_id=end_id)
    generation = pipeline.generate(pipeline.encode(prompt), options, sampling, on_tokens=chunks.append)
    return generation, chunks


def metrics(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=5) as reply:
        return reply.read().decode()


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            return float(match.group(2))
    return 0.0


def settled_metrics(server, done, timeout_s: float = 10.0) -> str:
    """Metrics once `done(text)` holds: a worker updates them just after its final response."""
    deadline = time.monotonic() + timeout_s
    text = metrics(server)
    while not done(text):
        assert time.monotonic() < deadline, "metrics never reached the expected state"
        time.sleep(0.05)
        text = metrics(server)
    return text


def succeeded_requests(client, model: str = MODEL) -> int:
    """Requests the model has ended successfully; one left in flight never counts."""
    return client.get_inference_statistics(model).model_stats[0].inference_stats.success.count


def wait_for_succeeded(client, expected: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while succeeded_requests(client) < expected:
        assert time.monotonic() < deadline, "a request was left in flight"
        time.sleep(0.05)


def test_server_metadata_and_model_configs_are_what_clients_expect(server, client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().version == "2.51.0"
    for name in ("preprocessing", "ssd", "postprocessing", "ensemble"):
        assert client.is_model_ready(name)
    metadata = client.get_model_metadata(MODEL)
    inputs = {spec.name: spec.datatype for spec in metadata.inputs}
    assert inputs == {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "chat": "BOOL", "temperature": "FP32",
                      "top_k": "INT32", "top_p": "FP32", "seed": "UINT64", "end_id": "INT32",
                      "bad_words": "BYTES", "stop_words": "BYTES", "decoding_mode": "BYTES",
                      "num_draft_tokens": "INT32", "fanout": "INT32", "budget": "INT32", "saguaro_factor": "FP32"}
    assert {spec.name for spec in metadata.outputs} == {
        "text_output", "finish_reason", "accepted_histogram", "cache_hits", "cache_misses", "tokens_per_s"}
    ssd = client.get_model_config("ssd").config
    assert ssd.model_transaction_policy.decoupled and ssd.backend == "python"
    assert client.get_model_config(MODEL).config.platform == "ensemble"
    parameters = {key: value.string_value for key, value in ssd.parameters.items()}
    assert Path(parameters["engines_dir"], "manifest.json").is_file()
    assert parameters["default_decoding_mode"] == "ssd" and parameters["target_dir"] == ""
    assert not any("${" in value for value in parameters.values()), "template left unfilled"


@pytest.mark.parametrize("mode", ["ssd", "speculative", "autoregressive"])
def test_greedy_text_equals_the_runtimes(pipeline, client, mode):
    for prompt in PROMPTS[:2]:
        expected, _ = reference(pipeline, prompt, 40, mode)
        completion = complete(client, ensemble_inputs(prompt, 40, False, decoding_mode=mode))
        assert completion.text == pipeline.decode(expected.output_ids)
        assert len(completion.pieces) == 1  # not streaming: one response
        assert completion.finish_reason == expected.finish_reason
        assert completion.accepted_histogram == expected.stats.accepted_histogram
        assert (completion.cache_hits, completion.cache_misses) == (expected.stats.cache_hits,
                                                                    expected.stats.cache_misses)


def test_seeded_sampling_reproduces_the_runtimes_text(pipeline, client):
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=2**40 + 7)
    expected, _ = reference(pipeline, PROMPTS[4], 40, end_id=-1, sampling=sampling)
    completion = complete(client, ensemble_inputs(PROMPTS[4], 40, True, end_id=-1, temperature=0.8, top_k=50,
                                                  top_p=0.95, seed=2**40 + 7))
    assert completion.text == pipeline.decode(expected.output_ids)
    other_seed = complete(client, ensemble_inputs(PROMPTS[4], 40, True, end_id=-1, temperature=0.8, seed=1))
    assert other_seed.text != completion.text  # the seed reached the sampler


def test_stop_words_end_the_text_after_them(pipeline, client):
    generated = reference(pipeline, PROMPTS[0], 40, end_id=-1)[0].output_ids
    codec_ids = [pipeline.tokenizer.encode(pipeline.decode([i]), add_special_tokens=False) for i in generated]
    stop_at = next(i for i in range(3, len(generated))  # a one-token word that CSV leaves whole
                   if codec_ids[i] == [generated[i]] and not set(pipeline.decode([generated[i]])) & set(',"'))
    completion = complete(client, ensemble_inputs(PROMPTS[0], 40, True, end_id=-1, bad_words=[""],
                                                  stop_words=[pipeline.decode([generated[stop_at]])]))
    assert completion.finish_reason == "stop"
    assert completion.text == pipeline.decode(generated[:generated.index(generated[stop_at]) + 1])


def test_streaming_delivers_every_token_once_and_in_order(pipeline, client):
    expected, chunks = reference(pipeline, PROMPTS[1], 60, end_id=-1)
    decode, generated, pieces = pipeline.decode, [], []
    for chunk in chunks:  # the runtime's rounds, detokenised as the server must
        pieces.append(text_delta(decode, prefix_window(generated, len(generated)), chunk, final=False))
        generated += chunk
    pieces.append(text_delta(decode, prefix_window(generated, len(generated)), [], final=True))
    completion = complete(client, ensemble_inputs(PROMPTS[1], 60, True, end_id=-1))
    assert len(chunks) == expected.stats.rounds > 1
    assert completion.pieces == pieces
    assert completion.text == pipeline.decode(expected.output_ids)


def test_eight_concurrent_streams_overlap_and_all_complete(pipeline, server):
    expected = {prompt: pipeline.decode(reference(pipeline, prompt, 200, "autoregressive", -1)[0].output_ids)
                for prompt in PROMPTS}
    start, results = threading.Barrier(len(PROMPTS)), {}

    def run(prompt):
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}") as own_client:
            start.wait()
            results[prompt] = complete(own_client, ensemble_inputs(prompt, 200, True, end_id=-1,
                                                                   decoding_mode="autoregressive"))

    threads = [threading.Thread(target=run, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert {prompt: results[prompt].text for prompt in PROMPTS} == expected
    streaming = [(r.started_s + r.response_times_s[0], r.started_s + r.response_times_s[-1])
                 for r in results.values()]
    # Served one after another, no two streams would be streaming at the same moment.
    assert most_at_once(streaming) >= len(PROMPTS) // 2


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of `(start, end)` intervals covering one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = best = 0
    for _, change in events:
        running += change
        best = max(best, running)
    return best


def test_cancelling_a_stream_stops_its_generation_and_frees_it(pipeline, server, client):
    before, succeeded_before = metrics(server), succeeded_requests(client)
    room = pipeline.max_context - len(pipeline.encode(PROMPTS[0]))
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, ensemble_inputs(PROMPTS[0], room, True, decoding_mode="autoregressive",
                                                     end_id=-1), enable_empty_final_response=True)
    result, error = responses.get(timeout=30)
    assert error is None
    client.stop_stream(cancel_requests=True)
    cancelled_before = metric(before, "ssd_requests_total", finish_reason="cancelled")
    after = settled_metrics(server, lambda text: metric(text, "ssd_requests_total", finish_reason="cancelled")
                            > cancelled_before and metric(text, "ssd_requests_in_flight") == 0)
    generated = metric(after, "ssd_generated_tokens_total") - metric(before, "ssd_generated_tokens_total")
    assert 1 <= generated < room / 2  # stopped long before its max_tokens
    wait_for_succeeded(client, succeeded_before + 1)  # the ensemble request ended too
    followup = complete(client, ensemble_inputs(PROMPTS[0], 8, True, end_id=-1))
    assert followup.finish_reason == "length"


def test_the_ssd_model_called_directly_streams_validates_and_cancels(pipeline, server, client):
    """Clients may skip the ensemble (token ids in, token ids out), like tensorrt_llm's model."""
    prompt = np.array([pipeline.encode(PROMPTS[3])], dtype=np.int32)
    room = pipeline.max_context - prompt.shape[1]
    inputs = raw(("input_ids", prompt, "INT32"), ("max_tokens", np.array([[room]], np.int32), "INT32"),
                 ("stream", np.array([[True]]), "BOOL"), ("end_id", np.array([[-1]], np.int32), "INT32"))
    responses, before = queue.Queue(), metrics(server)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ssd", inputs, enable_empty_final_response=True)
    result, error = responses.get(timeout=30)
    assert error is None and result.as_numpy("output_ids").size >= 1
    client.stop_stream(cancel_requests=True)
    cancelled_before = metric(before, "ssd_requests_total", finish_reason="cancelled")
    after = settled_metrics(server, lambda text: metric(text, "ssd_requests_total", finish_reason="cancelled")
                            > cancelled_before and metric(text, "ssd_requests_in_flight") == 0)
    assert metric(after, "ssd_generated_tokens_total") - metric(before, "ssd_generated_tokens_total") < room / 2
    without_prompt = raw(("max_tokens", np.array([[4]], np.int32), "INT32"))
    with pytest.raises(CompletionError, match="'input_ids'"):
        complete(client, without_prompt, model="ssd", timeout_s=30)


def raw(*named_arrays):
    inputs = []
    for name, array, datatype in named_arrays:
        infer_input = grpcclient.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


TEXT = ("text_input", np.array([[b"the quick"]], dtype=object), "BYTES")
BAD_REQUESTS = {
    "missing text_input": (raw(("max_tokens", np.array([[4]], np.int32), "INT32")), "text_input"),
    "missing max_tokens": (raw(TEXT), "max_tokens"),
    "max_tokens as FP32": (raw(TEXT, ("max_tokens", np.array([[4]], np.float32), "FP32")), "max_tokens"),
    "text_input of shape [1, 2]": (raw(("text_input", np.array([[b"a", b"b"]], dtype=object), "BYTES"),
                                       ("max_tokens", np.array([[4]], np.int32), "INT32")), "text_input"),
    "empty text": (ensemble_inputs("", 4, True), "text_input"),
    "max_tokens 0": (ensemble_inputs("the quick", 0, True), "max_tokens"),
    "max_tokens beyond the context": (ensemble_inputs("the quick", 10_000, True), "max_tokens"),
    "unknown decoding mode": (ensemble_inputs("the quick", 4, True, decoding_mode="fast"), "decoding_mode"),
    "negative temperature": (ensemble_inputs("the quick", 4, True, temperature=-0.5), "temperature"),
    "bad words": (ensemble_inputs("the quick", 4, True, bad_words=["fox"]), "bad_words"),
    "chat without a chat template": (ensemble_inputs("the quick", 4, True, chat=True), "chat"),
}


def test_bad_requests_get_errors_naming_the_input_and_the_server_keeps_serving(server, client):
    for inputs, named in BAD_REQUESTS.values():
        with pytest.raises(CompletionError, match=f"'{named}'"):
            complete(client, inputs, timeout_s=30)
    assert complete(client, ensemble_inputs("the quick", 8, True, end_id=-1)).finish_reason == "length"
    settled_metrics(server, lambda text: metric(text, "ssd_requests_in_flight") == 0)


def test_metrics_endpoint_reports_the_ssd_figures(server, client):
    complete(client, ensemble_inputs(PROMPTS[2], 24, True, end_id=-1))
    text = metrics(server)
    for name in ("ssd_generated_tokens_total", "ssd_rounds_total", "ssd_accepted_draft_tokens_total",
                 "ssd_cache_hits_total", "ssd_cache_misses_total"):
        assert f"# TYPE {name} counter" in text
    assert metric(text, "ssd_generated_tokens_total") >= 24 and metric(text, "ssd_rounds_total") >= 1
    assert metric(text, "ssd_cache_hits_total") + metric(text, "ssd_cache_misses_total") >= 1
    assert metric(text, "ssd_request_tokens_per_second_count") >= 1
    assert metric(text, "nv_inference_request_success", model="ensemble") >= 1  # Triton's own


def test_client_script_streams_and_reports_json(pipeline, server):
    expected = pipeline.decode(reference(pipeline, "lazy dog", 16, end_id=-1)[0].output_ids)
    command = [sys.executable, str(REPO_ROOT / "scripts" / "client.py"), "--url", f"127.0.0.1:{server.ports.grpc}",
               "--prompt", "lazy dog", "--max-tokens", "16", "--end-id", "-1", "--wait", "30"]
    streamed = subprocess.run(command + ["--stream"], capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == "lazy dog" + expected and "finish: length" in streamed.stderr
    reported = subprocess.run(command + ["--json", "--decoding-mode", "speculative"], capture_output=True,
                              text=True, timeout=60)
    assert reported.returncode == 0, reported.stderr
    result = json.loads(reported.stdout)
    assert result["text"] == expected and result["finish_reason"] == "length" and len(result["pieces"]) == 1
