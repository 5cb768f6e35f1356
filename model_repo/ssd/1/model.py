"""Triton `ssd`: speculative speculative decoding, streamed as rounds complete.

Decoupled: `execute` validates each request, hands it to the pipeline's scheduler and
returns at once. One scheduler thread decodes every active request together, one round
at a time (`saguaro.runtime.decoding.scheduler`): each round verifies all of them in one batched
target forward while the draft pre-speculates for all of them; requests join and leave
between rounds, and those beyond the KV slots wait in order. Each request's responses go
out as its rounds complete (`saguaro.serving.responses.start_request`: the tokens since the
last response when streaming, a heartbeat otherwise) and a final response carries its
stats. Why a generation must stop is asked once per round; the SSD figures also go to
Triton's metrics endpoint as custom metrics (queueing and batch sizes among them).

Cancellation through the ensemble needs a relay: Triton cancels only the ensemble steps
it schedules after the client cancels, never one in flight, so this model's request never
looks cancelled. Each response therefore carries its generation's id; the postprocessing
step, which Triton does cancel, sends that id back here (`cancel_generation_id`, a BLS
request) and the generation stops at its next round.

Shutdown: a drain request from the launcher (`control` = "drain", see
saguaro/serving/lifecycle.py) makes this model refuse new generations, wait for the running
ones until the deadline, stop the rest (finish reason "shutdown") and answer with a report.
"""
import collections
import itertools
import json
import os
import queue
import threading
from dataclasses import replace

import numpy as np

import triton_python_backend_utils as pb_utils

from saguaro.runtime.control.round_report import UNDRAFTED_REASONS
from saguaro.runtime.core.options import DRAFT_METHODS
from saguaro.runtime.pipeline import Pipeline, freeze_loaded_heap
from saguaro.serving import lifecycle
from saguaro.serving import metric_families
from saguaro.serving import requests as serving
from saguaro.serving.responses import Timing, Urgent, start_request
from saguaro.serving.settings import DEFAULT_MAX_QUEUE, DEFAULT_STREAM_INTERVAL, parse_stream_interval, rounds_per_response

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def load_pipeline(parameters: dict):
    scheduling = dict(batching=parameters.get("batching") or "iteration",
                      max_concurrency=int(parameters.get("max_concurrency") or 0) or None)
    draft_method = parameters.get("draft_method") or DRAFT_METHODS[0]
    if parameters.get("engines_dir"):
        return Pipeline.load(engines=parameters["engines_dir"], draft_method=draft_method, **scheduling)
    return Pipeline.load(target=parameters["target_dir"], draft=parameters.get("draft_dir") or None,
                         draft_method=draft_method, **scheduling)


def send_error(sender, message: str, code) -> None:
    error = pb_utils.TritonError(message, code)
    try:
        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
    except Exception as failure:  # noqa: BLE001 - e.g. the final response already went out
        pb_utils.Logger.log_error(f"could not report '{message}': {failure}")


class Outbox:
    """One thread that sends every response. The scheduler hands each round's responses
    over (every stream interval, `responses.ResponseStream`) and goes on with the next
    round: building Triton tensors and passing them to the server process (shared memory
    and a message per response, 0.5-0.7 ms each on two busy cores) then overlaps the
    engines' next forward, which runs without the GIL, instead of adding to every round.

    Urgent work (`responses.Urgent`: first tokens, final responses, errors) runs before
    routine work (later updates, metrics), each kind in the order posted; routine work
    posted after urgent work runs after it. So a request's final response, and the work
    posted after it (ending it in the registry and the metrics), go out in that order,
    and a drain never outruns them."""

    URGENT, ROUTINE, CLOSE = 0, 1, 2

    def __init__(self):
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()  # ties: the order posted
        self.thread = threading.Thread(target=self.run, name="ssd-outbox", daemon=True)
        self.thread.start()

    def post(self, work) -> None:
        self.queue.put((self.URGENT if isinstance(work, Urgent) else self.ROUTINE, next(self.order), work))

    def run(self) -> None:
        while (work := self.queue.get()[2]) is not None:
            try:
                work()
            except Exception as failure:  # noqa: BLE001 - one failed send must not stop the rest
                pb_utils.Logger.log_error(f"sending a response failed: {type(failure).__name__}: {failure}")
            # not kept while waiting for the next: through its closure the last work can hold
            # a request's response sender, and Triton does not unload a model (at shutdown)
            # until every sender is released
            del work

    def close(self) -> None:
        self.queue.put((self.CLOSE, next(self.order), None))  # after everything posted
        self.thread.join()


