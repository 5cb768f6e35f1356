"""Serving logic without a server: detokenisation, request validation, word lists, and the
response stream that the Triton SSD model sends (driven here by the real runtime)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoints import byte_level_tokenizer

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.models.checkpoint import load_tokenizer
from saguaro.runtime.models.detokenizer import PREFIX_TOKENS, prefix_window, stream_text, text_delta
from saguaro.runtime.models.prompts import chat_messages, encode_chat
from saguaro.runtime.pipeline import Pipeline, RequestError
from saguaro.serving.interface import IGNORED, NEUTRAL_ONLY
from saguaro.serving.lifecycle import (
    CANCELLED,
    SHUTDOWN,
    DrainReport,
    Generations,
    ServerDraining,
    drain_inputs,
    parse_drain_request,
)
from saguaro.serving.model_repo import (
    ModelSource,
    default_options,
    parse_args,
    prepare_model_repo,
    templates_dir,
    values_from_args,
)
from saguaro.serving.requests import (
    INPUT_NAMES,
    ModelLimits,
    ServingRequest,
    TextCodec,
    defaults_from_parameters,
    parse_request,
    parse_word_list,
    split_words,
    word_list,
)
from saguaro.serving.responses import first_stop_end, run_request, start_request
from saguaro.serving.settings import parse_stream_interval, rounds_per_response
from saguaro.serving.triton_server import pending_signals

LIMITS = ModelLimits(max_context=64, vocab_size=300, eos_token_id=2)


@pytest.fixture(scope="module")
def pipeline(tiny_pair):
    return Pipeline.load(target=tiny_pair / "target", draft=tiny_pair / "draft")


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


# --- detokenisation --------------------------------------------------------------------

def test_a_character_split_across_chunks_arrives_whole(tokenizer):
    ids = tokenizer.encode("a日本b", add_special_tokens=False)
    assert len(ids) >= 4, "each CJK character should span several byte tokens"
    decode = decoder(tokenizer)
    pieces = [text_delta(decode, prefix_window(ids, i), [ids[i]], final=False) for i in range(len(ids))]
    assert "".join(pieces) == "a日本b"
    assert all("\ufffd" not in piece for piece in pieces)
    assert "日" in pieces and "本" in pieces  # each printed once, whole, by the token completing it


def test_random_chunkings_reproduce_the_full_decode(tokenizer):
    """Random ids include invalid and truncated UTF-8; chunks of 1-6 tokens like rounds."""
    decode, rng = decoder(tokenizer), random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randrange(0, 12))))
        chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        assert stream_text(decode, chunks) == decode(ids)


def test_final_chunk_flushes_an_incomplete_character(tokenizer):
    decode = decoder(tokenizer)
    ids = tokenizer.encode("x日", add_special_tokens=False)[:-1]  # ends inside the character
    assert text_delta(decode, [], ids, final=False) == "x"
    assert text_delta(decode, [], ids, final=True) == decode(ids) == "x\ufffd"


def test_prefix_window_is_the_tokens_just_before():
    generated = list(range(20))
    assert prefix_window(generated, 20) == generated[20 - PREFIX_TOKENS:]
    assert prefix_window(generated, 3) == [0, 1, 2]
    assert prefix_window(generated, 0) == []


# --- request parsing -------------------------------------------------------------------

def request_inputs(**overrides) -> dict:
    inputs = {"input_ids": np.array([[1, 5, 6]], np.int32), "max_tokens": np.array([[8]], np.int32)}
    for name, value in overrides.items():
        if value is None:
            inputs.pop(name, None)
        elif isinstance(value, np.ndarray) and value.ndim >= 2:  # already with its batch dimension
            inputs[name] = value
        elif isinstance(value, str):  # Triton hands strings over as bytes
            inputs[name] = np.array([[value.encode()]], dtype=object)
        else:
            inputs[name] = np.array([value if isinstance(value, list) else [value]])
    return inputs


def parse(defaults=DecodeOptions(), **overrides) -> ServingRequest:
    return parse_request(request_inputs(**overrides).get, defaults, LIMITS)


def test_a_full_request_parses_into_runtime_options():
    request = parse(stream=True, temperature=np.float32(0.5), top_k=7, top_p=np.float32(0.5), seed=np.uint64(9),
                    end_id=-1, decoding_mode="speculative", num_draft_tokens=2, fanout=[1, 2, 3], budget=4,
                    saguaro_factor=np.float32(0.5))
    assert request.prompt_ids == [1, 5, 6] and request.stream
    assert request.options == DecodeOptions(mode="speculative", num_draft_tokens=2, fanout=(1, 2, 3), budget=4,
                                            saguaro_factor=0.5, max_tokens=8, eos_token_id=-1)
    assert request.sampling == SamplingParams(temperature=0.5, top_k=7, top_p=0.5, seed=9)


def test_left_out_knobs_take_the_configured_defaults():
    defaults = defaults_from_parameters({"default_decoding_mode": "speculative",
                                                "default_num_draft_tokens": "3", "default_fanout": "2",
                                                "default_budget": " "})
    request = parse(defaults)
    assert (request.options.mode, request.options.num_draft_tokens, request.options.fanout) == ("speculative", 3, (2,))
    assert request.options.budget is None and not request.stream and request.sampling.greedy


def test_server_defaults_spend_the_budget_that_hides():
    """Left-out branch knobs take what the build measured to hide under one verify, at
    most the default fan-out; engines built without a measurement keep the default."""
    def defaults(hidden):
        source = ModelSource(tokenizer_dir=Path("."), max_context=256, max_draft_tokens=8, max_branches=16,
                             hidden_branches=hidden)
        return default_options(source, "ssd", None, None, None)

    assert defaults((16,) * 9).fanout == (3,)  # K=4: 16 hide, at most 3 per depth
    assert defaults((0,) * 9).fanout == (0,) and not defaults((0,) * 9).prespeculating
    assert defaults((3,) * 9).budget == 3      # fewer than one per depth: placed online
    assert defaults(None).fanout == (3,) and defaults(None).budget is None


def test_bad_configured_defaults_fail_at_load():
    with pytest.raises(ValueError, match="decoding mode"):
        defaults_from_parameters({"default_decoding_mode": "fast"})


@pytest.mark.parametrize("overrides, named", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": list(range(64))}, "input_ids"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 62}, "max_tokens"),          # 3 prompt tokens + 62 > 64
    ({"max_tokens": [4, 4]}, "max_tokens"),      # one value per request
    ({"decoding_mode": "fast"}, "decoding_mode"),
    ({"temperature": np.float32(-0.1)}, "temperature"),
    ({"temperature": np.float32("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": np.float32(1.5)}, "top_p"),
    ({"num_draft_tokens": -1}, "num_draft_tokens"),
    ({"fanout": [1, 2]}, "fanout"),              # neither 1 nor K+1 = 5 values
    ({"budget": 0}, "budget"),
    ({"saguaro_factor": np.float32(2)}, "saguaro_factor"),
    ({"end_id": 300}, "end_id"),
    ({"input_ids": [1, 300]}, "input_ids"),      # beyond the vocabulary
    ({"input_ids": [-1, 5]}, "input_ids"),
    ({"stop_words_list": np.zeros((1, 3, 2), np.int32)}, "stop_words_list"),
    ({"stop_words_list": np.array([[[5, 6], [2, 1]]], np.int32)}, "stop_words_list"),  # offsets decrease
    ({"min_length": 4}, "min_length"),           # would ban the end token
    ({"min_tokens": 4}, "min_tokens"),
    ({"seed": np.uint64(1), "random_seed": np.uint64(2)}, "random_seed"),
    ({"min_length": 4, "min_tokens": 5, "end_id": -1}, "min_tokens"),
])
def test_each_bad_input_is_refused_naming_it(overrides, named):
    with pytest.raises(RequestError, match=f"'{named}'") as refused:
        parse(**overrides)
    assert "--" not in str(refused.value)  # the interface's words, not command-line flags


@pytest.mark.parametrize("left_out", [["input_ids"], ["max_tokens"], ["input_ids", "max_tokens"]])
def test_every_missing_required_input_is_named(left_out):
    with pytest.raises(RequestError, match="missing required input") as refused:
        parse(stream=True, **{name: None for name in left_out})
    assert all(f"'{name}'" in str(refused.value) for name in left_out)


NON_NEUTRAL = {"num_return_sequences": 2, "beam_width": 4, "repetition_penalty": np.float32(1.2),
               "presence_penalty": np.float32(0.5), "frequency_penalty": np.float32(0.5),
               "embedding_bias_words": "fox", "embedding_bias_weights": [np.float32(1.0)],
               "guided_decoding_guide_type": "json", "guided_decoding_guide": "{}",
               "return_context_logits": True, "return_generation_logits": True, "decoder_text_input": "x",
               "prompt_embedding_table": [np.float16(0.5)], "prompt_vocab_size": 3,
               "prompt_table_extra_id": np.uint64(1), "lora_task_id": np.uint64(0), "lora_weights": [np.float16(1)],
               "lora_config": [1, 2, 3]}
NEUTRAL = {"num_return_sequences": 1, "beam_width": 1, "repetition_penalty": np.float32(1.0),
           "presence_penalty": np.float32(0), "frequency_penalty": np.float32(0), "embedding_bias_words": "",
           "embedding_bias_weights": np.zeros((1, 0), np.float32), "guided_decoding_guide_type": "",
           "guided_decoding_guide": "", "return_context_logits": False,
           "return_generation_logits": False, "decoder_text_input": "",
           "prompt_embedding_table": np.zeros((1, 0, 0), np.float16), "prompt_vocab_size": 0,
           "prompt_table_extra_id": np.uint64(0), "lora_weights": np.zeros((1, 0, 0), np.float16),
           "lora_config": np.zeros((1, 0, 3), np.int32)}


def test_the_neutral_only_tables_cover_each_other():
    assert set(NON_NEUTRAL) == set(NEUTRAL_ONLY) and set(NEUTRAL) == set(NEUTRAL_ONLY) - {"lora_task_id"}
    assert not set(IGNORED) & set(NEUTRAL_ONLY)


@pytest.mark.parametrize("name", sorted(NON_NEUTRAL))
def test_a_value_ssd_cannot_honour_is_refused_saying_why(name):
    with pytest.raises(RequestError, match=f"input '{name}'.*cannot be honoured: .+ \\(accepted: "):
        parse(**{name: NON_NEUTRAL[name]})


def test_neutral_and_ignored_inputs_change_nothing():
    ignored = {"pad_id": 7, "length_penalty": np.float32(0.3),
               "return_num_input_tokens": True, "return_num_output_tokens": False}
    assert set(ignored) == set(IGNORED)
    assert parse(**NEUTRAL, **ignored) == parse()


def test_honoured_aliases_and_moot_min_length():
    assert parse(random_seed=np.uint64(9)).sampling.seed == 9
    assert parse(seed=np.uint64(9), random_seed=np.uint64(9)).sampling.seed == 9
    for moot in ({"min_length": 1}, {"min_length": 40, "end_id": -1}, {"min_tokens": 40, "end_id": -1}):
        parse(**moot)  # bans nothing: accepted
    assert parse().exclude_input and not parse(exclude_input_in_output=False).exclude_input


@pytest.mark.parametrize("options, named", [(DecodeOptions(num_draft_tokens=2, fanout=(99,)), "fanout"),
                                             (DecodeOptions(num_draft_tokens=99), "num_draft_tokens")])
def test_engine_limits_are_named_as_inputs(tiny_engines, options, named):
    engines = Pipeline.load(engines=tiny_engines)
    with pytest.raises(RequestError, match=f"'{named}'") as refused:
        engines.check_request([1, 2], options, INPUT_NAMES)
    assert "--" not in str(refused.value)
    with pytest.raises(RequestError, match=f"--{named.replace('_', '-')}"):  # the command line keeps its words
        engines.check_request([1, 2], options)


def test_max_tokens_may_fill_the_context_exactly():
    assert parse(max_tokens=61).options.max_tokens == 61


# --- word lists and stop sequences -----------------------------------------------------

def test_word_lists_round_trip_in_tensorrtllm_layout():
    words = {"ab": [7, 8], "c": [9]}
    array = word_list(lambda word: words[word], ["ab", "c"])
    assert array.tolist() == [[7, 8, 9], [2, 3, -1]]
    assert parse_word_list(array[np.newaxis]) == [[7, 8], [9]]
    assert parse_word_list(word_list(lambda word: [], [])) == []
    assert parse_word_list(np.zeros((1, 2, 0), np.int32)) == []  # an empty list of shape [1, 2, 0]


def test_words_are_read_as_csv_like_tensorrtllm_backend():
    assert split_words(['foo,"a, b"', "", "bar"]) == ["foo", "a, b", "bar"]


def test_stop_sequence_found_where_it_ends_first():
    generated = [5, 1, 2, 3, 1, 2]
    assert first_stop_end(generated, 0, [[1, 2]]) == 3
    assert first_stop_end(generated, 3, [[1, 2]]) == 6      # only ends after `start` count
    assert first_stop_end(generated, 2, [[2, 3], [5]]) == 4
    assert first_stop_end(generated, 0, [[4]]) is None


# --- the response stream, over the real runtime ----------------------------------------

def collect(pipeline, request, cancel_after: int | None = None, reason: str = CANCELLED):
    sent = []
    outcome = run_request(pipeline, request, lambda arrays, final: sent.append((arrays, final)),
                          stop_reason=lambda: reason if cancel_after is not None and len(sent) >= cancel_after
                          else None)
    return sent, outcome


def new_ids(sent) -> list[int]:
    return [int(i) for arrays, _ in sent for i in arrays["output_ids"].reshape(-1)]


def test_streaming_sends_each_round_then_a_final_response_with_stats(pipeline):
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(max_tokens=24, eos_token_id=-1)
    reference = pipeline.generate(prompt, options, SamplingParams())
    sent, outcome = collect(pipeline, ServingRequest(prompt, options, SamplingParams(), stream=True))
    assert new_ids(sent) == reference.output_ids == outcome.output_ids
    assert [final for _, final in sent] == [False] * (reference.stats.rounds + 1) + [True]  # the prefill's token too
    final = sent[-1][0]
    assert final["output_ids"].size == 0 and final["finish_reason"].tolist() == [[b"length"]]
    assert final["accepted_histogram"].reshape(-1).tolist() == reference.stats.accepted_histogram
    assert int(final["cache_hits"][0, 0]) == reference.stats.cache_hits
    assert all("finish_reason" not in arrays and "cache_hits" not in arrays for arrays, _ in sent[:-1])
    for index, (arrays, _) in enumerate(sent):  # each response brings the tokens before its own
        before = new_ids(sent[:index])
        assert arrays["prefix_ids"].reshape(-1).tolist() == before[max(0, len(before) - PREFIX_TOKENS):]


def test_sends_go_through_post_in_order_and_what_the_interval_kept_back_precedes_the_final(pipeline):
    """Responses are built in the round and handed to `post` (the Triton model's outbox
    thread); with an interval longer than the generation, one response carries every
    token, with their log-probabilities and the text, just before the final one."""
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(max_tokens=24, eos_token_id=-1)
    logprobs: list[float] = []
    reference = pipeline.generate_batch([pipeline.request(prompt, options, SamplingParams(), logprobs=logprobs)])[0]
    posted, sent = [], []
    request = ServingRequest(prompt, options, SamplingParams(), stream=True, logprobs=True)
    outcome = start_request(pipeline, request, lambda arrays, final: sent.append((arrays, final)),
                            stop_reason=lambda: None, decode=pipeline.decode, post=posted.append,
                            interval=lambda: 1000).result()
    assert len(posted) == 2 and not sent  # nothing is sent but through `post`
    for work in posted:
        work()
    (update, _), (final, is_final) = sent
    assert is_final and new_ids(sent) == reference.output_ids == outcome.output_ids and reference.stats.rounds > 1
    assert update["output_log_probs"].reshape(-1).tolist() == pytest.approx(logprobs) and len(logprobs) == 24
    assert update["text_output"].reshape(-1)[0].decode() == pipeline.decode(reference.output_ids)


def test_a_stream_keeps_one_response_waiting_in_post_which_takes_every_token_kept_until_it_is_sent(pipeline):
    """An outbox that falls behind the rounds gets one response per stream, not one per
    round: the waiting response is built when it is sent and carries every round since."""
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(max_tokens=24, eos_token_id=-1)
    reference = pipeline.generate(prompt, options, SamplingParams())
    posted, sent = [], []

    def slow_post(work) -> None:  # runs the waiting work only every fourth post
        posted.append(work)
        if len(posted) % 4 == 0:
            while posted:
                posted.pop(0)()

    request = ServingRequest(prompt, options, SamplingParams(), stream=True)
    start_request(pipeline, request, lambda arrays, final: sent.append((arrays, final)), stop_reason=lambda: None,
                  post=slow_post, interval=lambda: 1).result()
    while posted:
        posted.pop(0)()
    assert new_ids(sent) == reference.output_ids and sent[-1][1] and reference.stats.rounds > 4
    updates = [arrays for arrays, final in sent if not final]
    assert len(updates) < reference.stats.rounds  # coalesced: fewer responses than rounds
    for index, (arrays, _) in enumerate(sent):
        before = new_ids(sent[:index])
        assert arrays["prefix_ids"].reshape(-1).tolist() == before[max(0, len(before) - PREFIX_TOKENS):]
        assert int(arrays["num_output_tokens"][0, 0]) == len(before) + arrays["output_ids"].size


def test_a_final_response_that_goes_ahead_of_a_waiting_update_takes_its_tokens(pipeline):
    """An outbox that sends urgent work first (`Urgent`: the first tokens, the final
    response) may send a stream's final response before its last routine update: the final
    one then brings the kept tokens, and the update, run later, sends nothing."""
    from saguaro.serving.responses import Urgent

    prompt = pipeline.encode("the quick")
    options = DecodeOptions(max_tokens=24, eos_token_id=-1)
    reference = pipeline.generate(prompt, options, SamplingParams())
    posted, sent = [], []

    def post(work) -> None:  # the first tokens go out at once, then the outbox falls behind
        if sent:
            posted.append(work)
        else:
            assert isinstance(work, Urgent)
            work()

    request = ServingRequest(prompt, options, SamplingParams(), stream=True)
    start_request(pipeline, request, lambda arrays, final: sent.append((arrays, final)), stop_reason=lambda: None,
                  post=post, interval=lambda: 1).result()
    (update, final) = posted  # one update waiting (it takes every round since), then the final response
    assert not isinstance(update, Urgent) and isinstance(final, Urgent)
    final()
    update()
    assert new_ids(sent) == reference.output_ids and sent[-1][1]
    assert len(sent) == 3 and not sent[1][1]  # first tokens, the rest, the final response
    assert 0 < sent[0][0]["output_ids"].size < len(reference.output_ids)


def test_a_stream_sent_every_third_round_loses_no_token_and_ends_with_the_rest(pipeline):
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(max_tokens=24, eos_token_id=-1)
    reference = pipeline.generate(prompt, options, SamplingParams())
    sent: list = []
    request = ServingRequest(prompt, options, SamplingParams(), stream=True)
    start_request(pipeline, request, lambda arrays, final: sent.append((arrays, final)), stop_reason=lambda: None,
                  interval=lambda: 3).result()
    assert new_ids(sent) == reference.output_ids and sent[-1][1] and sent[-1][0]["output_ids"].size == 0
    updates, later = len(sent) - 1, reference.stats.rounds - 1
    assert updates == 1 + later // 3 + (later % 3 > 0)  # the first round at once, the rest before the end
    for index, (arrays, _) in enumerate(sent):
        before = new_ids(sent[:index])
        assert arrays["prefix_ids"].reshape(-1).tolist() == before[max(0, len(before) - PREFIX_TOKENS):]


def test_without_streaming_a_heartbeat_per_round_then_one_final_response_carries_everything(pipeline):
    prompt = pipeline.encode("café")
    options = DecodeOptions(max_tokens=16, eos_token_id=-1)
    reference = pipeline.generate(prompt, options, SamplingParams())
    sent, outcome = collect(pipeline, ServingRequest(prompt, options, SamplingParams(), stream=False))
    heartbeats, (final, is_final) = sent[:-1], sent[-1]
    assert len(heartbeats) == reference.stats.rounds + 1 and is_final  # the prefill's token, then each round
    assert all(arrays["output_ids"].size == 0 and not arrays["is_final"].all() and not final_flag
               for arrays, final_flag in heartbeats)  # no tokens: postprocessing answers nothing
    assert final["output_ids"].reshape(-1).tolist() == reference.output_ids and final["prefix_ids"].size == 0
    assert (int(final["num_input_tokens"][0, 0]), int(final["num_output_tokens"][0, 0])) == (len(prompt), 16)


def test_exclude_input_in_output_false_repeats_the_prompt_unless_streaming(pipeline):
    prompt = pipeline.encode("café")
    options = DecodeOptions(max_tokens=8, eos_token_id=-1)
    generated = pipeline.generate(prompt, options, SamplingParams()).output_ids
    sent, _ = collect(pipeline, ServingRequest(prompt, options, SamplingParams(), exclude_input=False))
    assert sent[-1][0]["output_ids"].reshape(-1).tolist() == prompt + generated
    assert int(sent[-1][0]["num_output_tokens"][0, 0]) == len(generated)
    streamed, _ = collect(pipeline, ServingRequest(prompt, options, SamplingParams(), stream=True, exclude_input=False))
    assert new_ids(streamed) == generated  # like TensorRT-LLM, a stream never repeats the prompt


def test_a_stop_sequence_ends_the_output_after_it(pipeline):
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(max_tokens=24, eos_token_id=-1)
    reference = pipeline.generate(prompt, options, SamplingParams()).output_ids
    stop = reference[5:7]
    expected_end = first_stop_end(reference, 0, [stop])
    sent, outcome = collect(pipeline, ServingRequest(prompt, options, SamplingParams(), stream=True,
                                                     stop_sequences=[stop]))
    assert new_ids(sent) == reference[:expected_end] == outcome.output_ids
    assert outcome.finish_reason == "stop" and sent[-1][1] is True


def test_cancellation_stops_the_generation_and_ends_it_with_a_final_response(pipeline):
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(mode="autoregressive", max_tokens=100, eos_token_id=-1)
    sent, outcome = collect(pipeline, ServingRequest(prompt, options, SamplingParams(), stream=True),
                            cancel_after=3)
    assert outcome.finish_reason == "cancelled"
    assert len(outcome.output_ids) == 3  # polled before every round: no round runs after the cancel
    assert [final for _, final in sent] == [False] * 3 + [True]
    assert sent[-1][0]["finish_reason"].tolist() == [[b"cancelled"]]


def test_a_generation_stopped_for_shutdown_says_so(pipeline):
    prompt = pipeline.encode("the quick")
    options = DecodeOptions(mode="autoregressive", max_tokens=100, eos_token_id=-1)
    sent, outcome = collect(pipeline, ServingRequest(prompt, options, SamplingParams()), cancel_after=2,
                            reason=SHUTDOWN)
    assert outcome.finish_reason == "shutdown" and len(outcome.output_ids) == 2
    assert sent[-1][0]["finish_reason"].tolist() == [[b"shutdown"]]
    assert sent[-1][0]["output_ids"].reshape(-1).tolist() == outcome.output_ids  # the text so far, delivered


def test_text_codec_encodes_and_decodes_like_the_pipeline(pipeline, tiny_pair):
    codec = TextCodec(tiny_pair / "target")
    for text in ("the quick", "café 日本", " x"):
        assert codec.encode(text) == pipeline.encode(text)
    ids = pipeline.encode("naïve 🌵 dog")
    assert codec.decode(ids) == pipeline.decode(ids)
    with pytest.raises(RequestError, match="'text_input'"):
        codec.encode("")


# --- live generations and the drain at shutdown ------------------------------------------

def finish_after(generations: Generations, generation, seconds: float) -> threading.Thread:
    """A stand-in worker: ends `generation` after `seconds`, or at once when stopped."""
    def work():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and generation.reason is None:
            time.sleep(0.005)
        generations.end(generation.generation_id)
    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_generations_are_stopped_by_id_with_the_first_reason_and_forgotten():
    generations = Generations()
    first, second = generations.start(), generations.start()
    assert first.generation_id != second.generation_id
    generations.cancel(second.generation_id)
    generations.cancel(second.generation_id, SHUTDOWN)
    assert (first.reason, second.reason) == (None, CANCELLED)  # the first reason is the one reported
    generations.end(first.generation_id)
    generations.cancel(first.generation_id)  # an ended generation: nothing to stop, no error
    assert first.reason is None and first.generation_id not in generations.live


def test_a_drain_waits_for_generations_that_finish_in_time():
    generations = Generations()
    workers = [finish_after(generations, generations.start(), seconds) for seconds in (0.05, 0.2)]
    report = generations.drain(timeout_s=5)
    assert report == DrainReport(in_flight=2, finished=2, stopped_at_deadline=0, still_running=0,
                                 waited_s=report.waited_s) and report.complete
    assert 0.15 < report.waited_s < 4  # waited for the slower one, not for the deadline
    for worker in workers:
        worker.join()


def test_a_drain_stops_the_rest_at_its_deadline_and_refuses_newcomers():
    generations = Generations()
    quick, slow = generations.start(), generations.start()
    workers = [finish_after(generations, quick, 0.01), finish_after(generations, slow, 60)]
    report = generations.drain(timeout_s=0.3)
    assert (report.in_flight, report.finished, report.stopped_at_deadline, report.still_running) == (2, 1, 1, 0)
    assert slow.reason == SHUTDOWN and quick.reason is None and not report.complete
    with pytest.raises(ServerDraining, match="shutting down"):
        generations.start()
    for worker in workers:
        worker.join()


def test_a_generation_that_ignores_the_stop_is_reported_still_running():
    generations = Generations()
    generations.start()  # never ends
    report = generations.drain(timeout_s=0.05, stop_grace_s=0.05)
    assert (report.stopped_at_deadline, report.still_running) == (1, 1)
    assert DrainReport.from_json(report.to_json()) == report


def test_a_drain_request_needs_the_servers_token():
    get = drain_inputs("s3cret", 2.5).get
    assert parse_drain_request(get, "s3cret").timeout_s == 2.5
    with pytest.raises(RequestError, match="'control_token'"):
        parse_drain_request(get, "other")
    with pytest.raises(RequestError, match="disabled"):
        parse_drain_request(get, None)
    with pytest.raises(RequestError, match="'control'"):
        parse_drain_request({**drain_inputs("s3cret", 1), "control": np.array([[b"reboot"]], object)}.get, "s3cret")
    with pytest.raises(RequestError, match="'drain_timeout_s'"):
        parse_drain_request(drain_inputs("s3cret", -1).get, "s3cret")


# --- the guarded server process -----------------------------------------------------------

def guarded(parent_pid: int, *program: str) -> list[str]:
    return [sys.executable, "-m", "saguaro.serving.guarded_exec", str(parent_pid), *program]


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def test_a_server_is_ready_only_once_http_metrics_and_grpc_all_answer(tmp_path):
    """Triton says ready over HTTP before its metrics endpoint listens: a client that
    scraped metrics right after was refused, so readiness waits for all three."""
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from saguaro.serving.triton_server import Ports, TritonServer, free_port

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name in http.server
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http, grpc = ThreadingHTTPServer(("127.0.0.1", 0), Ok), socket.create_server(("127.0.0.1", 0))
    ports = Ports(grpc=grpc.getsockname()[1], http=http.server_address[1], metrics=free_port())
    server = TritonServer(model_repo=tmp_path, run_dir=tmp_path, ports=ports)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        assert not server.is_ready()  # nothing listens on the metrics port yet
        metrics = ThreadingHTTPServer(("127.0.0.1", ports.metrics), Ok)
        threading.Thread(target=metrics.serve_forever, daemon=True).start()
        assert server.is_ready()
        grpc.close()
        assert not server.is_ready()
        metrics.shutdown()
    finally:
        http.shutdown()
        grpc.close()


def test_a_guarded_server_keeps_sigterm_pending_for_the_launcher_and_stops_on_sigint():
    sleeper = subprocess.Popen(guarded(os.getpid(), "/bin/sleep", "60"))
    try:
        wait_until(lambda: Path(f"/proc/{sleeper.pid}/cmdline").read_bytes().startswith(b"/bin/sleep"))  # exec'd
        sleeper.send_signal(signal.SIGTERM)
        wait_until(lambda: signal.SIGTERM in pending_signals(sleeper.pid))
        assert sleeper.poll() is None  # blocked: the launcher decides what a SIGTERM means
        sleeper.send_signal(signal.SIGINT)
        assert sleeper.wait(10) == -signal.SIGINT
    finally:
        sleeper.kill()


LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-m", "saguaro.serving.guarded_exec", str(os.getpid()), "/bin/sleep", "60"])
while not open(f"/proc/{child.pid}/cmdline", "rb").read().startswith(b"/bin/sleep"):
    pass
print(child.pid)
"""  # starts a guarded sleep, then dies without stopping it


