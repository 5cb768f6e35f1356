"""Reading a running server's Prometheus metrics endpoint (Triton's, with the `ssd`
model's custom metrics among them)."""
from __future__ import annotations

import re
import time
import urllib.request


def scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def settled_scrape(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1") -> str:
    """The metrics once no request is in flight (or as they are after `timeout_s`): the
    `ssd` model counts a request's figures after its final response, from its outbox, so
    a scrape right after the last client heard its answer could miss them (and credit them
    to whatever is measured next)."""
    deadline = time.monotonic() + timeout_s
    text = scrape(port, host)
    while metric(text, "ssd_requests_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
        text = scrape(port, host)
    return text


def metric(text: str, name: str, **labels) -> float:
    """The value of the first sample of `name` whose labels include `labels` (0 if none)."""
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            return float(match.group(2))
    return 0.0


def growth_ratio(before: str, after: str, numerator: str, denominator: str, **labels) -> float:
    """How much `numerator` (its sample with `labels`) grew between two scrapes over how
    much `denominator` did (0 if it did not): e.g. K per round from the verified-drafts and
    rounds counters."""
    grown = metric(after, denominator) - metric(before, denominator)
    return (metric(after, numerator, **labels) - metric(before, numerator, **labels)) / grown if grown else 0.0


def histogram_mean(before: str, after: str, name: str) -> float:
    """Mean of the observations a histogram took between two scrapes (0 if none)."""
    return growth_ratio(before, after, f"{name}_sum", f"{name}_count")