class Replies:
    """One Triton request's response sender, shared by the prompts of a batched request:
    only the last prompt's final response closes it (FINAL). Each response carries only
    the outputs the request asked for (an ensemble step asks for those it maps; a direct
    client for its own), so a direct client pays for no tensor it does not read. A
    non-decoupled model answers each request exactly once: everything but the final
    response is left out."""

    def __init__(self, request, sender, items: int, decoupled: bool, outbox: Outbox, watch: lifecycle.CancelWatch):
        self.sender, self.outbox, self.watch = sender, outbox, watch
        self.wanted = set(request.requested_output_names())
        self.open, self.decoupled, self.lock = items, decoupled, threading.Lock()

    def send(self, arrays: dict, final: bool) -> None:
        """In the outbox's thread (`start_request` posts every send there)."""
        if not (final or self.decoupled):
            return
        with self.lock:
            closing = final and self.open == 1
            self.open -= final
            tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()
                       if not self.wanted or name in self.wanted]
            if closing:
                self.watch.forget(self)
            self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if closing else 0)

    def error(self, message: str, code) -> None:
        """One prompt's error; the request closes with it if no other prompt is open."""
        self.outbox.post(Urgent(lambda: self.error_now(message, code)))

    def error_now(self, message: str, code) -> None:
        with self.lock:
            closing = self.open <= 1
            self.open -= 1
            if closing:
                self.watch.forget(self)
            try:
                self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                                 flags=FINAL if closing else 0)
            except Exception as failure:  # noqa: BLE001 - e.g. the final response already went out
                pb_utils.Logger.log_error(f"could not report '{message}': {failure}")


class SsdMetrics:
    """Custom metrics next to Triton's own: counters summed over requests (K per round is
    `ssd_verified_draft_tokens_total / ssd_rounds_total`), a gauge of generations in
    flight, and histograms of per-request throughput and of the requests in each round.

    Every update is a message to the server process (0.2-0.4 ms on busy cores): updates
    are gathered here and sent by one flush in the outbox's thread (`post`), at most one
    waiting there at a time, so that no round or request waits for them and a busy outbox
    sends one increment per counter for many requests (a finished request's figures had
    been 9 messages, 3 ms, each). Sending from that one thread also keeps two metric
    messages from ever being in flight at once: two threads updating one metric at once
    crashed the server (a segfault in the backend's ProcessMetricRequest)."""

    def __init__(self, model: str, version: str, post):
        self.labels = {"model": model, "version": version}
        self.post = post
        self.families = []  # a family must outlive its metrics: keep every one referenced
        self.counters = {name: self.counter(f"ssd_{name}_total", help_text)
                         for name, help_text in metric_families.GENERATION_COUNTERS.items()}
        self.requests = self.family("ssd_requests_total", metric_families.REQUESTS_HELP, pb_utils.MetricFamily.COUNTER)
        self.by_reason = {}
        self.in_flight = self.gauge("ssd_requests_in_flight", metric_families.IN_FLIGHT_HELP)
        self.tokens_per_s = self.histogram("ssd_request_tokens_per_second", metric_families.TOKENS_PER_S_HELP,
                                           metric_families.TOKENS_PER_S_BUCKETS)
        self.queued = self.gauge("ssd_requests_queued", metric_families.QUEUED_HELP)
        self.batch_size = self.histogram("ssd_batch_size", metric_families.BATCH_SIZE_HELP,
                                         metric_families.BATCH_SIZE_BUCKETS)
        undrafted = self.family("ssd_undrafted_rounds_total", metric_families.UNDRAFTED_HELP,
                                pb_utils.MetricFamily.COUNTER)
        self.undrafted = {reason: undrafted.Metric(labels={**self.labels, "reason": reason})
                          for reason in UNDRAFTED_REASONS}
        self.alone_rounds = self.counter("ssd_target_alone_rounds_total", metric_families.ALONE_ROUNDS_HELP)
        self.lock = threading.Lock()
        # gathered, not sent yet: increments by metric, histogram observations, the queue's size
        self.increments: collections.Counter = collections.Counter()
        self.observations: list[tuple] = []
        self.queued_now, self.queued_sent = 0, None
        self.flush_posted = False

    def family(self, name: str, description: str, kind):
        self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
        return self.families[-1]

    def counter(self, name: str, description: str):
        return self.family(name, description, pb_utils.MetricFamily.COUNTER).Metric(labels=self.labels)

    def gauge(self, name: str, description: str):
        return self.family(name, description, pb_utils.MetricFamily.GAUGE).Metric(labels=self.labels)

    def histogram(self, name: str, description: str, buckets):
        return self.family(name, description, pb_utils.MetricFamily.HISTOGRAM
                           ).Metric(labels=self.labels, buckets=list(buckets))

    def change_in_flight(self, delta: int) -> None:
        self.gather({self.in_flight: delta})

    def observe_round(self, batch_size: int, queued: int, undrafted: str | None, alone: bool) -> None:
        """A round of `batch_size` requests; `undrafted`: why it drafted nothing (None: it
        drafted); `alone`: the target verified it alone (`RoundReport.alone`)."""
        counted = {self.undrafted[undrafted]: 1} if undrafted else {}
        if alone:
            counted[self.alone_rounds] = 1
        self.gather(counted, [(self.batch_size, batch_size)], queued)

    def count_request(self, finish_reason: str) -> None:
        self.gather({self.finish_reason(finish_reason): 1})

    def finish_reason(self, reason: str):
        if reason not in self.by_reason:
            self.by_reason[reason] = self.requests.Metric(labels={**self.labels, "finish_reason": reason})
        return self.by_reason[reason]

    def record(self, outcome) -> None:
        """A finished request's figures."""
        stats = outcome.stats
        figures = metric_families.generation_figures(len(outcome.output_ids), stats)
        increments = {self.counters[name]: value for name, value in figures.items()}
        increments[self.finish_reason(outcome.finish_reason)] = 1
        observed = [(self.tokens_per_s, stats["tokens_per_s"])] if outcome.output_ids else []
        self.gather(increments, observed)

    def gather(self, increments: dict, observations: list[tuple] = (), queued: int | None = None) -> None:
        """From any thread; sent by the next flush."""
        with self.lock:
            self.increments.update(increments)
            self.observations += observations
            if queued is not None:
                self.queued_now = queued
            if self.flush_posted:
                return
            self.flush_posted = True
        self.post(self.flush)

    def flush(self) -> None:
        """In the outbox's thread: everything gathered since the last flush, one message per
        metric that changed (each histogram observation is one)."""
        with self.lock:
            increments, self.increments = self.increments, collections.Counter()
            observations, self.observations = self.observations, []
            queued, self.flush_posted = self.queued_now, False
        for metric, value in observations:
            metric.observe(value)
        in_flight = increments.pop(self.in_flight, 0)
        for metric, value in increments.items():
            if value:  # most draft counters stay 0 without drafts
                metric.increment(value)
        if in_flight:  # last: a scrape that sees a request leave sees its figures
            self.in_flight.increment(in_flight)
        if queued != self.queued_sent:
            self.queued.set(queued)
            self.queued_sent = queued


