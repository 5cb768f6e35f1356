"""The SSD figures of one Dynamo worker as Prometheus metrics, served by Dynamo itself.

The same families as the Triton `ssd` model's custom metrics (`metric_families`:
`ssd_generated_tokens_total`, `ssd_cache_hits_total`, ...), so one dashboard reads either server. The acceptance rate
and K per round are ratios of counters: `rate(ssd_accepted_draft_tokens_total) /
rate(ssd_verified_draft_tokens_total)`, `rate(ssd_verified_draft_tokens_total) /
rate(ssd_rounds_total)`. They live
in a `prometheus_client` registry of their own; the worker hands its exposition text to
Dynamo's runtime (`endpoint.metrics.register_prometheus_expfmt_callback`), which appends
it to the worker's `/metrics` next to Dynamo's `dynamo_component_*` families.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from saguaro.runtime.control.round_report import UNDRAFTED_REASONS
from saguaro.serving.metric_families import (
    ALONE_ROUNDS_HELP,
    BATCH_SIZE_BUCKETS,
    BATCH_SIZE_HELP,
    GENERATION_COUNTERS,
    IN_FLIGHT_HELP,
    QUEUED_HELP,
    REQUESTS_HELP,
    TOKENS_PER_S_BUCKETS,
    TOKENS_PER_S_HELP,
    UNDRAFTED_HELP,
    generation_figures,
)


class WorkerMetrics:
    """Updated from the scheduler's thread and the event loop alike: one lock."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        labels = ["model"]
        self.counters = {name: Counter(f"ssd_{name}", help_text, labels, registry=self.registry).labels(model)
                         for name, help_text in GENERATION_COUNTERS.items()}
        self.requests = Counter("ssd_requests", REQUESTS_HELP, labels + ["finish_reason"], registry=self.registry)
        self.in_flight = Gauge("ssd_requests_in_flight", IN_FLIGHT_HELP, labels, registry=self.registry).labels(model)
        self.queued = Gauge("ssd_requests_queued", QUEUED_HELP, labels, registry=self.registry).labels(model)
        self.tokens_per_s = Histogram("ssd_request_tokens_per_second", TOKENS_PER_S_HELP, labels,
                                      buckets=TOKENS_PER_S_BUCKETS, registry=self.registry).labels(model)
        self.batch_size = Histogram("ssd_batch_size", BATCH_SIZE_HELP, labels,
                                    buckets=BATCH_SIZE_BUCKETS, registry=self.registry).labels(model)
        undrafted = Counter("ssd_undrafted_rounds", UNDRAFTED_HELP, labels + ["reason"], registry=self.registry)
        self.undrafted = {reason: undrafted.labels(model, reason) for reason in UNDRAFTED_REASONS}
        self.alone_rounds = Counter("ssd_target_alone_rounds", ALONE_ROUNDS_HELP, labels,
                                    registry=self.registry).labels(model)
        self.model = model
        self.lock = threading.Lock()

    def started(self) -> None:
        with self.lock:
            self.in_flight.inc()

    def observe_round(self, batch, report, queued: int) -> None:
        """The scheduler's round observer: the requests in the round, why it drafted nothing
        (if it did not), whether the target verified it alone, the queue."""
        with self.lock:
            self.batch_size.observe(len(batch))
            if report.undrafted:
                self.undrafted[report.undrafted].inc()
            if report.alone:
                self.alone_rounds.inc()
            self.queued.set(queued)

    def finished(self, finish_reason: str, output_tokens: int, stats: dict) -> None:
        with self.lock:
            for name, value in generation_figures(output_tokens, stats).items():
                self.counters[name].inc(value)
            if output_tokens:
                self.tokens_per_s.observe(stats["tokens_per_s"])
            self.requests.labels(self.model, finish_reason).inc()
            self.in_flight.dec()

    def failed(self) -> None:
        """A generation that ended in an error (counted under finish reason "failed")."""
        with self.lock:
            self.requests.labels(self.model, "failed").inc()
            self.in_flight.dec()

    def refused(self, why: str) -> None:
        """A request refused before it started ("rejected", "refused_shutting_down", ...)."""
        with self.lock:
            self.requests.labels(self.model, why).inc()

    def exposition(self) -> str:
        """Prometheus text format, for Dynamo's `/metrics`."""
        with self.lock:
            return generate_latest(self.registry).decode()
