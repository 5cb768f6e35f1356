"""What a served request sends back, shared by the Triton `ssd` model and the tests, with
no Triton import.

`start_request` hands a parsed request (`requests.ServingRequest`) to the pipeline's
scheduler and turns its rounds into response arrays: one per round when streaming, else a
content-free heartbeat per round (so that Triton's cancellation reaches the
postprocessing step, see `ResponseStream`) and the whole completion at the end; the final
response carries the request's stats.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from saguaro.runtime.detokenizer import prefix_window
from saguaro.serving.requests import ServingRequest

Send = Callable[[dict, bool], None]  # (response arrays, whether this is the final response)
StopReason = Callable[[], "str | None"]  # why the generation must stop now, or None


def first_stop_end(generated: list[int], start: int, stops: list[list[int]]) -> int | None:
    """Index just past the earliest stop sequence that ends in `generated[start:]`."""
    for end in range(start + 1, len(generated) + 1):
        if any(stop and end >= len(stop) and generated[end - len(stop):end] == stop for stop in stops):
            return end
    return None


def row(values, dtype) -> np.ndarray:
    """A `[1, n]` array: the batch dimension of one request, then the values."""
    return np.array(values, dtype=dtype).reshape(1, -1)


@dataclass(frozen=True)
class Summary:
    """What the final response says about the whole request."""

    finish_reason: str
    stats: dict
    input_tokens: int
    output_tokens: int


def response_arrays(new_ids: list[int], prefix_ids: list[int], summary: Summary | None = None
                    ) -> dict[str, np.ndarray]:
    """Every output of the SSD model, in every response (an ensemble step needs them all);
    the summary's outputs are empty until the final response, which is the one with a summary."""
    stats = summary.stats if summary else {}

    def figure(value, dtype) -> np.ndarray:
        return row([value] if summary else [], dtype)

    return {
        "output_ids": row(new_ids, np.int32),
        "prefix_ids": row(prefix_ids, np.int32),
        "is_final": row([summary is not None], bool),
        "finish_reason": row([summary.finish_reason.encode()] if summary else [], object),
        "accepted_histogram": row(stats.get("accepted_histogram", []), np.int32),
        "cache_hits": figure(stats.get("cache_hits"), np.int32),
        "cache_misses": figure(stats.get("cache_misses"), np.int32),
        "tokens_per_s": figure(stats.get("tokens_per_s"), np.float32),
        "num_input_tokens": figure(summary and summary.input_tokens, np.int32),
        "num_output_tokens": figure(summary and summary.output_tokens, np.int32),
        "sampling_seed": figure(stats.get("seed"), np.uint64),
    }


def heartbeat_arrays() -> dict[str, np.ndarray]:
    """A non-final response with no tokens: it carries no text, and the postprocessing
    model drops it (no client response), but it makes Triton schedule a postprocessing
    step, the only step that sees the ensemble request's cancellation (Triton does not
    cancel a step already running, such as the generation itself)."""
    return response_arrays([], [])


@dataclass
class Outcome:
    finish_reason: str   # the generation's, "stop" for a stop sequence, or why it was stopped
    output_ids: list[int]
    stats: dict


class ResponseStream:
    """Receives a generation's rounds and sends them on as response arrays: each round's
    tokens when streaming, else a heartbeat per round and everything at the end."""

    def __init__(self, request: ServingRequest, send: Send):
        self.request, self.send = request, send
        self.generated: list[int] = []
        self.stopped = False  # a stop sequence ended the generation

    def on_tokens(self, tokens: list[int]) -> None:
        if self.stopped:
            return
        start = len(self.generated)
        self.generated += tokens
        end = first_stop_end(self.generated, start, self.request.stop_sequences)
        if end is not None:
            del self.generated[end:]
            self.stopped = True
        if not self.request.stream:
            self.send(heartbeat_arrays(), False)
        elif len(self.generated) > start:
            self.send(response_arrays(self.generated[start:], prefix_window(self.generated, start)), False)

    def finish(self, generation, stop_reason: str | None = None) -> Outcome:
        """The final response, also for a stopped generation: in a Triton 2.51 ensemble an
        error from one step while another still runs leaves the request in flight forever."""
        if self.stopped:
            reason = "stop"
        elif generation.finish_reason == "cancelled" and stop_reason:
            reason = stop_reason
        else:
            reason = generation.finish_reason
        outcome = Outcome(reason, list(self.generated), {**generation.stats.as_dict(), "seed": generation.seed})
        summary = Summary(reason, outcome.stats, len(self.request.prompt_ids), len(self.generated))
        if self.request.stream:  # like TensorRT-LLM, a stream never repeats the prompt
            new_ids, prefix_ids = [], prefix_window(self.generated, len(self.generated))
        else:
            new_ids = ([] if self.request.exclude_input else list(self.request.prompt_ids)) + self.generated
            prefix_ids = []
        self.send(response_arrays(new_ids, prefix_ids, summary), True)
        return outcome


def start_request(pipeline, request: ServingRequest, send: Send, stop_reason: StopReason) -> Future:
    """Queue the generation with the pipeline's scheduler; responses go out as its rounds
    complete (from the scheduler's thread), and a final one with the stats. `stop_reason`
    is asked before every round (a reason stops the generation). The future's result is
    the `Outcome`, once the final response is sent."""
    stream = ResponseStream(request, send)
    queued = pipeline.submit(pipeline.request(request.prompt_ids, request.options, request.sampling,
                                              on_tokens=stream.on_tokens,
                                              cancelled=lambda: stream.stopped or stop_reason() is not None))
    outcome: Future = Future()

    def finish(generation: Future) -> None:
        try:
            outcome.set_result(stream.finish(generation.result(), stop_reason()))
        except Exception as error:  # noqa: BLE001 - the caller reports it to the client
            outcome.set_exception(error)

    queued.add_done_callback(finish)
    return outcome


def run_request(pipeline, request: ServingRequest, send: Send, stop_reason: StopReason) -> Outcome:
    """`start_request`, waited for."""
    return start_request(pipeline, request, send, stop_reason).result()
