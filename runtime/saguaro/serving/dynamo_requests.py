"""A request from NVIDIA Dynamo's frontend, checked whole before any work, as the pipeline's
own request. No Dynamo import: the parser and its tests run without Dynamo installed.

Dynamo's frontend does the OpenAI side (chat template, tokenizer, stop strings,
detokenizing) and sends a worker registered with `ModelInput.Tokens` a preprocessed
request, a dict: `token_ids`, `stop_conditions` (`max_tokens`, `min_tokens`,
`stop_token_ids*`, `ignore_eos`), `sampling_options` (`temperature`, `top_p`, `top_k`,
`seed`, penalties, `n`, beams, guided decoding) and `output_options` (log-probs), plus
the model's `eos_token_ids` and routing fields this worker ignores. `parse_request` maps
it to the pipeline's `DecodeOptions` and `SamplingParams` and the tokens that end the
generation; anything SSD cannot honour exactly is refused with a `RequestError` that names
the field as Dynamo's request spells it (`sampling_options.presence_penalty`), never
dropped in silence: penalties, min-p and guided decoding change the target's distribution,
which the engines' verification keeps unchanged (see `interface.py`). Stop strings need
nothing here: the frontend matches them on the text and ends the stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import RequestError
from saguaro.serving.interface import GUIDED, LOSSLESS, NEUTRAL_ONLY
from saguaro.serving.requests import ModelLimits

# OpenAI's default when a request names no temperature (vLLM's and TensorRT-LLM's too).
DEFAULT_TEMPERATURE = 1.0
STOP_TOKEN_FIELDS = ("stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden")


@dataclass(frozen=True)
class Neutral:
    """A sampling or output option SSD honours only at the value that changes nothing."""

    accepts: Callable[[Any], bool]  # value -> whether it changes nothing (None, the field left out, always does)
    accepted: str    # the accepted value(s), as the error message says it
    why: str


SAMPLING_NEUTRAL = {
    "n": Neutral(lambda v: v == 1, "1", NEUTRAL_ONLY["num_return_sequences"].why),
    "best_of": Neutral(lambda v: v == 1, "1", NEUTRAL_ONLY["num_return_sequences"].why),
    "use_beam_search": Neutral(lambda v: not v, "false", NEUTRAL_ONLY["beam_width"].why),
    "presence_penalty": Neutral(lambda v: v == 0, "0", LOSSLESS),
    "frequency_penalty": Neutral(lambda v: v == 0, "0", LOSSLESS),
    "repetition_penalty": Neutral(lambda v: v == 1, "1", LOSSLESS),
    "min_p": Neutral(lambda v: v == 0, "0", LOSSLESS),
    "guided_decoding": Neutral(lambda v: not v, "none", GUIDED),
}
OUTPUT_NEUTRAL = {
    "logprobs": Neutral(lambda v: not v, "none", "the Dynamo worker streams token ids only; the target's "
                        "log-probabilities come from the Triton server (return_log_probs, or logprobs in its OpenAI API)"),
    "prompt_logprobs": Neutral(lambda v: not v, "none", NEUTRAL_ONLY["return_context_logits"].why),
}


@dataclass(frozen=True)
class TokenRequest:
    """What the pipeline runs for one Dynamo request."""

    prompt_ids: list[int]
    options: DecodeOptions
    sampling: SamplingParams
    end_tokens: frozenset[int]  # any of them ends the generation (kept as its last token)


def section(request: dict, name: str) -> dict:
    """One of the request's option groups (absent or null: empty)."""
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be an object, got {type(value).__name__}")
    return value


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_list(value, field: str, vocab_size: int) -> list[int]:
    if not (isinstance(value, list) and all(is_integer(token) for token in value)):
        raise RequestError(f"{field} must be a list of token ids, got {str(value)[:80]}")
    if value and (min(value) < 0 or max(value) >= vocab_size):
        raise RequestError(f"{field}: token ids must lie in [0, {vocab_size}); got {min(value)}..{max(value)}")
    return value


def parse_prompt(request: dict, limits: ModelLimits) -> list[int]:
    if request.get("token_ids") is None:
        raise RequestError("token_ids is missing: the request carries no prompt tokens")
    prompt_ids = token_list(request["token_ids"], "token_ids", limits.vocab_size)
    if not prompt_ids:
        raise RequestError("token_ids is empty: give at least one token")
    if len(prompt_ids) >= limits.max_context:
        raise RequestError(f"token_ids: a prompt of {len(prompt_ids)} tokens leaves no room in the context "
                           f"of {limits.max_context} tokens")
    return prompt_ids


