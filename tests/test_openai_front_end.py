"""The OpenAI-compatible front end's own logic, in process (FastAPI's TestClient), against
a scripted stand-in for the `ssd` model and a byte-level codec: request checking and the
status of every error, stop strings matched on text, response and stream shapes, usage,
the `ssd` figures, a request's cancellation when it ends early, and the drain gate. The
real model behind a real server is tests/test_openai_server.py."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from saguaro.serving.openai_protocol import ApiError
from saguaro.serving.openai_server import FrontEnd, create_app
from saguaro.serving.ssd_stream import Round, api_error
from saguaro.serving.text_stream import TextStream, held_back

MAX_CONTEXT = 128


class ByteModel:
    """A model whose tokens are UTF-8 bytes; its chat template is `role: content\\n` lines."""

    name = "byte-model"
    max_context = MAX_CONTEXT

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def render(self, turns) -> list[int]:
        return self.encode("".join(f"{turn['role']}: {turn['content']}\n" for turn in turns) + "assistant: ")

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        return bytes([token]).decode("utf-8", "replace")


class ScriptedSsd:
    """Answers every request with the rounds of `text` (`per_round` bytes each), then a
    final response; records what it was asked and whether the caller left early."""

    def __init__(self, text: str = "hello world. more", per_round: int = 3, finish: str = "length"):
        self.text, self.per_round, self.finish = text.encode(), per_round, finish
        self.params, self.closed_early = [], 0

    async def rounds(self, params):
        self.params.append(params)
        ids = list(self.text[:params.max_tokens])
        finished = False
        try:
            for start in range(0, len(ids), self.per_round):
                chunk = ids[start:start + self.per_round]
                yield Round(chunk, [-0.5] * len(chunk), {"total_draft_tokens": start + len(chunk),
                                                         "total_accepted_draft_tokens": start})
            finished = True
            yield Round([], [], {"cache_hits": 2, "cache_misses": 1, "sampling_seed": 7}, self.finish)
        finally:
            if not finished:
                self.closed_early += 1

    async def close(self):
        pass


@pytest.fixture
def ssd():
    return ScriptedSsd()


@pytest.fixture
def front(ssd):
    return FrontEnd(ByteModel(), ssd)


@pytest.fixture
def http(front):
    with TestClient(create_app(front)) as client:
        yield client


def chat_body(**fields):
    return {"model": "byte-model", "messages": [{"role": "user", "content": "hi"}], **fields}


def events(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# --- text-level stop strings -----------------------------------------------------------

def decode_bytes(ids):
    return bytes(ids).decode("utf-8", "replace")


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    assert held_back("abc END", ["END."]) == 3 and held_back("abc", ["xyz"]) == 0
    stream = TextStream(decode_bytes, ["END."])
    assert stream.add(list(b"abc EN")) == "abc "
    assert stream.add(list(b"Dx")) == "ENDx"  # "ENDx" can no longer become "END."
    assert not stream.stopped


def test_a_stop_string_split_across_rounds_ends_the_text_before_it():
    stream = TextStream(decode_bytes, ["</s>", "STOP"])
    pieces = [stream.add(list(chunk)) for chunk in (b"one S", b"TO", b"P two")]
    assert "".join(pieces) == "one " and stream.stopped
    assert stream.completion_tokens == len(b"one STOP")  # up to the token that completed it
    assert stream.add(list(b"more")) == ""


def test_a_multibyte_character_is_never_split_and_the_final_round_flushes_all():
    stream = TextStream(decode_bytes, [])
    snowman = "☃".encode()
    assert stream.add(list(b"a" + snowman[:1])) == "a"
    assert stream.add(list(snowman[1:])) == "☃"
    stream = TextStream(decode_bytes, ["zz"])
    assert stream.add(list(b"xz")) == "x" and stream.add([], final=True) == "z"


# --- responses -------------------------------------------------------------------------

def test_chat_completion_has_openai_shape_usage_and_the_ssd_figures(http, ssd):
    body = http.post("/v1/chat/completions", json=chat_body(max_tokens=11, temperature=0)).json()
    assert body["object"] == "chat.completion" and body["model"] == "byte-model"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello world"},
                                "finish_reason": "length", "logprobs": None}]
    prompt = len(ByteModel().render([{"role": "user", "content": "hi"}]))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 11, "total_tokens": prompt + 11}
    assert body["ssd"]["cache_hits"] == 2 and body["ssd"]["seed"] == 7
    params = ssd.params[0]
    assert params.prompt_ids == ByteModel().render([{"role": "user", "content": "hi"}])
    assert (params.max_tokens, params.temperature, params.top_p) == (11, 0.0, 1.0)


def test_messages_of_every_role_are_rendered_in_order(http, ssd):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "developer", "content": "x"},
                {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "you?"}]}]
    http.post("/v1/chat/completions", json={"model": "byte-model", "messages": messages, "max_tokens": 2})
    assert ByteModel().decode(ssd.params[0].prompt_ids) == (
        "system: be brief\nuser: hi\nassistant: hello\nsystem: x\nuser: and you?\nassistant: ")


def test_a_streamed_chat_sends_role_then_deltas_then_the_finish_and_usage(http):
    response = http.post("/v1/chat/completions", json=chat_body(max_tokens=11, stream=True,
                                                                stream_options={"include_usage": True}))
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hello world"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])
    finish = chunks[-2]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert finish["ssd"]["cache_misses"] == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 11


def test_a_stop_string_ends_the_completion_and_cancels_the_generation(http, ssd):
    body = http.post("/v1/completions", json={"model": "byte-model", "prompt": "x", "stop": [". "],
                                              "max_tokens": 30, "logprobs": 0}).json()
    assert body["choices"][0]["text"] == "hello world" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("hello world. ")
    logprobs = body["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == "hello world. " and logprobs["token_logprobs"] == [-0.5] * 13
    assert logprobs["text_offset"][:3] == [0, 1, 2]
    assert ssd.closed_early == 1  # the model's stream was left: Triton cancels the generation


def test_echo_repeats_the_prompt_and_a_streamed_completion_ends_with_done(http):
    body = http.post("/v1/completions", json={"model": "byte-model", "prompt": "say: ", "max_tokens": 5,
                                              "echo": True}).json()
    assert body["choices"][0]["text"] == "say: hello"
    chunks = events(http.post("/v1/completions", json={"model": "byte-model", "prompt": "x", "max_tokens": 5,
                                                       "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


def test_token_id_prompts_and_the_models_listing(http, ssd):
    http.post("/v1/completions", json={"model": "byte-model", "prompt": [104, 105], "max_tokens": 2})
    assert ssd.params[0].prompt_ids == [104, 105]
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == ["byte-model"]
    assert listing["data"][0]["max_model_len"] == MAX_CONTEXT
    assert http.get("/v1/models/byte-model").json()["id"] == "byte-model"
    assert http.get("/v1/models/other").status_code == 404


def test_max_tokens_defaults_to_the_room_left_and_knobs_reach_the_model(http, ssd):
    http.post("/v1/completions", json={"model": "byte-model", "prompt": "abcd", "top_k": 5, "seed": 3,
                                       "ignore_eos": True, "decoding_mode": "speculative", "num_draft_tokens": 2})
    params = ssd.params[0]
    assert params.max_tokens == MAX_CONTEXT - 4 and params.top_k == 5 and params.seed == 3 and params.ignore_eos
    assert params.knobs == {"decoding_mode": "speculative", "num_draft_tokens": 2}
    assert params.temperature == 1.0  # OpenAI's default


# --- errors ----------------------------------------------------------------------------

BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("unknown model", "/v1/chat/completions", {**chat_body(), "model": "gpt-4"}, 404, "`gpt-4` does not exist"),
    ("wrong type", "/v1/chat/completions", chat_body(max_tokens="ten"), 422, "'max_tokens'"),
    ("wrong type in a message", "/v1/chat/completions", {**chat_body(), "messages": [{"role": "user", "content": 5}]},
     422, "messages.0.content"),
    ("no messages", "/v1/chat/completions", {**chat_body(), "messages": []}, 422, "'messages'"),
    ("an unknown role", "/v1/chat/completions", {**chat_body(), "messages": [{"role": "king", "content": "x"}]},
     422, "messages.0.role"),
    ("n > 1", "/v1/chat/completions", chat_body(n=2), 400, "'n'"),
    ("an unknown field", "/v1/chat/completions", chat_body(frobnicate=1), 400, "Unrecognized request argument"),
    ("a penalty", "/v1/chat/completions", chat_body(presence_penalty=0.5), 400, "'presence_penalty'"),
    ("tools", "/v1/chat/completions", chat_body(tools=[{"type": "function"}]), 400, "'tools'"),
    ("json output", "/v1/chat/completions", chat_body(response_format={"type": "json_object"}), 400,
     "'response_format'"),
    ("top log-probabilities", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=3), 400,
     "'top_logprobs'"),
    ("temperature out of range", "/v1/chat/completions", chat_body(temperature=3), 400, "'temperature'"),
    ("top_p 0", "/v1/chat/completions", chat_body(top_p=0), 400, "'top_p'"),
    ("a negative seed", "/v1/chat/completions", chat_body(seed=-1), 400, "'seed'"),
    ("too many stop strings", "/v1/chat/completions", chat_body(stop=list("abcde")), 400, "'stop'"),
    ("stream options without a stream", "/v1/chat/completions",
     chat_body(stream_options={"include_usage": True}), 400, "'stream_options'"),
    ("an image", "/v1/chat/completions",
     {**chat_body(), "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text parts"),
    ("max_tokens past the context", "/v1/chat/completions", chat_body(max_tokens=MAX_CONTEXT), 400,
     "maximum context length"),
    ("a prompt past the context", "/v1/completions", {"model": "byte-model", "prompt": "x" * MAX_CONTEXT}, 413,
     "maximum context length"),
    ("several prompts", "/v1/completions", {"model": "byte-model", "prompt": ["a", "b"]}, 400, "one prompt"),
    ("best_of", "/v1/completions", {"model": "byte-model", "prompt": "a", "best_of": 3}, 400, "'best_of'"),
    ("suffix", "/v1/completions", {"model": "byte-model", "prompt": "a", "suffix": "z"}, 400, "'suffix'"),
    ("an unknown mode", "/v1/completions", {"model": "byte-model", "prompt": "a", "decoding_mode": "beam"}, 400,
     "'decoding_mode'"),
]


@pytest.mark.parametrize("path, body, status, words", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_error_bodies_with_the_right_status(http, ssd, path, body, status, words):
    response = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert not ssd.params  # refused before the model was asked
    assert http.post("/v1/chat/completions", json=chat_body(max_tokens=3)).status_code == 200  # still serving


def test_model_refusals_map_to_http_statuses():
    assert api_error("input 'num_draft_tokens': 9 draft tokens exceed").status == 400
    assert api_error("the server is shutting down and takes no new requests; retry on another server").status == 503
    assert api_error("the server has 5 requests waiting already; try again later").status == 503
    assert api_error("generation failed: RuntimeError: boom").status == 500


def test_a_model_error_midway_through_a_stream_becomes_an_error_event(front, http):
    async def refusing(params):
        yield Round([104], [0.0])
        raise ApiError(400, "input 'budget': too many")
    front.ssd.rounds = refusing
    chunks = events(http.post("/v1/completions", json={"model": "byte-model", "prompt": "x", "stream": True}))
    assert chunks[0]["choices"][0]["text"] == "h" and chunks[-1]["error"]["message"] == "input 'budget': too many"


def test_while_draining_new_requests_get_503_and_health_says_so(front, http):
    assert http.get("/health").status_code == 200
    front.gate.draining = True
    response = http.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 503 and response.json()["error"]["code"] == "service_unavailable"
    assert http.get("/health").status_code == 503
    assert front.gate.in_flight == 0


class FakeCall:
    """A streaming gRPC call as tritonclient's asyncio client returns it: the responses,
    then the end of the call once the request side has closed."""

    def __init__(self, requests, results):
        self.requests, self.results, self.cancelled = requests, results, False
        self.stream = self.responses()

    def __aiter__(self):  # as tritonclient's: iterated again, it goes on where it was
        return self

    async def __anext__(self):
        return await self.stream.__anext__()

    async def responses(self):
        await self.requests.__anext__()  # the request goes out first
        for result in self.results:
            yield result, None
        if self.results and self.results[-1].as_numpy("finish_reason") is not None:
            async for _ in self.requests:  # after the final response, when the client closes its side
                pass

    def cancel(self):
        self.cancelled = True


def test_a_finished_call_is_closed_from_our_side_and_one_left_early_is_cancelled(monkeypatch):
    """Cancelled just after its final response, a call could keep the model from unloading
    at shutdown; a stream the front end leaves early (a stop string, a client gone) is
    cancelled, so Triton stops the generation."""
    import asyncio
    from types import SimpleNamespace

    import numpy as np

    from saguaro.serving import ssd_stream
    from saguaro.serving.openai_protocol import GenerationParams

    def result(ids, finish=None):
        arrays = {"output_ids": np.array([ids], np.int32)}
        if finish:
            arrays["finish_reason"] = np.array([[finish.encode()]], object)
        return SimpleNamespace(as_numpy=arrays.get)

    calls, finals = [], [result([], "length")]

    def stream_infer(requests):
        calls.append(FakeCall(requests, [result([5, 6]), result([7]), *finals]))
        return calls[-1]

    stream = ssd_stream.SsdStream("unused")
    monkeypatch.setattr(ssd_stream.SsdStream, "client", SimpleNamespace(stream_infer=stream_infer))
    params = GenerationParams([1, 2], max_tokens=3, temperature=0.0, top_p=1.0, top_k=0, seed=None, stops=[],
                              stream=True, include_usage=False)

    async def whole():
        return [r async for r in stream.rounds(params)]

    async def first_only():
        rounds = stream.rounds(params)
        first = await rounds.__anext__()
        await rounds.aclose()
        return first

    rounds = asyncio.run(whole())
    assert [r.ids for r in rounds] == [[5, 6], [7], []] and rounds[-1].finish_reason == "length"
    assert not calls[0].cancelled
    assert asyncio.run(first_only()).ids == [5, 6] and calls[1].cancelled
    finals[:] = []  # a call that ends without a final response: its rounds, each once
    assert [r.ids for r in asyncio.run(whole())] == [[5, 6], [7]] and calls[2].cancelled
