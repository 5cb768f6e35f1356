"""The decoding loops: autoregressive, and speculative with optional pre-speculation (SSD).

`speculative_decode` is the whole algorithm (DESIGN.md section 1). The draft runs in a
worker thread of its own; while the target verifies a round's draft, the worker
pre-speculates the round's likely outcomes. On a hit the next draft is ready; on a miss
it is drafted the ordinary way. Without pre-speculation this is plain speculative
decoding, and with K = 0 it is autoregressive decoding.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from saguaro.plugins.probs import logits_to_probs, sample_from
from saguaro.runtime.budget import bonus_rank
from saguaro.runtime.contracts import draft_cache_capacity
from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.sampling import BONUS_STREAM, SamplingParams, keyed_uniforms
from saguaro.runtime.speculator import Speculator
from saguaro.runtime.stats import GenerationStats
from saguaro.runtime.verifier import Verifier

OnTokens = Callable[[list[int]], None]
StopIds = frozenset[int] | tuple[int, ...]  # end-of-generation tokens; empty: never stop early
Cancelled = Callable[[], bool]


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "eos", "length" (max_tokens), "context" (cache full), "cancelled"
    stats: GenerationStats


@dataclass
class Elapsed:
    seconds: float = 0.0


@contextmanager
def timed(stats: GenerationStats, field: str):
    """Time a block, add it to `stats.<field>`, and hand the block's own time back."""
    elapsed, started = Elapsed(), time.perf_counter()
    try:
        yield elapsed
    finally:
        elapsed.seconds = time.perf_counter() - started
        setattr(stats, field, getattr(stats, field) + elapsed.seconds)


class Output:
    """Committed tokens, clipped to max_tokens, the context, and the first end-of-generation
    token (any of `stop_ids`)."""

    def __init__(self, prompt_ids, options: DecodeOptions, stop_ids: StopIds, max_context: int,
                 on_tokens: OnTokens | None):
        self.ids, self.new = list(prompt_ids), []
        self.max_tokens, self.max_context = options.max_tokens, max_context
        self.stop_ids, self.on_tokens = frozenset(stop_ids), on_tokens
        self.finish_reason = None

    @property
    def room(self) -> int:
        return min(self.max_tokens - len(self.new), self.max_context - len(self.ids))

    def commit(self, tokens: list[int]) -> None:
        tokens = tokens[:self.room]
        stop = next((i for i, token in enumerate(tokens) if token in self.stop_ids), None)
        if stop is not None:
            tokens = tokens[:stop + 1]
            self.finish_reason = "eos"
        self.ids += tokens
        self.new += tokens
        if self.on_tokens and tokens:
            self.on_tokens(tokens)
        if self.finish_reason is None and self.room <= 0:
            self.finish_reason = "length" if len(self.new) >= self.max_tokens else "context"


def speculative_decode(target, draft, prompt_ids, options: DecodeOptions, sampling: SamplingParams,
                       stop_ids: StopIds = (), on_tokens: OnTokens | None = None,
                       cancelled: Cancelled = lambda: False) -> Generation:
    k, policy = options.draft_tokens, options.fanout_policy(draft.info.max_branches)
    stats = GenerationStats(options.mode, k)
    started = time.perf_counter()
    with timed(stats, "prefill_s"):
        verifier = Verifier(target, prompt_ids, sampling)
    branches = policy.max_branches if options.prespeculating else 0
    capacity = draft_cache_capacity(target.info.max_context, branches, k)
    speculator = Speculator(draft, k, sampling, options.saguaro(sampling), capacity)
    out = Output(prompt_ids, options, stop_ids, target.info.max_context, on_tokens)

    def prespeculate(ids, proposal):
        """Runs in the worker, so even choosing the fan-out stays off the critical path."""
        with timed(stats, "prespeculate_s") as elapsed:
            speculation = speculator.prespeculate(ids, proposal, policy.fanout())
        speculation.seconds = elapsed.seconds
        return speculation

    with ThreadPoolExecutor(1, thread_name_prefix="draft") as worker:
        with timed(stats, "draft_s"):
            proposal = worker.submit(speculator.draft, tuple(out.ids)).result()
        while out.finish_reason is None and not cancelled():
            ids = tuple(out.ids)
            pending = worker.submit(prespeculate, ids, proposal) if options.prespeculating else None
            with timed(stats, "verify_s") as verifying:
                outcome = verifier.verify(ids, proposal, min(k, out.room - 1))
            with timed(stats, "wait_s"):
                speculation = pending.result() if pending else None
            stats.record_round(outcome.accepted)
            out.commit(proposal.tokens[:outcome.accepted].tolist() + [outcome.bonus])
            if out.finish_reason is not None:
                break
            hit = speculation.lookup(outcome.accepted, outcome.bonus) if speculation else None
            if speculation:
                stats.branches_drafted += len(speculation.drafts)
                policy.observe(outcome.accepted, bonus_rank(speculation.scores, proposal.tokens,
                                                            outcome.accepted, outcome.bonus))
                policy.observe_timing(verifying.seconds, speculation.seconds)
            if hit is not None:
                stats.cache_hits += 1
                proposal = worker.submit(speculator.adopt, tuple(out.ids), speculation, hit).result()
            else:
                stats.cache_misses += speculation is not None
                with timed(stats, "draft_s"):
                    proposal = worker.submit(speculator.draft, tuple(out.ids)).result()
    return finish(out, stats, started)


def autoregressive_decode(target, prompt_ids, options: DecodeOptions, sampling: SamplingParams,
                          stop_ids: StopIds = (), on_tokens: OnTokens | None = None,
                          cancelled: Cancelled = lambda: False) -> Generation:
    """One target forward per token: the baseline every other mode must reproduce."""
    stats = GenerationStats("autoregressive", 0)
    started = time.perf_counter()
    cache = target.new_cache(target.info.max_context)
    out = Output(prompt_ids, options, stop_ids, target.info.max_context, on_tokens)
    with timed(stats, "prefill_s"):
        logits = target.forward(cache, torch.tensor(prompt_ids), torch.arange(len(prompt_ids)))[-1]
    while not cancelled():
        uniform = keyed_uniforms(sampling.seed, BONUS_STREAM, [len(out.ids)])
        token = int(torch.argmax(logits) if sampling.greedy else sample_from(
            logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p), uniform[0]))
        stats.record_round(0)
        out.commit([token])
        if out.finish_reason is not None:
            break
        with timed(stats, "verify_s"):
            logits = target.forward(cache, torch.tensor([token]), torch.tensor([len(out.ids) - 1]))[-1]
    return finish(out, stats, started)


def finish(out: Output, stats: GenerationStats, started: float) -> Generation:
    stats.tokens = len(out.new)
    stats.total_s = time.perf_counter() - started
    return Generation(out.ids[:len(out.ids) - len(out.new)], out.new,
                      out.finish_reason or "cancelled", stats)