def test_a_guarded_server_gets_sigint_when_its_launcher_dies():
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=30)
    orphan = int(launcher.stdout.split()[-1])
    wait_until(lambda: ended(orphan))  # without the parent-death signal it would sleep on for a minute


def ended(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie awaiting its reaper
    except FileNotFoundError:
        return True


def test_a_guarded_server_does_not_start_once_its_launcher_is_gone():
    assert subprocess.run(guarded(1, "/bin/true")).returncode == 1  # pid 1 is not our parent


def test_text_codec_renders_chat_turns_like_the_pipeline(pipeline, tiny_pair, tmp_path):
    """With `chat` the text is a user turn in the model's template; without a template the
    request is refused naming 'chat'."""
    with pytest.raises(RequestError, match="input 'chat': this model has no chat template"):
        TextCodec(tiny_pair / "target").encode("hi", chat=True)
    tokenizer = load_tokenizer(tiny_pair / "target")
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    tokenizer.save_pretrained(tmp_path / "chat")
    ids = TextCodec(tmp_path / "chat").encode("the quick", chat=True)
    assert tokenizer.decode(ids) == "<s>user: the quick</s><s>assistant:"
    assert ids == encode_chat(tokenizer, chat_messages("the quick"))
    assert ids.count(tokenizer.bos_token_id) == 2  # the template's own, nothing added


# --- the prepared model repository -----------------------------------------------------

def parameters_in(config_file) -> dict[str, str]:
    import re

    return dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', config_file.read_text()))


def test_engines_fill_the_templates_from_their_manifest(tiny_engines, tmp_path):
    repo = prepare_model_repo(tmp_path / "repo", values_from_args(parse_args(["--engines", str(tiny_engines)])))
    manifest = json.loads((tiny_engines / "manifest.json").read_text())
    ssd, pre = parameters_in(repo / "ssd" / "config.pbtxt"), parameters_in(repo / "preprocessing" / "config.pbtxt")
    assert ssd["engines_dir"] == str(tiny_engines.resolve()) and ssd["target_dir"] == ""
    assert pre["tokenizer_dir"] == str(tiny_engines.resolve() / manifest["tokenizer"]["dir"])
    assert (repo / "ensemble" / "1").is_dir() and (repo / "ssd" / "1" / "model.py").is_file()
    assert not any("${" in config.read_text() for config in repo.glob("*/config.pbtxt"))
    assert all("${" in config.read_text() for config in templates_dir().glob("[ps]*/config.pbtxt"))  # untouched


def test_checkpoints_fill_the_templates_too(tiny_pair, tmp_path):
    args = parse_args(["--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"),
                       "--decoding-mode", "speculative", "--fanout", "2"])
    ssd = parameters_in(prepare_model_repo(tmp_path / "repo", values_from_args(args)) / "ssd" / "config.pbtxt")
    assert (ssd["engines_dir"], ssd["draft_dir"]) == ("", str((tiny_pair / "draft").resolve()))
    assert (ssd["default_decoding_mode"], ssd["default_fanout"], ssd["default_budget"]) == ("speculative", "2", "")


