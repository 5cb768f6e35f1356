"""OpenAI's request bodies as the front end reads them, and the errors it answers with.

`/v1/completions` and `/v1/chat/completions` bodies are parsed in two steps: pydantic
checks the types (a wrong type is 422, malformed JSON 400, as FastAPI reports them,
reshaped into OpenAI's error body by the server), then `generation_params` checks the
values against what SSD can honour and the model's context, and names the field at
fault: unknown fields and values SSD cannot honour (n > 1, penalties, tools, logit bias,
top log-probabilities) are 400, a prompt past the context 413, an unknown model 404.
Nothing is silently ignored that would change the output; fields that change nothing
for one sequence (user, metadata, parallel_tool_calls, ...) are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union, cast

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from saguaro.runtime.core.options import MODES

MAX_STOP_STRINGS = 4      # as OpenAI's API
SEED_LIMIT = 2 ** 64      # the ssd model's seed is a UINT64


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param)


Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class CommonRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are kept (`model_extra`) so that
    `generation_params` can name them, as OpenAI's API does, instead of a generic 422."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # Extensions, as vLLM takes them: sampling and the SSD knobs.
    top_k: StrictInt | None = None
    ignore_eos: StrictBool = False
    decoding_mode: StrictStr | None = None
    num_draft_tokens: StrictInt | None = None


class CompletionRequest(CommonRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None


@dataclass(frozen=True)
class GenerationParams:
    """One request for the `ssd` model, checked."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    echo: bool = False
    logprobs: bool = False  # the target's log-probability of each chosen token
    knobs: dict = field(default_factory=dict)  # decoding_mode, num_draft_tokens


def refuse_unknown_fields(request: BaseModel) -> None:
    unknown = sorted(request.model_extra or {})
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])


def require_neutral(param: str, value, neutral: tuple, why: str) -> None:
    if value is not None and value not in neutral:
        raise invalid(param, f"{value!r} is not supported: {why}")


UNCHANGED_TARGET = ("SSD verifies drafts against the target's unchanged distribution (that is what keeps "
                    "its output the target's)")


def check_shared(request: CommonRequest) -> None:
    refuse_unknown_fields(request)
    require_neutral("n", request.n, (1,), "one choice per request")
    require_neutral("presence_penalty", request.presence_penalty, (0, 0.0), UNCHANGED_TARGET)
    require_neutral("frequency_penalty", request.frequency_penalty, (0, 0.0), UNCHANGED_TARGET)
    if request.logit_bias:
        raise invalid("logit_bias", f"is not supported: {UNCHANGED_TARGET}")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "is only allowed when 'stream' is true")


def check_chat_only(request: ChatRequest) -> None:
    for name in ("tools", "functions"):
        if getattr(request, name):
            raise invalid(name, "tool calling is not supported by this server")
    require_neutral("tool_choice", request.tool_choice, ("none",), "tool calling is not supported by this server")
    require_neutral("function_call", request.function_call, ("none",), "tool calling is not supported")
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise invalid("response_format", "only {'type': 'text'} is supported: structured output would mask "
                                         "the target's distribution")
    if request.modalities is not None and request.modalities != ["text"]:
        raise invalid("modalities", "only ['text'] is supported")
    for name in ("audio", "prediction", "reasoning_effort"):
        if getattr(request, name) is not None:
            raise invalid(name, "is not supported by this server")
    require_neutral("store", request.store, (False,), "this server stores nothing")
    require_neutral("top_logprobs", request.top_logprobs, (0,), "only the chosen token's log-probability is "
                                                                "returned (the engines keep the rest inside)")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs", "needs 'logprobs' true")


def stop_strings(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not text for text in stops):
        raise invalid("stop", "a stop string must not be empty")
    return stops


