"""Two decoding modes on the same engines, in one process, timed fairly: `generate.py --compare`.

A process's first generation pays for its engines' first forwards (ONNX Runtime plans
and allocates for each new shape; SSD's first drafting round also feeds the draft the
whole prompt), so two processes, one per mode, each timing its first answer, compare
those one-off costs more than the modes: on a 2-core machine an 8-token chat answer on
SmolLM2 measured SSD at 0.86x autoregressive that way, with the load policy drafting in
one round of eight. Here each mode first runs once untimed, then the modes take turns
`repeats` times, and each mode's speed is its tokens over its seconds summed over its
runs (a shared machine moves one run's figure by a tenth).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.decoding.requests import Generation, Request

MakeRequests = Callable[[DecodeOptions], list[Request]]


@dataclass
class ModeRuns:
    """One mode's timed runs: tokens and seconds summed, and the first run's output ids."""

    mode: str
    tokens: int = 0
    seconds: float = 0.0
    output_ids: list[list[int]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, generations: list[Generation], seconds: float) -> None:
        self.tokens += sum(len(g.output_ids) for g in generations)
        self.seconds += seconds
        if self.output_ids is None:
            self.output_ids = [g.output_ids for g in generations]


@dataclass
class Comparison:
    first: ModeRuns
    second: ModeRuns
    repeats: int
    greedy: bool

    @property
    def ratio(self) -> float:
        return self.first.tokens_per_s / self.second.tokens_per_s if self.second.tokens_per_s else 0.0

    @property
    def same_tokens(self) -> bool | None:
        """Greedy runs of both modes gave the same tokens (lossless decoding); None when sampled."""
        return self.first.output_ids == self.second.output_ids if self.greedy else None

    def as_dict(self) -> dict:
        return {"repeats": self.repeats, "same_tokens": self.same_tokens, "ratio": round(self.ratio, 4),
                "tokens_per_s": {runs.mode: round(runs.tokens_per_s, 2) for runs in (self.first, self.second)}}

    def summary(self) -> str:
        same = {None: "", True: "; the same tokens", False: "; DIFFERENT tokens"}[self.same_tokens]
        return (f"[compare] {self.first.mode} {self.first.tokens_per_s:.1f} tok/s, {self.second.mode} "
                f"{self.second.tokens_per_s:.1f} tok/s: {self.first.mode} / {self.second.mode} {self.ratio:.2f}x "
                f"({self.repeats} runs each, taking turns, after one untimed run of each){same}")


def compare_modes(generate: Callable[[list[Request]], list[Generation]], make_requests: MakeRequests,
                  first: DecodeOptions, second: DecodeOptions, repeats: int, greedy: bool) -> Comparison:
    """Each mode once untimed, then `repeats` timed runs of each, the order turned each time."""
    runs = {options.mode: ModeRuns(options.mode) for options in (first, second)}
    for options in (first, second):
        generate(make_requests(options))
    for repeat in range(repeats):
        for options in (first, second) if repeat % 2 == 0 else (second, first):
            requests = make_requests(options)
            started = time.perf_counter()
            generations = generate(requests)
            runs[options.mode].add(generations, time.perf_counter() - started)
    return Comparison(runs[first.mode], runs[second.mode], repeats, greedy)
