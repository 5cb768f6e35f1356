"""The clients the field uses, against a real Triton server with the OpenAI front end.

- tensorrtllm_backend's own client reads each response the way `end_to_end_grpc_client.py`
  does (upstream's script is not copied here; this reads as it reads): `text_output` as a
  shape-[1] BYTES array, `output[0].decode()`; the perf outputs as `[0][0]`; `batch_index`
  of a batched request; `cum_log_probs` / `output_log_probs`; and a server made with
  `decoupled_mode false` answering Triton's plain (unary) inference API.
- the official `openai` client: chat and completions, streamed and not, against the
  runtime's own text; a client that disconnects mid-stream cancels its generation and
  frees its slot (seen in the model's metrics); concurrent streams.
"""
from __future__ import annotations

import queue
import socket
import threading
import time

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from served import metric, metrics
from tritonclient.utils import np_to_triton_dtype

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.models.prompts import encode_chat
from saguaro.runtime.pipeline import Pipeline
from saguaro.serving.launch import parse_args, serve, start_openai
from saguaro.serving.model_repo import values_from_args
from saguaro.serving.responses import PERF_OUTPUTS
from saguaro.serving.triton_server import Ports

pytestmark = pytest.mark.server
# A ChatML template (the test pair's tokenizer has none): what --chat-template gives.
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL = "tiny-long"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def pipeline(served_engines):
    return Pipeline.load(engines=served_engines)


@pytest.fixture(scope="module")
def stack(served_engines, tmp_path_factory):
    """Triton on every interface (--host 0.0.0.0) and the OpenAI front end beside it."""
    args = parse_args(["--engines", str(served_engines), "--fixed-k", "--fanout", "3", "--host", "0.0.0.0",
                       "--max-concurrency", "4", "--triton-max-batch-size", "4"])
    values = values_from_args(args)
    triton = serve(values, tmp_path_factory.mktemp("triton"), Ports.free(), host="0.0.0.0")
    front = None
    try:
        front = start_openai(values, triton, "0.0.0.0", free_port(), MODEL, CHATML)
        yield triton, front
    finally:
        if front is not None:
            front.stop(5)
        stopped = triton.stop()
    assert stopped.drained and stopped.drain.in_flight == 0, "a generation outlived its test"
    assert not triton.shm_regions()


@pytest.fixture(scope="module")
def api(stack):
    _, front = stack
    return openai.OpenAI(base_url=f"http://127.0.0.1:{front.server.config.port}/v1", api_key="unused", max_retries=0)


