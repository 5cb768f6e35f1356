"""An OpenAI-compatible HTTP API in front of the Triton server (FastAPI + uvicorn).

    GET  /v1/models, /v1/models/{model}, /health
    POST /v1/completions, /v1/chat/completions   (streamed as server-sent events, or not)

`scripts/serve.py --openai-port PORT` starts it beside Triton, in a thread of its own
process. It renders chat messages with the model's chat template and tokenizes here,
calls the `ssd` model directly with the ids (`ssd_stream`), and turns each decoding
round's ids into text with text-level stop strings (`text_stream`). Responses follow
OpenAI's shapes (`usage`, `stream_options.include_usage`, `data: [DONE]`); the request's
speculation figures ride along in an `ssd` field. Errors use OpenAI's error body
(`openai_protocol.ApiError`): 400 bad values, 404 unknown model, 413 prompt past the
context, 422 wrong types, 503 while the server drains for shutdown.

A client that disconnects cancels its generation (the gRPC call is cancelled, the model
stops at its next round and frees the slot), streamed or not. At shutdown the launcher
first makes the front end refuse new requests (`refuse_new`), then drains the model
(the requests in flight finish), then stops the front end (`stop`).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from saguaro.runtime.models.checkpoint import load_tokenizer
from saguaro.runtime.models.prompts import PromptError, encode_chat, encode_text
from saguaro.serving.openai_protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    chat_params,
    completion_params,
)
from saguaro.serving.ssd_stream import Round, SsdStream
from saguaro.serving.text_stream import TextStream

# The model's own reasons, in OpenAI's words ("abort": stopped by the server, as vLLM says).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                  "cancelled": "abort", "shutdown": "abort"}


@dataclass
class ServedModel:
    """What the front end needs of the model: its name, tokenizer and context."""

    name: str
    tokenizer: Any  # a Hugging Face tokenizer
    max_context: int

    @classmethod
    def load(cls, name: str, tokenizer_dir, max_context: int, chat_template: str | None = None) -> "ServedModel":
        """`chat_template` (Jinja text) replaces the tokenizer's own, or gives one to a
        model that has none (vLLM's --chat-template)."""
        tokenizer = load_tokenizer(tokenizer_dir)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        return cls(name, tokenizer, max_context)

    def encode(self, text: str) -> list[int]:
        try:
            return encode_text(self.tokenizer, text)
        except PromptError as error:
            raise ApiError(400, f"'prompt': {error}", param="prompt") from None

    def render(self, turns: list[dict[str, str]]) -> list[int]:
        try:
            return encode_chat(self.tokenizer, turns)
        except PromptError as error:
            raise ApiError(400, f"'messages': {error}", param="messages") from None
        except Exception as error:  # noqa: BLE001 - a template may raise on turns it does not take
            raise ApiError(400, f"'messages': the model's chat template refused them: {error}",
                           param="messages") from None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


@dataclass
class Gate:
    """Whether new requests are taken, and how many are in flight."""

    draining: bool = False
    in_flight: int = 0
    idle: threading.Condition = field(default_factory=threading.Condition)

    def check(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests; retry on another "
                                "server", kind="server_error", code="service_unavailable")

    def enter(self) -> None:
        with self.idle:
            self.check()
            self.in_flight += 1

    def leave(self) -> None:
        with self.idle:
            self.in_flight -= 1
            self.idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.in_flight == 0, timeout=timeout_s)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def validation_error(error: pydantic.ValidationError) -> ApiError:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return ApiError(422, f"'{where}': {first['msg']} (got {first.get('input')!r})", param=where,
                    code="invalid_type")


async def parsed_body(request: Request, model: type[pydantic.BaseModel]):
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        raise validation_error(error) from None


@dataclass
class Outcome:
    """A generation as the response reports it."""

    text: str = ""
    finish_reason: str = "length"
    completion_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    figures: dict = field(default_factory=dict)


