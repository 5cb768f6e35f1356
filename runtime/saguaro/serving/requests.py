"""A served request's inputs, shared by the Triton models and the tests, with no Triton import.

A request arrives as named numpy arrays (Triton's tensors); `parse_request` validates all
of them before any model runs and raises `RequestError` naming the input at fault. The
input names are the ensemble's (tensorrtllm_backend's text interface plus the SSD knobs),
so an error names what the client actually sent, in the interface's words. `TextCodec`
and the word lists are the text side of those inputs (prompts, stop words). What a
request sends back is `responses`.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from saguaro.runtime.core.options import DecodeOptions, parse_budget, parse_fanout
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.models.checkpoint import load_tokenizer
from saguaro.runtime.models.prompts import PromptError, chat_messages, encode_chat, encode_text
from saguaro.runtime.pipeline import RequestError, RequestNames
from saguaro.serving.interface import refuse_unhonoured

GetInput = Callable[[str], "np.ndarray | None"]  # None when the request lacks the input
# How the engines' limits are named to a client of the served models.
INPUT_NAMES = RequestNames(prompt="input 'input_ids'", num_draft_tokens="input 'num_draft_tokens'",
                           branches="inputs 'fanout'/'budget'", lower="lower either")


def input_getter(get_tensor, request) -> GetInput:
    """A request's inputs as numpy arrays by name, through Triton's `get_input_tensor_by_name`."""
    def get(name):
        tensor = get_tensor(request, name)
        return None if tensor is None else tensor.as_numpy()
    return get


def model_parameters(args: dict) -> dict[str, str]:
    """A Triton model's `config.pbtxt` parameters, from the `args` given to `initialize`."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def defaults_from_parameters(parameters: dict[str, str]) -> DecodeOptions:
    """What a request gets for the SSD knobs it leaves out: the `default_*` parameters of
    `config.pbtxt`, else `DecodeOptions`' own defaults. Checked at load, not per request."""
    given = {key: value.strip() for key, value in parameters.items() if value.strip()}
    fields: dict[str, Any] = {}
    if "default_decoding_mode" in given:
        fields["mode"] = given["default_decoding_mode"]
    if "default_num_draft_tokens" in given:
        fields["num_draft_tokens"] = int(given["default_num_draft_tokens"])
    if "default_fanout" in given:
        fields["fanout"] = parse_fanout(given["default_fanout"])
    if "default_budget" in given:
        fields["budget"] = parse_budget(given["default_budget"])
    fields["adapt_k"] = given.get("default_adapt_k", "true").lower() == "true"
    return DecodeOptions(**fields)


@dataclass(frozen=True)
class ModelLimits:
    max_context: int
    vocab_size: int
    eos_token_id: int | None = None  # the model's end token (what min_length would ban)


@dataclass(frozen=True)
class ServingRequest:
    prompt_ids: list[int]
    options: DecodeOptions
    sampling: SamplingParams
    stream: bool = False
    stop_sequences: list[list[int]] = field(default_factory=list)
    exclude_input: bool = True  # False: a non-streamed completion repeats the prompt first
    logprobs: bool = False      # return_log_probs: the target's log-probability of each token
    perf_metrics: bool = False  # return_perf_metrics: tensorrtllm_backend's figures on every response
    batch_index: int = 0        # which item of a batched request this is
    batched: bool = False       # one of several prompts of a request
    text: bool = False          # sent as text_input: the model detokenizes its responses itself


def batch_size(get: GetInput) -> int:
    """Items in a request: the leading dimension of its prompt (tensorrtllm_backend's
    batched requests, `--batch-inputs`)."""
    for name in ("input_ids", "text_input"):
        array = get(name)
        if array is not None and np.ndim(array) > 0:
            return max(1, np.shape(array)[0])
    return 1


def batch_item(get: GetInput, index: int, size: int) -> GetInput:
    """The inputs of one item of a batched request: each input's row `index` (an input
    given once, with a leading dimension of 1, applies to every item)."""
    if size == 1:
        return get

    def item(name):
        array = get(name)
        if array is None:
            return None
        array = np.asarray(array)
        if array.ndim == 0 or array.shape[0] == 1:
            return array
        if array.shape[0] != size:
            raise RequestError(f"input '{name}' has {array.shape[0]} rows in a request of batch size {size}")
        return array[index:index + 1]
    return item


def scalar(get: GetInput, name: str):
    """The one value of an optional input, as a Python value (None when absent)."""
    array = get(name)
    if array is None:
        return None
    if array.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value.item()


def given_or(value, default):
    return default if value is None else value


def ids_of(get: GetInput, name: str) -> list[int] | None:
    array = get(name)
    return None if array is None else [int(i) for i in np.asarray(array).reshape(-1)]


def build_naming_inputs(cls, named_values: list[tuple[str, str, object]]):
    """Construct `cls` adding one input at a time, so its ValueError names the input."""
    kwargs = {}
    for input_name, field_name, value in named_values:
        if value is None:
            continue
        kwargs[field_name] = value
        try:
            cls(**kwargs)
        except ValueError as error:
            raise RequestError(f"input '{input_name}': {error}") from None
    return cls(**kwargs)


