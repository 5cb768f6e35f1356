"""A decoding request and what it produces, shared by every decoding loop (the SSD
`Decoder`, TensorRT-LLM's loop): the request, its committed output (clipped to its
tokens, its context and its first end token, each token told to the caller as committed)
and the finished generation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.core.stats import GenerationStats

OnTokens = Callable[[list[int]], None]
Cancelled = Callable[[], bool]
OnStart = Callable[[GenerationStats], None]


@dataclass
class Request:
    prompt_ids: list[int]
    options: DecodeOptions
    sampling: SamplingParams            # seeded (`SamplingParams.with_seed`)
    eos_token_ids: frozenset[int] = frozenset()
    on_tokens: OnTokens | None = None
    cancelled: Cancelled = lambda: False
    # Given a list, each committed token's log-probability under the target is appended
    # to it (before `on_tokens` hears of the token); see `saguaro.runtime.core.logprobs`.
    logprobs: list[float] | None = None
    # Told once, when the request joins a batch, of the stats its rounds will update.
    on_start: OnStart | None = None


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "eos", "length" (max_tokens), "context" (cache full), "cancelled"
    stats: GenerationStats
    seed: int | None = None  # the sampling seed, so a sampled generation can be replayed


class Output:
    """Committed tokens, clipped to max_tokens, the context, and the first end token."""

    new: list[int]
    finish_reason: str | None

    def __init__(self, request: Request, max_context: int):
        self.ids, self.new = list(request.prompt_ids), []
        self.max_tokens, self.max_context = request.options.max_tokens, max_context
        self.eos, self.on_tokens = request.eos_token_ids, request.on_tokens
        self.logprobs = request.logprobs
        self.finish_reason = None

    @property
    def room(self) -> int:
        return min(self.max_tokens - len(self.new), self.max_context - len(self.ids))

    def commit(self, tokens: list[int], logprobs: tuple[float, ...] | None = None) -> None:
        tokens = tokens[:self.room]
        ends = [i for i, token in enumerate(tokens) if token in self.eos]
        if ends:
            tokens = tokens[:ends[0] + 1]
            self.finish_reason = "eos"
        if self.logprobs is not None:
            self.logprobs += list(logprobs or ())[:len(tokens)]
        self.ids += tokens
        self.new += tokens
        if self.on_tokens and tokens:
            self.on_tokens(tokens)
        if self.finish_reason is None and self.room <= 0:
            self.finish_reason = "length" if len(self.new) >= self.max_tokens else "context"


def finish(out: Output, stats: GenerationStats, started: float, seed: int | None) -> Generation:
    stats.tokens, stats.total_s = len(out.new), time.perf_counter() - started
    return Generation(out.ids[:len(out.ids) - len(out.new)], out.new, out.finish_reason or "cancelled", stats, seed)