def triton_inputs(prompts: list[str], max_tokens: int, stream: bool, **extra) -> list[grpcclient.InferInput]:
    """A request as upstream's client builds one: every input `[batch, 1]`, prompts stacked."""
    arrays = {"text_input": np.array([[p.encode()] for p in prompts], object),
              "max_tokens": np.full((len(prompts), 1), max_tokens, np.int32),
              "stream": np.full((len(prompts), 1), stream), "temperature": np.zeros((len(prompts), 1), np.float32),
              "top_p": np.zeros((len(prompts), 1), np.float32),  # upstream's "off"
              "end_id": np.full((len(prompts), 1), -1, np.int32)}
    arrays.update({name: np.full((len(prompts), 1), value) for name, value in extra.items()})
    inputs = []
    for name, array in arrays.items():
        infer_input = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def upstream_responses(triton, inputs, outputs: list[str]) -> list:
    """Send on a stream, close it, then read every response, as upstream's client does."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}")
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer("ensemble", inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in outputs])
    client.stop_stream()  # waits until the server closes the stream
    client.close()
    answers = []
    while not results.empty():
        answer = results.get()
        assert not isinstance(answer, Exception), answer
        answers.append(answer)
    return answers


def reference(pipeline, prompt: str, max_tokens: int, logprobs: list | None = None):
    request = pipeline.request(pipeline.encode(prompt), DecodeOptions(max_tokens=max_tokens, eos_token_id=-1),
                               SamplingParams(), logprobs=logprobs)
    return pipeline.generate_batch([request])[0]


# --- tensorrtllm_backend's client ---------------------------------------------------------

def test_text_output_reads_as_upstream_reads_it_streamed_and_not(stack, pipeline):
    triton, _ = stack
    expected = pipeline.decode(reference(pipeline, "the quick", 16).output_ids)
    whole = upstream_responses(triton, triton_inputs(["the quick"], 16, False), ["text_output"])
    assert [r.as_numpy("text_output").shape for r in whole] == [(1,)]
    assert whole[0].as_numpy("text_output")[0].decode("utf-8") == expected
    pieces = upstream_responses(triton, triton_inputs(["the quick"], 16, True), ["text_output"])
    assert len(pieces) > 2 and all(r.as_numpy("text_output").shape == (1,) for r in pieces)
    assert "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in pieces) == expected


def test_perf_metrics_on_every_response_carry_ssds_own_acceptance(stack):
    triton, _ = stack
    responses = upstream_responses(triton, triton_inputs(["lazy dog"], 24, True, return_perf_metrics=True,
                                                         num_draft_tokens=np.int32(4)),
                                   ["text_output", *PERF_OUTPUTS])
    figures = [{name: r.as_numpy(name)[0][0] for name in PERF_OUTPUTS} for r in responses]
    last = figures[-1]
    assert last["total_draft_tokens"] > 0 and 0 <= last["total_accepted_draft_tokens"] <= last["total_draft_tokens"]
    assert last["acceptance_rate"] == pytest.approx(last["total_accepted_draft_tokens"] / last["total_draft_tokens"])
    assert [f["total_draft_tokens"] for f in figures] == sorted(f["total_draft_tokens"] for f in figures)
    assert 0 < last["arrival_time_ns"] <= last["first_scheduled_time_ns"] <= last["first_token_time_ns"] \
        <= last["last_token_time_ns"] <= time.monotonic_ns()  # steady clock, as TensorRT-LLM's
    assert (last["kv_cache_alloc_new_blocks"], last["kv_cache_reused_blocks"]) == (2, 0)


def test_log_probs_are_the_targets_and_sum_to_cum_log_probs(stack, pipeline):
    triton, _ = stack
    expected_logprobs: list[float] = []
    reference(pipeline, "brown fox", 12, expected_logprobs)
    responses = upstream_responses(triton, triton_inputs(["brown fox"], 12, True, return_log_probs=True),
                                   ["text_output", "cum_log_probs", "output_log_probs"])
    got = [float(v) for r in responses for v in r.as_numpy("output_log_probs").reshape(-1)]
    assert got == pytest.approx(expected_logprobs, abs=1e-4)
    assert float(responses[-1].as_numpy("cum_log_probs")[0][0]) == pytest.approx(sum(expected_logprobs), abs=1e-3)


def test_a_batched_request_answers_each_prompt_under_its_batch_index(stack, pipeline):
    triton, _ = stack
    prompts = ["This is a test", "I want you to", "The cat is"]
    for stream in (False, True):
        responses = upstream_responses(triton, triton_inputs(prompts, 6, stream), ["text_output", "batch_index"])
        texts = [""] * len(prompts)
        for response in responses:
            index = response.as_numpy("batch_index")[0][0]
            texts[index] += response.as_numpy("text_output")[0].decode("utf-8")
        assert texts == [pipeline.decode(reference(pipeline, p, 6).output_ids) for p in prompts]


def test_a_server_not_decoupled_answers_the_unary_api(served_engines, tmp_path_factory, pipeline):
    args = parse_args(["--engines", str(served_engines), "--decoupled-mode", "false", "--max-concurrency", "2"])
    with serve(values_from_args(args), tmp_path_factory.mktemp("unary"), Ports.free()) as triton:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{triton.ports.http}")
        inputs = []
        for name, array in {"text_input": np.array([[b"over the"]], object),
                            "max_tokens": np.array([[10]], np.int32), "end_id": np.array([[-1]], np.int32)}.items():
            infer_input = httpclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else "INT32")
            infer_input.set_data_from_numpy(array)
            inputs.append(infer_input)
        result = client.infer("ensemble", inputs)
        assert result.as_numpy("text_output")[0].decode() == pipeline.decode(reference(pipeline, "over the", 10).output_ids)
        assert result.as_numpy("num_output_tokens")[0][0] == 10


# --- the OpenAI front end, with the official client ----------------------------------------------

def chat_reference(pipeline, messages, max_tokens: int) -> str:
    pipeline.tokenizer.chat_template = CHATML
    prompt = encode_chat(pipeline.tokenizer, messages)
    generation = pipeline.generate(prompt, DecodeOptions(max_tokens=max_tokens), SamplingParams())
    return pipeline.decode(generation.output_ids), len(prompt), len(generation.output_ids)


def test_the_openai_client_streams_a_chat_answer(api, pipeline):
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "the quick"}]
    expected, prompt_tokens, completion_tokens = chat_reference(pipeline, messages, 20)
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == prompt_tokens and chunks[-1].usage.completion_tokens == completion_tokens
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.model_extra["ssd"]["total_draft_tokens"] > 0


def test_the_openai_client_completes_with_stop_strings_logprobs_and_seeds(api, pipeline):
    expected = pipeline.decode(reference(pipeline, "jumps", 24).output_ids)
    whole = api.completions.create(model=MODEL, prompt="jumps", max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    stop = expected[8:11]
    stopped = api.completions.create(model=MODEL, prompt="jumps", max_tokens=24, temperature=0, stop=[stop],
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == expected[:expected.index(stop)] and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 24 and all(lp <= 0 for lp in stopped.choices[0].logprobs.token_logprobs)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=MODEL, prompt="jumps", max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == expected
    sampled = [api.completions.create(model=MODEL, prompt="jumps", max_tokens=16, temperature=0.9, seed=42)
               .choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed replays


def test_openai_errors_come_from_the_real_server_too(api):
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="'n'"):
        api.completions.create(model=MODEL, prompt="x", n=2)
    with pytest.raises(openai.APIStatusError) as too_long:
        api.completions.create(model=MODEL, prompt="the quick brown fox " * 5000)
    assert too_long.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="num_draft_tokens"):
        api.completions.create(model=MODEL, prompt="x", extra_body={"num_draft_tokens": 99})


def settled(triton, done, timeout_s: float = 15.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not done(text := metrics(triton.ports.metrics)):
        assert time.monotonic() < deadline, "the metrics never settled"
        time.sleep(0.05)
    return text


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(stack, api):
    triton, _ = stack
    before = metrics(triton.ports.metrics)
    cancelled = metric(before, "ssd_requests_total", finish_reason="cancelled")
    for stream in (True, False):
        client = openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=1.0)
        request = dict(model=MODEL, prompt="the quick", max_tokens=15000, temperature=0,
                       extra_body={"ignore_eos": True})
        if stream:
            chunks = client.completions.create(stream=True, **request)
            next(iter(chunks))
            next(iter(chunks))
            chunks.close()  # the connection goes away mid-stream
        else:
            with pytest.raises(openai.APITimeoutError):
                client.completions.create(**request)  # gives up after a second
        cancelled += 1
        after = settled(triton, lambda text: metric(text, "ssd_requests_total", finish_reason="cancelled") >= cancelled
                        and metric(text, "ssd_requests_in_flight") == 0)
        generated = metric(after, "ssd_generated_tokens_total") - metric(before, "ssd_generated_tokens_total")
        assert generated < 15000  # it stopped long before its end
    assert api.completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].text is not None


def test_concurrent_streams_each_get_their_own_text(api, pipeline):
    prompts = ["the quick", "lazy dog", "over the", "brown fox", "jumps", "Ωmega"]
    expected = {p: pipeline.decode(reference(pipeline, p, 20).output_ids) for p in prompts}
    got, errors = {}, []

    def one(prompt):
        try:
            got[prompt] = "".join(c.choices[0].text for c in api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and got == expected