def require_inputs(get: GetInput, names: dict[str, str]) -> None:
    """RequestError naming every required input the request lacks. `names` maps the
    model's own input names to the names the client used (the ensemble's)."""
    missing = [f"'{client}'" for model, client in names.items() if get(model) is None]
    if missing:
        raise RequestError(f"missing required input{'s' if len(missing) > 1 else ''} {' and '.join(missing)}")


def check_prompt_fits(prompt_length: int, max_context: int, input_name: str) -> None:
    if prompt_length >= max_context:
        raise RequestError(f"input '{input_name}': a prompt of {prompt_length} tokens leaves no room "
                           f"in the context of {max_context} tokens")


def parse_prompt(get: GetInput, limits: ModelLimits) -> list[int]:
    prompt_ids = ids_of(get, "input_ids")
    length = scalar(get, "input_lengths")  # a batch's prompts come padded to the longest
    if prompt_ids is not None and length is not None:
        if not 0 <= length <= len(prompt_ids):
            raise RequestError(f"input 'input_lengths' = {length} is not in [0, {len(prompt_ids)}] "
                               f"(the ids given)")
        prompt_ids = prompt_ids[:length]
    if not prompt_ids:
        raise RequestError("input 'input_ids' is empty: give at least one token")
    check_prompt_fits(len(prompt_ids), limits.max_context, "input_ids")
    if min(prompt_ids) < 0 or max(prompt_ids) >= limits.vocab_size:
        raise RequestError(f"input 'input_ids': token ids must lie in [0, {limits.vocab_size}); "
                           f"got {min(prompt_ids)}..{max(prompt_ids)}")
    return prompt_ids


def parse_max_tokens(get: GetInput, prompt_length: int, limits: ModelLimits) -> int:
    max_tokens = scalar(get, "max_tokens")
    room = limits.max_context - prompt_length
    if max_tokens > room:
        raise RequestError(f"input 'max_tokens': {max_tokens} new tokens after a prompt of "
                           f"{prompt_length} tokens exceed the context of {limits.max_context} "
                           f"tokens (at most {room})")
    return max_tokens


def parse_end_id(get: GetInput, limits: ModelLimits) -> int | None:
    end_id = scalar(get, "end_id")
    if end_id is not None and not (end_id == -1 or 0 <= end_id < limits.vocab_size):
        raise RequestError(f"input 'end_id' must be -1 (never stop early) or a token id in "
                           f"[0, {limits.vocab_size}), got {end_id}")
    return end_id


def one_of(get: GetInput, *names: str):
    """The value of an input that has several spellings in tensorrtllm_backend's versions
    (`seed` / `random_seed`, `min_tokens` / `min_length`); contradicting spellings are an error."""
    given = {name: scalar(get, name) for name in names}
    given = {name: value for name, value in given.items() if value is not None}
    if len(set(given.values())) > 1:
        raise RequestError(f"inputs {' and '.join(map(repr, given))} disagree ({list(given.values())}): give one")
    return next(iter(given.values()), None)


def check_min_length(get: GetInput, options: DecodeOptions, limits: ModelLimits) -> None:
    """min_length bans the end token before that many tokens. Masking the target inside
    the engines' verification is not possible, so it is honoured only where it bans
    nothing: at most 1, or when no end token stops the generation (end_id -1)."""
    min_length = one_of(get, "min_length", "min_tokens")
    end = limits.eos_token_id if options.eos_token_id is None else options.eos_token_id
    if min_length is None or min_length <= 1 or end is None or end == -1:
        return
    name = "min_length" if get("min_length") is not None else "min_tokens"
    raise RequestError(f"input '{name}' = {min_length} cannot be honoured: banning the end token would "
                       f"change the target's distribution inside the engines' verification; send end_id -1 "
                       f"(never stop early) to get max_tokens tokens, or leave {name} out")


def parse_top_p(get: GetInput):
    """tensorrtllm_backend's clients send top_p 0 for "off" (its models read <= 0 so)."""
    top_p = scalar(get, "top_p")
    return None if top_p is not None and top_p <= 0 else top_p


def text_prompt(get: GetInput, encode: Callable[[str, bool], list[int]]) -> GetInput:
    """A request sent as `text_input` (the llmapi model's way): its ids, encoded here."""
    text = scalar(get, "text_input")
    chat = bool(scalar(get, "chat"))
    ids = np.array([encode(text if isinstance(text, str) else str(text), chat)], np.int32)
    return lambda name: ids if name == "input_ids" else get(name)