def parse_max_tokens(stop: dict, prompt_length: int, limits: ModelLimits) -> int:
    """The request's limit, or all the room the context leaves (vLLM's default)."""
    room = limits.max_context - prompt_length
    max_tokens = stop.get("max_tokens")
    if max_tokens is None:
        return room
    if not (is_integer(max_tokens) and max_tokens >= 1):
        raise RequestError(f"stop_conditions.max_tokens must be an integer >= 1, got {max_tokens!r}")
    if max_tokens > room:
        raise RequestError(f"stop_conditions.max_tokens: {max_tokens} new tokens after a prompt of {prompt_length} "
                           f"tokens exceed the context of {limits.max_context} tokens (at most {room})")
    return max_tokens


def parse_end_tokens(request: dict, stop: dict, limits: ModelLimits) -> frozenset[int]:
    """The model's end-of-generation tokens (unless `ignore_eos`) and every stop token the
    request names; the frontend hides the hidden ones from the text."""
    eos = set(token_list(request.get("eos_token_ids") or [], "eos_token_ids", limits.vocab_size))
    if limits.eos_token_id is not None:
        eos.add(limits.eos_token_id)
    named = set()
    for field in STOP_TOKEN_FIELDS:
        named |= set(token_list(stop.get(field) or [], f"stop_conditions.{field}", limits.vocab_size))
    if stop.get("ignore_eos"):
        return frozenset(named - eos)
    return frozenset(eos | named)


def check_min_tokens(stop: dict, end_tokens: frozenset[int]) -> None:
    """min_tokens bans the end tokens for that many tokens, which verification inside the
    engines cannot do (the `min_length` rule of the Triton interface)."""
    min_tokens = stop.get("min_tokens")
    if min_tokens is None or (is_integer(min_tokens) and min_tokens <= 1) or not end_tokens:
        return
    raise RequestError(f"stop_conditions.min_tokens = {min_tokens} cannot be honoured: banning the end tokens would "
                       f"change the target's distribution inside the engines' verification; send ignore_eos "
                       f"(and no stop tokens) to get max_tokens tokens, or leave min_tokens out")


def refuse_unhonoured(options: dict, rules: dict[str, Neutral], group: str) -> None:
    for name, rule in rules.items():
        value = options.get(name)
        if value is not None and not rule.accepts(value):
            raise RequestError(f"{group}.{name} = {value!r} cannot be honoured: {rule.why} "
                               f"(accepted: {rule.accepted})")


def number(options: dict, name: str, default):
    value = options.get(name)
    if value is None:
        return default
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise RequestError(f"sampling_options.{name} must be a finite number, got {value!r}")
    return value


def parse_sampling(options: dict) -> SamplingParams:
    refuse_unhonoured(options, SAMPLING_NEUTRAL, "sampling_options")
    top_k = number(options, "top_k", 0)
    values = {"temperature": float(number(options, "temperature", DEFAULT_TEMPERATURE)),
              "top_k": 0 if top_k == -1 else top_k,  # vLLM's "off" is -1, ours 0
              "top_p": float(number(options, "top_p", 1.0)),
              "seed": options.get("seed")}
    checked: dict[str, Any] = {}
    for name, value in values.items():  # one at a time, so that the error names the field
        checked[name] = value
        try:
            SamplingParams(**checked)
        except ValueError as error:
            raise RequestError(f"sampling_options.{name}: {error}") from None
    return SamplingParams(**checked)


def parse_request(request: dict, defaults: DecodeOptions, limits: ModelLimits) -> TokenRequest:
    """Raises RequestError naming the field at fault, before any model runs."""
    if not isinstance(request, dict):
        raise RequestError(f"a request must be an object, got {type(request).__name__}")
    prompt_ids = parse_prompt(request, limits)
    stop = section(request, "stop_conditions")
    end_tokens = parse_end_tokens(request, stop, limits)
    check_min_tokens(stop, end_tokens)
    refuse_unhonoured(section(request, "output_options"), OUTPUT_NEUTRAL, "output_options")
    sampling = parse_sampling(section(request, "sampling_options"))
    # eos_token_id -1: the pipeline's own end token is off; `end_tokens` replaces it
    options = replace(defaults, max_tokens=parse_max_tokens(stop, len(prompt_ids), limits), eos_token_id=-1)
    return TokenRequest(prompt_ids, options, sampling, end_tokens)