def test_the_ngram_draft_method_reaches_the_model_config_and_needs_no_draft(tiny_engines, tiny_pair, tmp_path):
    engines = parse_args(["--engines", str(tiny_engines), "--draft-method", "ngram"])
    ssd = parameters_in(prepare_model_repo(tmp_path / "a", values_from_args(engines)) / "ssd" / "config.pbtxt")
    assert ssd["draft_method"] == "ngram"
    target_alone = parse_args(["--target", str(tiny_pair / "target"), "--draft-method", "ngram"])
    ssd = parameters_in(prepare_model_repo(tmp_path / "b", values_from_args(target_alone)) / "ssd" / "config.pbtxt")
    assert (ssd["draft_method"], ssd["draft_dir"]) == ("ngram", "")
    with pytest.raises(ValueError, match="--draft: --draft-method ngram uses no draft model"):
        values_from_args(parse_args(["--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"),
                                     "--draft-method", "ngram"]))
    with pytest.raises(ValueError, match="both --target DIR and --draft DIR"):
        values_from_args(parse_args(["--target", str(tiny_pair / "target")]))


def test_the_ngram_first_method_reaches_the_model_config_and_needs_the_draft(tiny_engines, tiny_pair, tmp_path):
    engines = parse_args(["--engines", str(tiny_engines), "--draft-method", "ngram+model"])
    ssd = parameters_in(prepare_model_repo(tmp_path / "a", values_from_args(engines)) / "ssd" / "config.pbtxt")
    assert ssd["draft_method"] == "ngram+model"
    with pytest.raises(ValueError, match="both --target DIR and --draft DIR"):
        values_from_args(parse_args(["--target", str(tiny_pair / "target"), "--draft-method", "ngram+model"]))


