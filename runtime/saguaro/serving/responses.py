"""What a served request sends back, shared by the Triton `ssd` model and the tests, with
no Triton import.

`start_request` hands a parsed request (`requests.ServingRequest`) to the pipeline's
scheduler and turns its rounds into response arrays: one per round when streaming, else a
content-free heartbeat per round (so that Triton's cancellation reaches the
postprocessing step, see `ResponseStream`) and the whole completion at the end; the final
response carries the request's stats.

A stream's tokens are sent every `interval` rounds (`settings.stream_interval`: under
load one response carries several rounds' tokens, so the work per token falls as streams
are added; alone, a stream gets one response per round), through `post` (the Triton
model's outbox thread, which passes them to the server while the next round runs).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from saguaro.runtime.core.stats import GenerationStats
from saguaro.runtime.models.detokenizer import Decode, prefix_window, text_delta
from saguaro.serving.requests import ServingRequest

Send = Callable[[dict, bool], None]  # (response arrays, whether this is the final response)
Post = Callable[[Callable[[], None]], None]  # runs work later, in order (one sender thread)
StopReason = Callable[[], "str | None"]  # why the generation must stop now, or None


class Urgent:
    """Work that a client waits on (a stream's first tokens, a final response, an error):
    a `post` that queues may run it before routine work already waiting (`Outbox`), never
    before urgent work posted earlier. A final response gates the client's next request
    and its KV slot's next tenant; behind a queue of routine updates at 16 streams it had
    reached clients 12-18 ms after the round that made it, a tenth of the slots' time."""

    def __init__(self, work: Callable[[], None]):
        self.work = work

    def __call__(self) -> None:
        self.work()


def first_stop_end(generated: list[int], start: int, stops: list[list[int]]) -> int | None:
    """Index just past the earliest stop sequence that ends in `generated[start:]`."""
    for end in range(start + 1, len(generated) + 1):
        if any(stop and end >= len(stop) and generated[end - len(stop):end] == stop for stop in stops):
            return end
    return None


def row(values, dtype) -> np.ndarray:
    """A `[1, n]` array: the batch dimension of one request, then the values."""
    return np.array(values, dtype=dtype).reshape(1, -1)


def now_ns() -> int:
    """The clock of the perf-metric times: steady (CLOCK_MONOTONIC), as TensorRT-LLM's."""
    return time.monotonic_ns()


@dataclass(frozen=True)
class Summary:
    """What the final response says about the whole request."""

    finish_reason: str
    stats: dict


@dataclass
class Timing:
    """tensorrtllm_backend's request times (ns): arrival at the model, joining a batch (its
    KV slots taken, the prompt about to be prefilled), the first and the latest token."""

    arrival_ns: int = field(default_factory=now_ns)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0


# tensorrtllm_backend's perf-metric outputs (`return_perf_metrics`), every one `[1, 1]`.
PERF_OUTPUTS = {"kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
                "kv_cache_alloc_total_blocks": np.int32, "arrival_time_ns": np.int64,
                "first_scheduled_time_ns": np.int64, "first_token_time_ns": np.int64,
                "last_token_time_ns": np.int64, "acceptance_rate": np.float32,
                "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32}


def perf_values(stats: GenerationStats | None, timing: Timing) -> dict:
    """The request's perf figures so far. KV "blocks" are the slots it holds, one per
    engine it runs on (target, and draft when it drafts), allocated when it joins a batch;
    none is ever reused (no prefix caching). Acceptance is SSD's own: drafts the target
    accepted over drafts it verified."""
    drafted = stats.drafted_tokens if stats else 0
    accepted = stats.accepted_tokens if stats else 0
    slots = (1 + (stats.num_draft_tokens > 0)) if stats else 0
    return {"kv_cache_alloc_new_blocks": slots, "kv_cache_reused_blocks": 0, "kv_cache_alloc_total_blocks": slots,
            "arrival_time_ns": timing.arrival_ns, "first_scheduled_time_ns": timing.first_scheduled_ns,
            "first_token_time_ns": timing.first_token_ns, "last_token_time_ns": timing.last_token_ns,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "total_accepted_draft_tokens": accepted, "total_draft_tokens": drafted}


@dataclass(frozen=True)
class Response:
    """One response's content, before it becomes arrays."""

    new_ids: list[int]
    prefix_ids: list[int]
    output_tokens: int                      # generated so far
    logprobs: list[float] | None = None     # of `new_ids`' generated tokens (None: not asked for)
    cum_logprob: float = 0.0
    perf: dict | None = None                # None: not asked for
    text: str | None = None                 # None: the client detokenizes (postprocessing)
    summary: Summary | None = None          # the final response's


def response_arrays(response: Response, request: ServingRequest) -> dict[str, np.ndarray]:
    """The outputs of one response of the SSD model. Every response carries its tokens and
    the token counts; the whole request's figures ride on the final one, `batch_index`
    on those of a batched request (as tensorrtllm_backend sends it), log-probabilities
    and perf metrics on those of requests that asked. The postprocessing model takes all
    of these as optional inputs: each tensor a response leaves out is a tensor less to
    pass between the processes, every round."""
    summary = response.summary
    stats = summary.stats if summary else {}

    logprobs = response.logprobs
    arrays = {
        "output_ids": row(response.new_ids, np.int32),
        "prefix_ids": row(response.prefix_ids, np.int32),
        "is_final": row([summary is not None], bool),
        "num_input_tokens": row([len(request.prompt_ids)], np.int32),
        "num_output_tokens": row([response.output_tokens], np.int32),
    }
    if summary is not None:  # the whole request's figures, on its final response
        arrays.update({
            "finish_reason": row([summary.finish_reason.encode()], object),
            "accepted_histogram": row(stats.get("accepted_histogram", []), np.int32),
            "cache_hits": row([stats.get("cache_hits")], np.int32),
            "cache_misses": row([stats.get("cache_misses")], np.int32),
            "tokens_per_s": row([stats.get("tokens_per_s")], np.float32),
            "sampling_seed": row([stats.get("seed")], np.uint64)})
    if request.batched:  # as tensorrtllm_backend: which prompt of a batched request
        arrays.update({"batch_index": row([request.batch_index], np.int32), "sequence_index": row([0], np.int32)})
    if logprobs is not None:  # outputs a request did not ask for are left out, not sent empty
        arrays["cum_log_probs"] = row([response.cum_logprob], np.float32)
        arrays["output_log_probs"] = np.array(logprobs, np.float32).reshape(1, 1, -1)
    if response.perf is not None:
        arrays.update({name: row([response.perf[name]], dtype) for name, dtype in PERF_OUTPUTS.items()})
    if response.text is not None:
        arrays["text_output"] = np.array([response.text.encode("utf-8")], dtype=object)
    return arrays


@dataclass
class Outcome:
    finish_reason: str   # the generation's, "stop" for a stop sequence, or why it was stopped
    output_ids: list[int]
    stats: dict


class ResponseStream:
    """Receives a generation's rounds (in the scheduler's thread) and sends them on as
    response arrays: the tokens not sent yet when streaming, else a heartbeat, every
    `interval()` rounds (default: each), and everything at the end. With `decode` (the
    model detokenizes itself, as for `text_input` requests) each response also carries its
    text. `post` sends them, in order (default: at once); a stream has at most one response
    waiting there, which takes every token kept until it is sent (`send_update`)."""

    def __init__(self, request: ServingRequest, send: Send, decode: Decode | None = None,
                 timing: Timing | None = None, post: Post | None = None, interval: Callable[[], int] | None = None):
        self.request, self.send, self.decode = request, send, decode
        self.post: Post = post or (lambda work: work())
        self.interval = interval or (lambda: 1)
        self.timing = timing or Timing()
        self.generated: list[int] = []
        self.logprobs: list[float] | None = [] if request.logprobs else None  # the decoder appends to it
        self.stats: GenerationStats | None = None
        self.stopped = False     # a stop sequence ended the generation
        self.sent = 0            # tokens already streamed
        self.rounds_unsent = 0   # rounds since the last response
        self.updated = False     # a response before the final one was posted
        self.pending = False     # a response posted and not sent yet: it takes the tokens kept since
        self.closed = False      # the final response went out: a response still waiting sends nothing
        self.lock = threading.Lock()  # the kept tokens, read by `post`'s thread

    def on_start(self, stats: GenerationStats) -> None:
        self.stats = stats
        self.timing.first_scheduled_ns = now_ns()

    def on_tokens(self, tokens: list[int]) -> None:
        """Keep the round's tokens (up to a stop sequence); send when the interval is up."""
        if self.stopped:
            return
        self.timing.last_token_ns = now_ns()
        self.timing.first_token_ns = self.timing.first_token_ns or self.timing.last_token_ns
        with self.lock:
            start = len(self.generated)
            self.generated += tokens
            end = first_stop_end(self.generated, start, self.request.stop_sequences)
            if end is not None:
                del self.generated[end:]
                self.stopped = True
        self.rounds_unsent += 1
        if self.rounds_unsent >= self.interval() or not self.updated:  # the first token goes at once, as vLLM's
            self.send_update()

    def send_update(self) -> None:
        """Post a response for the tokens kept since the last one, built when `post` runs
        it; none while one is still waiting there, as that one takes these tokens too. The
        Triton model's outbox sends one response per message to the server: 0.5-0.7 ms each
        with 16 streams on two busy cores, against rounds of 4 ms on the tiny engines, so
        a response per stream every few rounds had piled up 1700 deep and reached clients
        0.8 s late (and their next requests late: 11.6 of 16 slots busy). Coalesced, the
        outbox holds at most one response per stream, and a busier outbox sends fewer,
        longer ones."""
        first = not self.updated
        self.rounds_unsent, self.updated = 0, True
        with self.lock:
            if self.pending:
                return
            self.pending = True
        self.post(Urgent(self._send_kept) if first else self._send_kept)

    def _send_kept(self) -> None:
        """The tokens kept since the last response, or a heartbeat (not streaming: no
        tokens, so postprocessing answers nothing, but Triton schedules a postprocessing
        step, the only step that sees the ensemble request's cancellation; Triton does not
        cancel a step already running)."""
        with self.lock:
            self.pending = False
            if self.closed:  # the final response went ahead of this one and took its tokens
                return
            if not self.request.stream:
                response = self.response([], [])
            elif len(self.generated) > self.sent:
                start, self.sent = self.sent, len(self.generated)
                response = self.response(self.generated[start:], prefix_window(self.generated, start), start)
            else:
                return
        self.send(response_arrays(response, self.request), False)

    def response(self, new_ids: list[int], prefix_ids: list[int], logprobs_from: int | None = None,
                 summary: Summary | None = None, final: bool = False) -> Response:
        # the decoder appends a round's log-probabilities before `on_tokens` hears of its tokens
        kept = len(self.generated)
        logprobs = None
        if self.logprobs is not None:
            logprobs = [] if logprobs_from is None else self.logprobs[logprobs_from:kept]
        text = None
        if self.decode is not None and (new_ids or final):
            text = text_delta(self.decode, prefix_ids, new_ids, final) if new_ids else ""
        perf = perf_values(self.stats, self.timing) if self.request.perf_metrics else None
        return Response(new_ids, prefix_ids, kept, logprobs,
                        sum(self.logprobs[:kept]) if self.logprobs else 0.0, perf, text, summary)

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
        summary = Summary(reason, outcome.stats)
        if self.request.stream:  # like TensorRT-LLM, a stream never repeats the prompt
            response = self.response([], prefix_window(self.generated, len(self.generated)), None, summary, True)
        else:
            prompt = [] if self.request.exclude_input else list(self.request.prompt_ids)
            response = self.response(prompt + self.generated, [], 0, summary, True)
            if self.decode is not None:  # the whole text, the prompt's too when it is repeated
                response = replace(response, text=self.decode(prompt + self.generated))
        arrays = response_arrays(response, self.request)
        self.post(Urgent(lambda: self._send_final(arrays)))
        return outcome

    def _send_final(self, arrays: dict) -> None:
        """The tokens the interval kept back (streaming), then the final response; a
        response of this stream still waiting behind it sends nothing."""
        if self.request.stream:
            self._send_kept()
        with self.lock:
            self.closed = True
        self.send(arrays, True)


def start_request(pipeline, request: ServingRequest, send: Send, stop_reason: StopReason,
                  decode: Decode | None = None, timing: Timing | None = None, post: Post | None = None,
                  interval: Callable[[], int] | None = None) -> Future:
    """Queue the generation with the pipeline's scheduler; responses go out as its rounds
    complete (sent through `post`, else from the scheduler's thread; every `interval()`
    rounds), and a final one with the stats. `stop_reason` is asked before every round (a
    reason stops the generation). The future's result is the `Outcome`, once the final
    response is handed to `post`."""
    stream = ResponseStream(request, send, decode, timing, post, interval)
    queued = pipeline.submit(pipeline.request(request.prompt_ids, request.options, request.sampling,
                                              on_tokens=stream.on_tokens,
                                              cancelled=lambda: stream.stopped or stop_reason() is not None,
                                              logprobs=stream.logprobs, on_start=stream.on_start))
    outcome: Future = Future()

    def finish(generation: Future) -> None:
        try:
            outcome.set_result(stream.finish(generation.result(), stop_reason()))
        except Exception as error:  # noqa: BLE001 - the caller reports it to the client
            outcome.set_exception(error)

    queued.add_done_callback(finish)
    return outcome


def run_request(pipeline, request: ServingRequest, send: Send, stop_reason: StopReason,
                decode: Decode | None = None) -> Outcome:
    """`start_request`, waited for."""
    return start_request(pipeline, request, send, stop_reason, decode).result()
