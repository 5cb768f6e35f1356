"""End to end against a real Triton Inference Server (tritonserver 2.51 from nvidia-pytriton).

One server for the whole session, started by the same code as `scripts/serve.py --engines`
on free ports and stopped at the end (cleanly, leaving no shared-memory region behind).
It serves engines built from the test pair; every expected text comes from the runtime
in this process over the same engines.
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from served import metric, one, raw, reference
from served import metrics as metrics_at

from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.models.detokenizer import prefix_window, text_delta
from saguaro.runtime.pipeline import Pipeline
from saguaro.serving.client import MODEL, CompletionError, complete, ensemble_inputs, stream_responses
from saguaro.serving.interface import IGNORED, NEUTRAL_ONLY
from saguaro.serving.launch import parse_args, serve
from saguaro.serving.model_repo import values_from_args
from saguaro.serving.responses import PERF_OUTPUTS
from saguaro.serving.triton_server import Ports

pytestmark = pytest.mark.server
REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick", "café 日本", "Ωmega", "lazy dog", "naïve 🌵", "over the", "brown fox", "jumps"]
# tensorrtllm_backend's ensemble inputs (inflight_batcher_llm v0.19, plus the names its
# TensorRT-LLM copy changed or added), with their Triton datatypes.
TENSORRTLLM_INPUTS = {
    "text_input": "BYTES", "decoder_text_input": "BYTES", "max_tokens": "INT32", "num_return_sequences": "INT32",
    "bad_words": "BYTES", "stop_words": "BYTES", "exclude_input_in_output": "BOOL", "end_id": "INT32",
    "pad_id": "INT32", "top_k": "INT32", "top_p": "FP32", "temperature": "FP32", "length_penalty": "FP32",
    "repetition_penalty": "FP32", "min_length": "INT32", "presence_penalty": "FP32", "frequency_penalty": "FP32",
    "random_seed": "UINT64", "return_log_probs": "BOOL", "return_context_logits": "BOOL",
    "return_generation_logits": "BOOL", "return_perf_metrics": "BOOL", "beam_width": "INT32", "stream": "BOOL",
    "prompt_embedding_table": "FP16", "prompt_table_extra_id": "UINT64", "prompt_vocab_size": "INT32",
    "embedding_bias_words": "BYTES", "embedding_bias_weights": "FP32", "lora_task_id": "UINT64",
    "lora_weights": "FP16", "lora_config": "INT32", "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES",
    "min_tokens": "INT32", "seed": "UINT64", "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL"}
SSD_INPUTS = {"chat": "BOOL", "decoding_mode": "BYTES", "num_draft_tokens": "INT32", "fanout": "INT32", "budget": "INT32",
              "saguaro_factor": "FP32"}


@pytest.fixture(scope="session")
def pipeline(served_engines):
    return Pipeline.load(engines=served_engines)


@pytest.fixture(scope="session")
def server(served_engines, tmp_path_factory):
    # K as asked and the default fan-out (not the hidden budget, none on these engines):
    # rounds the tests can predict from the runtime alone
    args = parse_args(["--engines", str(served_engines), "--fixed-k", "--fanout", "3"])
    triton = serve(values_from_args(args), tmp_path_factory.mktemp("triton"), Ports.free())
    try:
        yield triton
    finally:
        stopped = triton.stop()
    assert triton.stopped_cleanly, f"crashed, or a request was left in flight:\n{triton.log_tail()}"
    assert stopped.drained and stopped.drain.in_flight == 0, "a generation outlived its test"
    assert not triton.shm_regions(), "the stopped server left shared-memory regions"


@pytest.fixture
def client(server):
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}") as grpc_client:
        yield grpc_client


def metrics(server) -> str:
    return metrics_at(server.ports.metrics)


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
    assert inputs == {**TENSORRTLLM_INPUTS, **SSD_INPUTS}  # every tensorrtllm_backend input, and the SSD knobs
    assert set(NEUTRAL_ONLY) | set(IGNORED) <= set(inputs)
    assert {spec.name for spec in metadata.outputs} == {
        "text_output", "finish_reason", "accepted_histogram", "cache_hits", "cache_misses", "tokens_per_s",
        "num_input_tokens", "num_output_tokens", "sampling_seed", "batch_index", "sequence_index",
        "cum_log_probs", "output_log_probs", *PERF_OUTPUTS}
    config = client.get_model_config(MODEL).config
    assert config.platform == "ensemble" and all(spec.optional for spec in config.input)  # see config.pbtxt
    ssd = client.get_model_config("ssd").config
    assert ssd.model_transaction_policy.decoupled and ssd.backend == "python"
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
    older_name = complete(client, ensemble_inputs(PROMPTS[4], 40, False, end_id=-1, temperature=0.8, top_k=50,
                                                  top_p=0.95, random_seed=2**40 + 7))
    assert older_name.text == completion.text  # tensorrtllm_backend v0.19 calls it random_seed
    assert completion.seed == older_name.seed == 2**40 + 7 and other_seed.seed == 1


def test_unseeded_requests_get_fresh_seeds_that_replay(pipeline, client):
    unseeded = [complete(client, ensemble_inputs(PROMPTS[5], 40, False, end_id=-1, temperature=1.0))
                for _ in range(2)]
    assert unseeded[0].seed != unseeded[1].seed and unseeded[0].text != unseeded[1].text
    replay = complete(client, ensemble_inputs(PROMPTS[5], 40, False, end_id=-1, temperature=1.0,
                                              seed=unseeded[0].seed))
    assert replay.text == unseeded[0].text and replay.seed == unseeded[0].seed


def test_stop_words_end_the_text_after_them(pipeline, client):
    generated = reference(pipeline, PROMPTS[0], 40, end_id=-1)[0].output_ids
    codec_ids = [pipeline.tokenizer.encode(pipeline.decode([i]), add_special_tokens=False) for i in generated]
    stop_at = next(i for i in range(3, len(generated))  # a one-token word that CSV leaves whole
                   if codec_ids[i] == [generated[i]] and not set(pipeline.decode([generated[i]])) & set(',"'))
    completion = complete(client, ensemble_inputs(PROMPTS[0], 40, True, end_id=-1, bad_words=[""],
                                                  stop_words=[pipeline.decode([generated[stop_at]])]))
    assert completion.finish_reason == "stop"
    assert completion.text == pipeline.decode(generated[:generated.index(generated[stop_at]) + 1])


def round_groups(decode, chunks: list[list[int]], pieces: list[str]) -> list[int] | None:
    """How many of the runtime's rounds each streamed piece carries, when the pieces are its
    rounds detokenised as the server must, each response one round or consecutive rounds
    (a response still waiting in the outbox takes the next round's tokens); None if no such
    grouping gives these pieces."""
    def search(done: int, generated: list[int], piece: int) -> list[int] | None:
        if piece == len(pieces) - 1:  # the final response: what the detokenizer held back
            final = text_delta(decode, prefix_window(generated, len(generated)), [], final=True)
            return [] if done == len(chunks) and final == pieces[piece] else None
        for end in range(done + 1, len(chunks) + 1):
            grouped = [token for chunk in chunks[done:end] for token in chunk]
            if text_delta(decode, prefix_window(generated, len(generated)), grouped, final=False) == pieces[piece]:
                rest = search(end, generated + grouped, piece + 1)
                if rest is not None:
                    return [end - done] + rest
        return None
    return search(0, [], 0)


def test_streaming_delivers_every_token_once_and_in_order(pipeline, client):
    expected, chunks = reference(pipeline, PROMPTS[1], 60, end_id=-1)
    completion = complete(client, ensemble_inputs(PROMPTS[1], 60, True, end_id=-1))
    assert len(chunks) == expected.stats.rounds + 1 > 2  # the prefill's first token, then each round's
    groups = round_groups(pipeline.decode, chunks, completion.pieces)
    assert groups is not None, f"the pieces are not the rounds in order: {completion.pieces}"
    assert len(groups) > len(chunks) // 2  # streamed: alone, a stream gets about a response per round
    assert completion.text == pipeline.decode(expected.output_ids)


def test_round_groups_finds_merged_rounds_and_refuses_lost_or_reordered_tokens(pipeline):
    _, chunks = reference(pipeline, PROMPTS[1], 24, end_id=-1)
    decode = pipeline.decode

    def pieces_of(groups):
        generated, pieces, done = [], [], 0
        for size in groups:
            grouped = [token for chunk in chunks[done:done + size] for token in chunk]
            pieces.append(text_delta(decode, prefix_window(generated, len(generated)), grouped, final=False))
            generated, done = generated + grouped, done + size
        return pieces + [text_delta(decode, prefix_window(generated, len(generated)), [], final=True)]

    merged = [1] * (len(chunks) - 3) + [2, 1]
    found = round_groups(decode, chunks, pieces_of(merged))
    assert found is not None and sum(found) == len(chunks)
    assert "".join(pieces_of(found)) == "".join(pieces_of(merged))
    one_each = pieces_of([1] * len(chunks))
    lost = next(i for i, piece in enumerate(one_each[:-1]) if piece)
    assert round_groups(decode, chunks, one_each[:lost] + one_each[lost + 1:]) is None
    swap = next(i for i in range(len(one_each) - 2) if one_each[i] and one_each[i + 1] and
                one_each[i] != one_each[i + 1])
    swapped = one_each[:swap] + [one_each[swap + 1], one_each[swap]] + one_each[swap + 2:]
    assert round_groups(decode, chunks, swapped) is None


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


TEXT = one("text_input", "the quick", "BYTES")
MAX_TOKENS = one("max_tokens", 24, "INT32")
STREAM = one("stream", True, "BOOL")
NEVER_END = one("end_id", -1, "INT32")
# A value of each input that changes nothing, as a tensorrtllm_backend client may send it.
NEUTRAL_VALUES = [
    one("num_return_sequences", 1, "INT32"), one("beam_width", 1, "INT32"), one("repetition_penalty", 1.0, "FP32"),
    one("presence_penalty", 0.0, "FP32"), one("frequency_penalty", 0.0, "FP32"),
    ("embedding_bias_words", np.array([[b""]], object), "BYTES"),
    ("embedding_bias_weights", np.zeros((1, 0), np.float32), "FP32"), one("guided_decoding_guide_type", "", "BYTES"),
    one("guided_decoding_guide", "", "BYTES"), one("return_log_probs", False, "BOOL"),
    one("return_context_logits", False, "BOOL"), one("return_generation_logits", False, "BOOL"),
    one("decoder_text_input", "", "BYTES"), ("prompt_embedding_table", np.zeros((1, 0, 0), np.float16), "FP16"),
    one("prompt_vocab_size", 0, "INT32"), one("prompt_table_extra_id", 0, "UINT64"),
    ("lora_weights", np.zeros((1, 0, 0), np.float16), "FP16"), ("lora_config", np.zeros((1, 0, 3), np.int32), "INT32"),
    one("pad_id", 0, "INT32"), one("length_penalty", 0.5, "FP32"), one("return_perf_metrics", True, "BOOL"),
    one("return_num_input_tokens", True, "BOOL"), one("return_num_output_tokens", True, "BOOL"),
    one("exclude_input_in_output", True, "BOOL"), one("min_length", 1, "INT32"),
    ("bad_words", np.array([[b""]], object), "BYTES"), ("stop_words", np.array([[b""]], object), "BYTES")]
# A value of each input that SSD cannot honour.
UNHONOURED_VALUES = [
    one("num_return_sequences", 2, "INT32"), one("beam_width", 4, "INT32"), one("repetition_penalty", 1.3, "FP32"),
    one("presence_penalty", 0.5, "FP32"), one("frequency_penalty", 0.5, "FP32"),
    one("embedding_bias_words", "fox", "BYTES"), ("embedding_bias_weights", np.ones((1, 1), np.float32), "FP32"),
    one("guided_decoding_guide_type", "json", "BYTES"), one("guided_decoding_guide", "{}", "BYTES"),
    one("return_context_logits", True, "BOOL"),
    one("return_generation_logits", True, "BOOL"), one("decoder_text_input", "hello", "BYTES"),
    ("prompt_embedding_table", np.ones((1, 2, 2), np.float16), "FP16"), one("prompt_vocab_size", 2, "INT32"),
    one("prompt_table_extra_id", 3, "UINT64"), one("lora_task_id", 0, "UINT64"),
    ("lora_weights", np.ones((1, 1, 4), np.float16), "FP16"), ("lora_config", np.ones((1, 1, 3), np.int32), "INT32")]

BAD_REQUESTS = {
    "no inputs at all": (raw(), ["text_input", "max_tokens"]),
    "only stream": (raw(STREAM), ["text_input", "max_tokens"]),
    "stream and max_tokens, no text_input": (raw(STREAM, MAX_TOKENS), ["text_input"]),
    "text_input and stream, no max_tokens": (raw(TEXT, STREAM), ["max_tokens"]),
    "temperature and top_k only": (raw(one("temperature", 0.5, "FP32"), one("top_k", 3, "INT32")),
                                   ["text_input", "max_tokens"]),
    "max_tokens as FP32": (raw(TEXT, one("max_tokens", 4, "FP32")), ["max_tokens"]),
    "text_input of shape [1, 2]": (raw(("text_input", np.array([[b"a", b"b"]], dtype=object), "BYTES"),
                                       MAX_TOKENS), ["text_input"]),
    "empty text": (ensemble_inputs("", 4, True), ["text_input"]),
    "a 200 KB prompt": (ensemble_inputs("the quick brown fox " * 10_000, 4, True), ["text_input"]),
    "max_tokens 0": (ensemble_inputs("the quick", 0, True), ["max_tokens"]),
    "max_tokens beyond the context": (ensemble_inputs("the quick", 100_000, True), ["max_tokens"]),
    "unknown decoding mode": (ensemble_inputs("the quick", 4, True, decoding_mode="fast"), ["decoding_mode"]),
    "negative temperature": (ensemble_inputs("the quick", 4, True, temperature=-0.5), ["temperature"]),
    "bad words": (ensemble_inputs("the quick", 4, True, bad_words=["fox"]), ["bad_words"]),
    "fanout beyond the engines' branches": (ensemble_inputs("the quick", 4, True, fanout=[9]), ["fanout"]),
    "num_draft_tokens beyond the engines": (ensemble_inputs("the quick", 4, True, num_draft_tokens=20),
                                            ["num_draft_tokens"]),
    "min_length with the model's end token": (ensemble_inputs("the quick", 8, True, min_length=8), ["min_length"]),
    "seed and random_seed disagreeing": (ensemble_inputs("the quick", 4, True, seed=1, random_seed=2),
                                         ["seed", "random_seed"]),
    **{f"{name} that SSD cannot honour": (raw(TEXT, MAX_TOKENS, (name, array, datatype)), [name])
       for name, array, datatype in UNHONOURED_VALUES},
    "chat without a chat template": (ensemble_inputs("the quick", 4, True, chat=True), ["chat"]),
}
PROMPT_IDS = one("input_ids", 5, "INT32")
DIRECT_BAD_REQUESTS = {  # to the ssd model itself, in its own input names
    "no input_ids": (raw(one("max_tokens", 4, "INT32")), ["input_ids"]),
    "neither input_ids nor max_tokens": (raw(STREAM), ["input_ids", "max_tokens"]),
    "token ids beyond the vocabulary": (raw(("input_ids", np.array([[1, 99_999]], np.int32), "INT32"),
                                            MAX_TOKENS), ["input_ids"]),
    "stop_words_list of shape [1, 3, 2]": (raw(PROMPT_IDS, MAX_TOKENS,
                                               ("stop_words_list", np.zeros((1, 3, 2), np.int32), "INT32")),
                                           ["stop_words_list"]),
    "a drain request without the server's token": (raw(one("control", "drain", "BYTES"),
                                                       one("control_token", "guess", "BYTES")), ["control_token"]),
}


def test_bad_requests_get_errors_naming_the_input_and_the_server_keeps_serving(server, client):
    for model, table in ((MODEL, BAD_REQUESTS), ("ssd", DIRECT_BAD_REQUESTS)):
        for case, (inputs, named) in table.items():
            with pytest.raises(CompletionError) as refused:
                complete(client, inputs, timeout_s=30, model=model)
            message = str(refused.value)
            assert all(f"'{name}'" in message for name in named), f"{case}: {message}"
            assert "--" not in message, f"{case} speaks in command-line flags: {message}"
    assert complete(client, ensemble_inputs("the quick", 8, True, end_id=-1)).finish_reason == "length"
    settled_metrics(server, lambda text: metric(text, "ssd_requests_in_flight") == 0)


@pytest.mark.parametrize("stream", [True, False])
def test_every_tensorrtllm_backend_input_at_a_neutral_value_changes_nothing(pipeline, client, stream):
    expected, _ = reference(pipeline, "the quick", 24, end_id=-1)
    completion = complete(client, raw(TEXT, MAX_TOKENS, one("stream", stream, "BOOL"), NEVER_END, *NEUTRAL_VALUES))
    assert completion.text == pipeline.decode(expected.output_ids) and completion.finish_reason == "length"
    assert (completion.num_input_tokens, completion.num_output_tokens) == (len(pipeline.encode("the quick")), 24)


def test_genai_perfs_request_is_served(pipeline, client):
    """genai-perf 0.0.16 `--backend tensorrtllm --streaming --output-tokens-mean 32
    --output-tokens-mean-deterministic --extra-inputs end_id:-1` sends exactly these."""
    expected, _ = reference(pipeline, PROMPTS[5], 32, end_id=-1)
    completion = complete(client, raw(one("text_input", PROMPTS[5], "BYTES"), one("max_tokens", 32, "INT32"),
                                      one("exclude_input_in_output", True, "BOOL"), STREAM,
                                      one("min_length", 32, "INT32"), NEVER_END))
    assert completion.text == pipeline.decode(expected.output_ids) and completion.num_output_tokens == 32
    # text deltas, as genai-perf counts them: the prefill's first token, one per round and
    # the final, fewer when the model's outbox was behind and a response took the rounds
    # kept until it was sent
    assert 1 < len(completion.pieces) <= expected.stats.rounds + 2


def test_exclude_input_in_output_false_repeats_the_prompt(pipeline, client):
    prompt_ids = pipeline.encode(PROMPTS[3])
    generated = reference(pipeline, PROMPTS[3], 16, end_id=-1)[0].output_ids
    echoed = complete(client, ensemble_inputs(PROMPTS[3], 16, False, end_id=-1, exclude_input_in_output=False))
    assert echoed.text == pipeline.decode(prompt_ids + generated) and echoed.text.startswith(PROMPTS[3])
    assert echoed.num_output_tokens == 16
    streamed = complete(client, ensemble_inputs(PROMPTS[3], 16, True, end_id=-1, exclude_input_in_output=False))
    assert streamed.text == pipeline.decode(generated)  # like TensorRT-LLM, a stream never repeats the prompt


def test_an_all_zero_fanout_means_no_prespeculation(pipeline, client):
    expected, _ = reference(pipeline, PROMPTS[0], 32, mode="speculative", end_id=-1)
    for fanout in ([0], [0, 0, 0, 0, 0]):
        completion = complete(client, ensemble_inputs(PROMPTS[0], 32, True, end_id=-1, fanout=fanout))
        assert completion.text == pipeline.decode(expected.output_ids)
        assert completion.accepted_histogram == expected.stats.accepted_histogram
        assert (completion.cache_hits, completion.cache_misses) == (0, 0)


# --- cancellation and clients that go away ----------------------------------------------

def stopped_and_idle(server, before: str, count: int = 1) -> str:
    """Metrics once `count` more generations ended cancelled and none is in flight."""
    cancelled = metric(before, "ssd_requests_total", finish_reason="cancelled") + count
    return settled_metrics(server, lambda text: metric(text, "ssd_requests_total", finish_reason="cancelled")
                           >= cancelled and metric(text, "ssd_requests_in_flight") == 0)


def generated_since(before: str, after: str) -> float:
    return metric(after, "ssd_generated_tokens_total") - metric(before, "ssd_generated_tokens_total")


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
    generated = generated_since(before, stopped_and_idle(server, before))
    assert 1 <= generated < room / 2  # stopped long before its max_tokens
    wait_for_succeeded(client, succeeded_before + 1)  # the ensemble request ended too
    followup = complete(client, ensemble_inputs(PROMPTS[0], 8, True, end_id=-1))
    assert followup.finish_reason == "length"


def test_cancelling_requests_not_streamed_stops_them_and_frees_their_slots(pipeline, server, client):
    """As many non-streamed requests as there are generation slots, cancelled together: all
    stop (heartbeats carry Triton's cancellation to postprocessing), and the next request
    gets a slot at once."""
    before, slots = metrics(server), pipeline.max_active  # the engines' KV slots
    room = pipeline.max_context - len(pipeline.encode(PROMPTS[1]))
    client.start_stream(callback=lambda result, error: None)
    for _ in range(slots):
        client.async_stream_infer(MODEL, ensemble_inputs(PROMPTS[1], room, False, decoding_mode="autoregressive",
                                                         end_id=-1), enable_empty_final_response=True)
    settled_metrics(server, lambda text: metric(text, "ssd_requests_in_flight") == slots, timeout_s=30)
    time.sleep(0.3)  # every slot generating
    client.stop_stream(cancel_requests=True)
    generated = generated_since(before, stopped_and_idle(server, before, slots))
    assert slots <= generated < slots * room / 4
    followup = complete(client, ensemble_inputs(PROMPTS[1], 8, False, end_id=-1), timeout_s=30)
    assert followup.finish_reason == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_a_killed_client_stops_its_generation(pipeline, server, stream):
    before = metrics(server)
    room = pipeline.max_context - len(pipeline.encode(PROMPTS[2]))
    command = [sys.executable, str(REPO_ROOT / "scripts" / "client.py"), "--url", f"127.0.0.1:{server.ports.grpc}",
               "--prompt", PROMPTS[2], "--max-tokens", str(room), "--end-id", "-1", "--decoding-mode",
               "autoregressive", "--wait", "30"] + (["--stream"] if stream else [])
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as killed:
        settled_metrics(server, lambda text: metric(text, "ssd_requests_in_flight") >= 1, timeout_s=60)
        time.sleep(0.3)
        killed.kill()  # SIGKILL: the client cannot say goodbye
    generated = generated_since(before, stopped_and_idle(server, before))
    assert 1 <= generated < room / 2


def test_the_ssd_model_called_directly_streams_validates_and_cancels(pipeline, server, client):
    """Clients may skip the ensemble (token ids in, token ids out), like tensorrt_llm's model."""
    prompt = np.array([pipeline.encode(PROMPTS[3])], dtype=np.int32)
    room = pipeline.max_context - prompt.shape[1]
    inputs = raw(("input_ids", prompt, "INT32"), one("max_tokens", room, "INT32"), STREAM, NEVER_END)
    responses, before = queue.Queue(), metrics(server)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ssd", inputs, enable_empty_final_response=True)
    result, error = responses.get(timeout=30)
    assert error is None and result.as_numpy("output_ids").size >= 1
    client.stop_stream(cancel_requests=True)
    assert generated_since(before, stopped_and_idle(server, before)) < room / 2
    empty_stop_words = raw(("input_ids", prompt, "INT32"), one("max_tokens", 4, "INT32"),
                           ("stop_words_list", np.zeros((1, 2, 0), np.int32), "INT32"))
    final = list(stream_responses(client, "ssd", empty_stop_words))[-1]
    assert final.as_numpy("finish_reason").reshape(-1)[0] == b"length"  # [1, 2, 0]: no stop words


def test_metrics_endpoint_reports_the_ssd_figures(server, client):
    complete(client, ensemble_inputs(PROMPTS[2], 24, True, end_id=-1))
    text = metrics(server)
    for name in ("ssd_generated_tokens_total", "ssd_rounds_total", "ssd_accepted_draft_tokens_total",
                 "ssd_verified_draft_tokens_total", "ssd_cache_hits_total", "ssd_cache_misses_total"):
        assert f"# TYPE {name} counter" in text
    assert metric(text, "ssd_generated_tokens_total") >= 24 and metric(text, "ssd_rounds_total") >= 1
    assert metric(text, "ssd_cache_hits_total") + metric(text, "ssd_cache_misses_total") >= 1
    assert metric(text, "ssd_request_tokens_per_second_count") >= 1
    assert metric(text, "ssd_batch_size_count") >= 1
    drafted, accepted = metric(text, "ssd_verified_draft_tokens_total"), metric(text, "ssd_accepted_draft_tokens_total")
    assert drafted > 0 and drafted >= accepted  # counted when each request ends
    assert metric(text, "nv_inference_request_success", model="ensemble") >= 1  # Triton's own
    assert "# TYPE ssd_undrafted_rounds_total counter" in text
    assert "# TYPE ssd_target_alone_rounds_total counter" in text


def test_the_metrics_say_why_a_round_drafted_nothing(server, client):
    """An autoregressive request's rounds draft nothing because nothing asked them to."""
    before = metrics(server)
    complete(client, ensemble_inputs(PROMPTS[1], 16, False, end_id=-1, decoding_mode="autoregressive"))
    after = settled_metrics(server, lambda text: metric(text, "ssd_requests_in_flight") == 0)

    def grown(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)
    rounds = grown("ssd_batch_size_count")
    assert rounds >= 15 and grown("ssd_undrafted_rounds_total", reason="asked") == rounds
    assert all(grown("ssd_undrafted_rounds_total", reason=why) == 0 for why in ("clock", "held", "priced"))
    assert grown("ssd_target_alone_rounds_total") <= rounds  # a count of rounds, not of requests' rounds


def test_requests_beyond_the_kv_slots_queue_and_all_complete_in_one_batch(pipeline, server, client):
    """More requests than slots: the rest wait (the queue gauge shows it), rounds batch
    several requests at once (the batch-size histogram), and every text is the one the
    request gives alone."""
    count = pipeline.max_active + 4
    expected = [pipeline.decode(reference(pipeline, PROMPTS[i % len(PROMPTS)], 300, "ssd", -1)[0].output_ids)
                for i in range(count)]
    before = metrics(server)
    results, peak_queued = {}, [0.0]

    def run(index):
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}") as own_client:
            results[index] = complete(own_client, ensemble_inputs(PROMPTS[index % len(PROMPTS)], 300, False,
                                                                  end_id=-1), timeout_s=120).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        peak_queued[0] = max(peak_queued[0], metric(metrics(server), "ssd_requests_queued"))
        time.sleep(0.02)
    assert [results[i] for i in range(count)] == expected
    after = metrics(server)
    rounds = metric(after, "ssd_batch_size_count") - metric(before, "ssd_batch_size_count")
    requests_in_rounds = metric(after, "ssd_batch_size_sum") - metric(before, "ssd_batch_size_sum")
    assert requests_in_rounds / rounds > 1.5  # rounds ran several requests together
    assert peak_queued[0] >= 1


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