def test_knobs_beyond_the_engines_limits_are_refused(tiny_engines):
    with pytest.raises(ValueError, match="--num-draft-tokens: 99 draft tokens exceed the engines. built maximum"):
        values_from_args(parse_args(["--engines", str(tiny_engines), "--num-draft-tokens", "99"]))


def test_the_stream_interval_reaches_the_model_config_and_a_bad_one_is_refused_naming_the_flag(tiny_engines, tmp_path):
    ssd = parameters_in(prepare_model_repo(tmp_path / "repo", values_from_args(
        parse_args(["--engines", str(tiny_engines), "--stream-interval", "3"]))) / "ssd" / "config.pbtxt")
    assert ssd["stream_interval"] == "3"
    for bad in ("0", "often"):
        with pytest.raises(ValueError, match=f"--stream-interval: .*got '{bad}'"):
            values_from_args(parse_args(["--engines", str(tiny_engines), "--stream-interval", bad]))


def test_auto_stream_interval_keeps_a_rounds_responses_to_a_few_whatever_the_batch():
    assert [rounds_per_response("auto", batch) for batch in (1, 4, 5, 8, 16, 17)] == [1, 1, 2, 2, 4, 5]
    assert rounds_per_response(3, 1) == rounds_per_response(3, 16) == 3
    assert parse_stream_interval("auto") == "auto" and parse_stream_interval(" 2 ") == 2


def test_an_unrelated_folder_is_never_replaced(tiny_pair, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    args = parse_args(["--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft")])
    with pytest.raises(ValueError, match="not a prepared model repository"):
        prepare_model_repo(tmp_path, values_from_args(args))
    assert (tmp_path / "keep.txt").read_text() == "mine"