def parse_request(get: GetInput, defaults: DecodeOptions, limits: ModelLimits, index: int = 0,
                  encode: Callable[[str, bool], list[int]] | None = None) -> ServingRequest:
    """One request (or one item of a batched request, `index`); `encode` takes requests
    sent as `text_input` instead of `input_ids`."""
    as_text = encode is not None and get("input_ids") is None and get("text_input") is not None
    if as_text:
        assert encode is not None  # as_text says so
        require_inputs(get, {"text_input": "text_input", "max_tokens": "max_tokens"})
        get = text_prompt(get, encode)
    require_inputs(get, {"input_ids": "input_ids", "max_tokens": "max_tokens"})
    refuse_unhonoured(get)
    prompt_ids = parse_prompt(get, limits)
    fanout = ids_of(get, "fanout")
    pinned_k = scalar(get, "num_draft_tokens")  # a client that names K keeps it every round
    options = build_naming_inputs(DecodeOptions, [
        ("decoding_mode", "mode", given_or(scalar(get, "decoding_mode"), defaults.mode)),
        ("num_draft_tokens", "num_draft_tokens", given_or(pinned_k, defaults.num_draft_tokens)),
        ("num_draft_tokens", "adapt_k", defaults.adapt_k and pinned_k is None),
        ("fanout", "fanout", tuple(fanout) if fanout else defaults.fanout),
        ("budget", "budget", given_or(scalar(get, "budget"), defaults.budget)),
        ("saguaro_factor", "saguaro_factor", scalar(get, "saguaro_factor")),
        ("max_tokens", "max_tokens", parse_max_tokens(get, len(prompt_ids), limits)),
        ("end_id", "eos_token_id", parse_end_id(get, limits)),
    ])
    sampling = build_naming_inputs(SamplingParams, [
        ("temperature", "temperature", scalar(get, "temperature")),
        ("top_k", "top_k", scalar(get, "top_k")),
        ("top_p", "top_p", parse_top_p(get)),
        ("seed", "seed", one_of(get, "seed", "random_seed")),
    ])
    check_min_length(get, options, limits)
    stop_words = get("stop_words_list")
    exclude_input = scalar(get, "exclude_input_in_output")
    return ServingRequest(prompt_ids, options, sampling, stream=bool(scalar(get, "stream")),
                          stop_sequences=parse_word_list(stop_words) if stop_words is not None else [],
                          exclude_input=True if exclude_input is None else bool(exclude_input),
                          logprobs=bool(scalar(get, "return_log_probs")),
                          perf_metrics=bool(scalar(get, "return_perf_metrics")), batch_index=index, text=as_text)


def parse_batch(get: GetInput, defaults: DecodeOptions, limits: ModelLimits,
                encode: Callable[[str, bool], list[int]] | None = None) -> list[ServingRequest]:
    """Every item of a request, all checked before any starts; an error names the item
    of a batched request."""
    size = batch_size(get)
    requests = []
    for index in range(size):
        try:
            request = parse_request(batch_item(get, index, size), defaults, limits, index, encode)
            requests.append(replace(request, batched=True) if size > 1 else request)
        except RequestError as error:
            raise RequestError(f"batch item {index}: {error}" if size > 1 else str(error)) from None
    return requests


class TextCodec:
    """The engines' tokenizer on the text side: encodes exactly as `Pipeline.encode` (or
    `Pipeline.encode_chat`) and decodes as `Pipeline.decode`, so served text equals the
    runtime's."""

    def __init__(self, tokenizer_dir: str | Path):
        self.tokenizer = load_tokenizer(Path(tokenizer_dir))

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """`chat`: the text is one user turn, rendered with the model's chat template."""
        if not text:
            raise RequestError("input 'text_input' is empty: give at least one character of text")
        try:
            return encode_chat(self.tokenizer, chat_messages(text)) if chat else encode_text(self.tokenizer, text)
        except PromptError as error:
            raise RequestError(f"input '{'chat' if chat else 'text_input'}': {error}") from None

    def encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


# Word lists in tensorrtllm_backend's layout: row 0 the words' token ids end to end, row 1
# each word's end offset, both padded (ids with 0, offsets with -1) to one length.

def split_words(texts: list[str]) -> list[str]:
    """tensorrtllm_backend reads each string as CSV: "a,b" is two words."""
    return [word for text in texts for row in csv.reader([text]) for word in row if word]


def word_list(encode: Callable[[str], list[int]], words: list[str]) -> np.ndarray:
    ids, offsets = [], []
    for word in words:
        ids += encode(word)
        offsets.append(len(ids))
    width = max(len(ids), len(offsets), 1)
    return np.array([ids + [0] * (width - len(ids)), offsets + [-1] * (width - len(offsets))],
                    dtype=np.int32)


def parse_word_list(array: np.ndarray) -> list[list[int]]:
    array = np.asarray(array)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]  # the batch dimension of one request
    if array.ndim != 2 or array.shape[0] != 2:
        raise RequestError(f"input 'stop_words_list' must have shape [1, 2, n] (token ids end to end; each "
                           f"word's end offset, padded with -1), got {list(np.asarray(array).shape)}")
    ids, ends = array[0].tolist(), [int(end) for end in array[1] if end >= 0]
    if any(b <= a for a, b in zip([0] + ends, ends)) or (ends and ends[-1] > len(ids)):
        raise RequestError(f"input 'stop_words_list': offsets {ends} are not increasing within {len(ids)} ids")
    return [ids[start:end] for start, end in zip([0] + ends, ends)]
