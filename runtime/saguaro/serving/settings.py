"""The serving settings' defaults and rules, one home for the launcher, the model
repository's templates and the Triton models that read them back.

`stream_interval` is how many rounds a stream's tokens may wait before they are sent, as
TensorRT-LLM's and vLLM's `stream_interval` (tokens per streamed response) trades
smoothness for host work. Every response costs CPU in the model's stub, in Triton's
server and in the client, whatever it carries: at one stream that is a fraction of a
round, at sixteen it is most of it. "auto" keeps a round's responses to about
`RESPONSES_PER_ROUND` whatever the batch: every round for up to that many streams, every
second round for twice as many, and so on; an integer N sends every N rounds. A stream's
first token (its prefill's) goes out at once (time to first token does not wait for the
interval, as in vLLM), the final response always brings what is left, so no token waits
past the end, and a stream whose last response is still waiting in the model's outbox adds its tokens to it
(`responses.ResponseStream.send_update`).
"""
from __future__ import annotations

import math

DEFAULT_MAX_QUEUE = 1024  # requests waiting for a KV slot; more are refused (UNAVAILABLE)
# Prompts one request may hold (tensorrtllm_backend's triton_max_batch_size); each runs as a
# request of its own in the scheduler, so this bounds a request, not the KV slots.
DEFAULT_TRITON_MAX_BATCH_SIZE = 8
DEFAULT_STREAM_INTERVAL = "auto"
RESPONSES_PER_ROUND = 4  # "auto": streamed responses per round the batch's streams share


def parse_stream_interval(text: str) -> int | str:
    """"auto" or an integer >= 1 (rounds between a stream's responses)."""
    value = str(text).strip()
    if value == "auto":
        return value
    try:
        rounds = int(value)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise ValueError(f"stream interval takes 'auto' or an integer >= 1 (rounds); got {text!r}")
    return rounds


def rounds_per_response(interval: int | str, batch: int) -> int:
    """Rounds a stream's tokens wait before they are sent, in a batch of `batch` requests."""
    if interval == "auto":
        return max(1, math.ceil(batch / RESPONSES_PER_ROUND))
    assert isinstance(interval, int)  # parsed: "auto" or an integer >= 1
    return interval