def sampling_values(request: CommonRequest) -> dict:
    temperature = 1.0 if request.temperature is None else float(request.temperature)
    if not 0 <= temperature <= 2:
        raise invalid("temperature", f"must be in [0, 2], got {temperature}")
    top_p = 1.0 if request.top_p is None else float(request.top_p)
    if not 0 < top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1], got {top_p}")
    top_k = 0 if request.top_k in (None, -1) else request.top_k
    if top_k < 0:
        raise invalid("top_k", f"must be >= 0 (0 or -1: off), got {top_k}")
    if request.seed is not None and not 0 <= request.seed < SEED_LIMIT:
        raise invalid("seed", f"must be in [0, 2**64), got {request.seed}")
    if request.decoding_mode is not None and request.decoding_mode not in MODES:
        raise invalid("decoding_mode", f"must be one of {', '.join(MODES)}, got {request.decoding_mode!r}")
    knobs = {name: value for name in ("decoding_mode", "num_draft_tokens")
             if (value := getattr(request, name)) is not None}
    return dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=request.seed, knobs=knobs)


def check_fits(prompt_ids: list[int], max_tokens: int | None, param: str, max_context: int,
               prompt_param: str = "prompt") -> int:
    """The prompt must leave room in the context (413 otherwise); `max_tokens` defaults to
    all the room left, and asking for more than that is a 400 naming `param`."""
    room = max_context - len(prompt_ids)
    if room < 1:
        raise ApiError(413, f"This model's maximum context length is {max_context} tokens; the prompt has "
                            f"{len(prompt_ids)} tokens, which leaves no room for a completion",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return room
    if max_tokens < 1:
        raise invalid(param, f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise ApiError(400, f"'{param}': {max_tokens} tokens after a prompt of {len(prompt_ids)} tokens exceed "
                            f"this model's maximum context length of {max_context} tokens (at most {room})",
                       param=param, code="context_length_exceeded")
    return max_tokens


def completion_params(request: CompletionRequest, encode, max_context: int) -> GenerationParams:
    check_shared(request)
    require_neutral("best_of", request.best_of, (1,), "one choice per request")
    require_neutral("suffix", request.suffix, ("",), "insertion (fill in the middle) is not supported")
    require_neutral("logprobs", request.logprobs, (0,), "only the chosen token's log-probability is returned "
                                                        "(logprobs 0)")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise invalid("prompt", f"one prompt per request, got {len(prompt)}")
        prompt = prompt[0]
    if not prompt:
        raise invalid("prompt", "is empty")
    # a list here holds ids: a list of strings was replaced by its one string above
    prompt_ids = encode(prompt) if isinstance(prompt, str) else list(cast("list[int]", prompt))
    values = sampling_values(request)
    max_tokens = check_fits(prompt_ids, request.max_tokens, "max_tokens", max_context)
    return GenerationParams(prompt_ids, max_tokens, stops=stop_strings(request.stop), stream=request.stream,
                            include_usage=bool(request.stream_options and request.stream_options.include_usage),
                            ignore_eos=request.ignore_eos, echo=request.echo, logprobs=request.logprobs == 0,
                            **values)


def message_text(message: Message, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{index}].content", f"only text parts are supported, got {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


def chat_turns(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as the chat template takes them (OpenAI's `developer` is a system turn)."""
    turns = []
    for index, message in enumerate(messages):
        if message.role in ("tool", "function"):
            raise invalid(f"messages[{index}].role", "tool results are not supported by this server")
        role = "system" if message.role == "developer" else message.role
        turns.append({"role": role, "content": message_text(message, index)})
    return turns


def chat_params(request: ChatRequest, render, max_context: int) -> GenerationParams:
    """`render(turns)` is the prompt's ids: the chat template with the assistant's turn opened."""
    check_shared(request)
    check_chat_only(request)
    if request.max_tokens is not None and request.max_completion_tokens is not None \
            and request.max_tokens != request.max_completion_tokens:
        raise invalid("max_completion_tokens", "give it or the older 'max_tokens', not both with different values")
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    prompt_ids = render(chat_turns(request.messages))
    values = sampling_values(request)
    max_tokens = check_fits(prompt_ids, limit, param, max_context, "messages")
    return GenerationParams(prompt_ids, max_tokens, stops=stop_strings(request.stop), stream=request.stream,
                            include_usage=bool(request.stream_options and request.stream_options.include_usage),
                            ignore_eos=request.ignore_eos, logprobs=bool(request.logprobs), **values)