class Generation:
    """One request's rounds from the model, as text pieces; `outcome` once finished."""

    def __init__(self, model: ServedModel, params: GenerationParams):
        self.model, self.params = model, params
        self.text = TextStream(model.decode, params.stops)
        self.outcome = Outcome()

    async def pieces(self, ssd: SsdStream) -> AsyncGenerator[tuple[str, list[int], list[float]], None]:
        """(text, its tokens, their log-probabilities) per round, until the end or a stop string."""
        async with aclosing(ssd.rounds(self.params)) as rounds:
            async for answer in rounds:
                self.absorb_figures(answer)
                reason = answer.finish_reason
                final = reason is not None
                before = len(self.text.ids)
                piece = self.text.add(answer.ids, final=final)
                kept = self.kept_tokens(before, answer)
                if piece or kept[0]:
                    yield (piece, *kept)
                if self.text.stopped:
                    self.outcome.finish_reason = "stop"
                    break  # leaving the stream cancels the generation
                if reason is not None:  # final
                    self.outcome.finish_reason = FINISH_REASONS.get(reason, reason)
        self.outcome.completion_tokens = self.text.completion_tokens

    def kept_tokens(self, before: int, answer: Round) -> tuple[list[int], list[float]]:
        """The round's tokens (and log-probabilities) that count: up to a stop string's end."""
        end = len(answer.ids) if self.text.tokens_to_stop is None else max(0, self.text.tokens_to_stop - before)
        tokens, logprobs = answer.ids[:end], answer.logprobs[:end]
        self.outcome.tokens += tokens
        self.outcome.logprobs += logprobs
        return tokens, logprobs

    def absorb_figures(self, answer: Round) -> None:
        self.outcome.figures.update(answer.figures)

    def ssd_field(self) -> dict:
        figures = dict(self.outcome.figures)
        if "sampling_seed" in figures:
            figures["seed"] = figures.pop("sampling_seed")
        return figures

    def usage(self) -> dict:
        prompt = len(self.params.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.outcome.completion_tokens,
                "total_tokens": prompt + self.outcome.completion_tokens}