class TritonPythonModel:
    def initialize(self, args):
        parameters = serving.model_parameters(args)
        self.pipeline = load_pipeline(parameters)
        self.defaults = serving.defaults_from_parameters(parameters)
        info = self.pipeline.target.info
        self.limits = serving.ModelLimits(self.pipeline.max_context, info.vocab_size, info.eos_token_id)
        self.max_queue = int(parameters.get("max_queue") or DEFAULT_MAX_QUEUE)
        self.stream_interval = parse_stream_interval(parameters.get("stream_interval") or DEFAULT_STREAM_INTERVAL)
        self.batch = 1  # requests in the last round: how often a stream's tokens are sent
        self.generations = lifecycle.Generations()
        self.outbox = Outbox()
        self.metrics = SsdMetrics(args["model_name"], args["model_version"], self.outbox.post)
        self.cancel_watch = lifecycle.CancelWatch()
        self.pipeline.observe_rounds(self.observe_round)
        self.control_token = os.environ.get(lifecycle.CONTROL_TOKEN_ENV)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        # for requests sent as text_input
        self.codec = serving.TextCodec(parameters["tokenizer_dir"]) if parameters.get("tokenizer_dir") else None
        freeze_loaded_heap()  # the model serves until the server stops

    def observe_round(self, batch, report) -> None:
        """In the scheduler's thread, after each round: the metrics go out from the outbox's."""
        self.batch = len(batch)
        self.metrics.observe_round(self.batch, self.pipeline.queued, report.undrafted, report.alone)

    def rounds_per_response(self) -> int:
        return rounds_per_response(self.stream_interval, self.batch)

    def execute(self, requests):
        for request in requests:
            self.accept(request)
        return None  # decoupled: every response goes through the request's sender

    def accept(self, request) -> None:
        sender = request.get_response_sender()
        get = serving.input_getter(pb_utils.get_input_tensor_by_name, request)
        if get("cancel_generation_id") is not None:  # the relay from postprocessing, not a generation
            self.generations.cancel(int(get("cancel_generation_id").reshape(-1)[0]))
            sender.send(flags=FINAL)
            return
        if get("control") is not None:
            self.control(get, sender)
            return
        arrival = Timing()
        try:
            items = self.parse(get)
            lives = [self.generations.start() for _ in items]
        except ValueError as error:  # RequestError, or a value the options reject
            self.metrics.count_request("rejected")
            send_error(sender, str(error), pb_utils.TritonError.INVALID_ARG)
            return
        except lifecycle.ServerDraining as error:
            self.metrics.count_request("refused_shutting_down")
            send_error(sender, str(error), pb_utils.TritonError.UNAVAILABLE)
            return
        if self.pipeline.queued + len(items) > self.max_queue:
            for live in lives:
                self.generations.end(live.generation_id)
            self.metrics.count_request("refused_queue_full")
            send_error(sender, f"the server has {self.max_queue} requests waiting "
                       "already; try again later", pb_utils.TritonError.UNAVAILABLE)
            return
        replies = Replies(request, sender, len(items), self.decoupled, self.outbox, self.cancel_watch)
        self.cancel_watch.watch(replies, request, lives)  # a direct request's cancellation
        for parsed, live in zip(items, lives):
            self.metrics.change_in_flight(1)
            self.generate(replies, parsed, live, replace(arrival))

    def parse(self, get) -> list:
        """Every prompt of the request, checked before any starts (RequestError names the input)."""
        items = serving.parse_batch(get, self.defaults, self.limits, self.codec.encode if self.codec else None)
        if not self.decoupled and any(item.stream for item in items):
            raise serving.RequestError("input 'stream' true needs the decoupled model (decoupled_mode true): "
                                       "this server answers each request once")
        if not self.decoupled and len(items) > 1:
            raise serving.RequestError(f"a request of {len(items)} prompts needs the decoupled model (decoupled_mode "
                                       "true): this server answers each request once, so send them one by one")
        for item in items:
            self.pipeline.check_request(item.prompt_ids, item.options, serving.INPUT_NAMES)
        return items

    def generate(self, replies, parsed, live, timing) -> None:
        """Queue one prompt with the scheduler; every path ends it with a final response."""
        id_array = np.array([[live.generation_id]], dtype=np.uint64)
        try:
            outcome = start_request(
                self.pipeline, parsed,
                lambda arrays, final: replies.send({**arrays, "generation_id": id_array}, final),
                stop_reason=lambda: live.reason,
                decode=self.codec.decode if parsed.text else None, timing=timing, post=self.outbox.post,
                interval=self.rounds_per_response)
        except Exception as error:  # noqa: BLE001 - refused before it was queued
            self.failed(replies, live, error)
            return
        outcome.add_done_callback(lambda done: self.ended(replies, live, done))

    def ended(self, replies, live, done) -> None:
        """In the scheduler's thread, once the final response was handed to the outbox (or
        failed); the request ends after that response is sent."""
        error = done.exception()
        if error is not None:
            self.failed(replies, live, error)
            return
        self.outbox.post(lambda: self.forget(live, done.result()))

    def failed(self, replies, live, error: BaseException) -> None:
        replies.error(f"generation failed: {type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)
        self.outbox.post(lambda: self.forget(live, None))

    def forget(self, live, outcome) -> None:
        """The request is over: its figures (None: it failed) and its registration."""
        if outcome is None:
            self.metrics.count_request("failed")
        else:
            self.metrics.record(outcome)
        self.generations.end(live.generation_id)
        self.metrics.change_in_flight(-1)

    def control(self, get, sender) -> None:
        """A drain request: answered from its own thread once the drain is over, so that
        `execute` keeps taking the cancellation relays meanwhile."""
        try:
            drain = lifecycle.parse_drain_request(get, self.control_token)
        except ValueError as error:
            send_error(sender, str(error), pb_utils.TritonError.INVALID_ARG)
            return
        self.generations.refuse_new()  # at once: a request right after this one is refused
        threading.Thread(target=self.drain_and_report, args=(sender, drain.timeout_s),
                         name="ssd-drain", daemon=True).start()

    def drain_and_report(self, sender, timeout_s: float) -> None:
        report = self.generations.drain(timeout_s)
        pb_utils.Logger.log_info(f"drained for shutdown: {report.to_json()}")
        output = np.array([[report.to_json().encode()]], dtype=object)
        sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("drain_report", output)]),
                    flags=FINAL)

    def finalize(self):
        # Unloading (the server stops): running generations stop at their next round,
        # queued ones start, see their reason and end at once, so every request still
        # gets its final response.
        self.generations.stop_all(lifecycle.SHUTDOWN)
        self.pipeline.close()
        self.outbox.close()  # every response handed over is sent
        self.cancel_watch.close()