def chat_logprobs(model: ServedModel, tokens: list[int], logprobs: list[float]) -> dict:
    content = []
    for token, logprob in zip(tokens, logprobs):
        text = model.token_text(token)
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(model: ServedModel, tokens: list[int], logprobs: list[float], offset: int) -> dict:
    texts = [model.token_text(token) for token in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class FrontEnd:
    model: ServedModel
    ssd: SsdStream
    gate: Gate = field(default_factory=Gate)

    # --- the two endpoints ----------------------------------------------------------

    async def completions(self, request: Request):
        body = await parsed_body(request, CompletionRequest)
        self.check_model(body.model)
        params = completion_params(body, self.model.encode, self.model.max_context)
        echo = self.model.decode(params.prompt_ids) if params.echo else ""
        return await self.respond(request, params, "cmpl", "text_completion",
                                  lambda generation, piece, tokens, logprobs, offset: {
                                      "index": 0, "text": piece, "finish_reason": None,
                                      "logprobs": completion_logprobs(self.model, tokens, logprobs, offset)
                                      if params.logprobs else None},
                                  lambda generation: {
                                      "index": 0, "text": echo + generation.outcome.text,
                                      "finish_reason": generation.outcome.finish_reason,
                                      "logprobs": completion_logprobs(self.model, generation.outcome.tokens,
                                                                      generation.outcome.logprobs, len(echo))
                                      if params.logprobs else None},
                                  first_piece=echo)

    async def chat(self, request: Request):
        body = await parsed_body(request, ChatRequest)
        self.check_model(body.model)
        params = chat_params(body, self.model.render, self.model.max_context)
        return await self.respond(request, params, "chatcmpl", "chat.completion",
                                  lambda generation, piece, tokens, logprobs, offset: {
                                      "index": 0, "delta": {"content": piece}, "finish_reason": None,
                                      "logprobs": chat_logprobs(self.model, tokens, logprobs)
                                      if params.logprobs else None},
                                  lambda generation: {
                                      "index": 0, "message": {"role": "assistant", "content": generation.outcome.text},
                                      "finish_reason": generation.outcome.finish_reason,
                                      "logprobs": chat_logprobs(self.model, generation.outcome.tokens,
                                                                generation.outcome.logprobs)
                                      if params.logprobs else None},
                                  first_delta={"role": "assistant", "content": ""})

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model.name}`",
                           param="model", code="model_not_found")

    # --- one generation, streamed or whole ----------------------------------------------

    async def respond(self, request: Request, params: GenerationParams, prefix: str, kind: str,
                      chunk_choice: Callable, whole_choice: Callable, first_piece: str = "",
                      first_delta: dict | None = None):
        self.gate.check()
        identity = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = Generation(self.model, params)
        if params.stream:
            return StreamingResponse(self.stream(generation, identity, created, kind, chunk_choice, first_piece,
                                                 first_delta), media_type="text/event-stream")
        self.gate.enter()
        try:
            await self.until_disconnected(request, self.collect(generation))
        finally:
            self.gate.leave()
        return {"id": identity, "object": kind, "created": created, "model": self.model.name,
                "choices": [whole_choice(generation)], "usage": generation.usage(), "ssd": generation.ssd_field()}

    async def collect(self, generation: Generation) -> None:
        async with aclosing(generation.pieces(self.ssd)) as pieces:
            async for piece, _, _ in pieces:
                generation.outcome.text += piece

    async def until_disconnected(self, request: Request, work) -> None:
        """Run `work`; a client that goes away cancels it (and with it the generation)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self.disconnected(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise ApiError(499, "the client closed the connection")
        task.result()

    @staticmethod
    async def disconnected(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def stream(self, generation: Generation, identity: str, created: int, kind: str,
                     chunk_choice: Callable, first_piece: str, first_delta: dict | None) -> AsyncIterator[str]:
        """Server-sent events; the streaming response cancels this generator (and so the
        generation) when the client disconnects."""
        chunk_kind = f"{kind}.chunk" if kind == "chat.completion" else kind
        include_usage = generation.params.include_usage

        def chunk(choices: list, **extra) -> str:
            body = {"id": identity, "object": chunk_kind, "created": created, "model": self.model.name,
                    "choices": choices, **extra}
            if include_usage and "usage" not in body:
                body["usage"] = None
            return sse(body)

        try:
            self.gate.enter()
        except ApiError as error:
            yield sse(error.body())
            return
        try:
            if first_delta is not None:
                yield chunk([{"index": 0, "delta": first_delta, "logprobs": None, "finish_reason": None}])
            offset = len(first_piece)
            if first_piece:
                yield chunk([chunk_choice(generation, first_piece, [], [], 0)])
            try:
                async with aclosing(generation.pieces(self.ssd)) as pieces:
                    async for piece, tokens, logprobs in pieces:
                        generation.outcome.text += piece
                        yield chunk([chunk_choice(generation, piece, tokens, logprobs, offset)])
                        offset += len(piece)
            except ApiError as error:
                yield sse(error.body())
                yield "data: [DONE]\n\n"
                return
            last = chunk_choice(generation, "", [], [], offset)
            last["finish_reason"] = generation.outcome.finish_reason
            if "delta" in last:
                last["delta"] = {}
            yield chunk([last], ssd=generation.ssd_field())
            if include_usage:
                yield chunk([], usage=generation.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.gate.leave()

    async def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "saguaro",
                "max_model_len": self.model.max_context}


def create_app(front: FrontEnd) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        yield
        await front.ssd.close()  # the gRPC channel lives in this event loop

    app = FastAPI(title="Saguaro SSD (OpenAI-compatible)", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return error_response(error)

    @app.get("/health")
    async def health():
        if front.gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return await front.models()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        front.check_model(name)
        return front.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await front.chat(request)

    return app


class OpenAIServer:
    """uvicorn serving the app in a thread of its own (its own event loop)."""

    def __init__(self, front: FrontEnd, host: str, port: int):
        self.front = front
        config = uvicorn.Config(create_app(front), host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="openai-api", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "OpenAIServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the OpenAI front end failed to start (is the port free?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI front end did not start in {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def refuse_new(self) -> None:
        with self.front.gate.idle:
            self.front.gate.draining = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the requests in flight finish (up to `timeout_s`), then stop serving."""
        self.refuse_new()
        self.front.gate.wait_idle(timeout_s)
        self.server.should_exit = True
        self.thread.join(timeout_s)
