"""Transformers' own speculative decoding ("assisted generation": `generate(...,
assistant_model=draft)`), timed on the benchmark's prompts as a baseline row.

Greedy, up to `max_tokens` new tokens per prompt, ending at the model's end of generation
(or, `exactly`, `max_tokens` of them: `min_new_tokens` equal to `max_new_tokens`), as the
benchmark's own rows generate. Its prefill is timed apart, as a
one-token generation, so that tokens/s counts decoding only. It runs on every core (its
target and draft take turns, so nothing else wants them).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from saguaro.runtime.core.stats import stopwatch


@dataclass(frozen=True)
class Timing:
    tokens: int
    total_s: float
    prefill_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens / (self.total_s - self.prefill_s)


@contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_model(path: Path):
    from transformers import AutoModelForCausalLM  # only when a transformers row is asked for
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on generate()'s arguments, not ours to fix
    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def generate_timed(model, prompt: list[int], max_tokens: int, exactly: bool, **extra) -> tuple[float, int]:
    """Seconds and new tokens of one greedy generation."""
    ids = torch.tensor([prompt])
    least = dict(min_new_tokens=max_tokens) if exactly else {}
    with torch.inference_mode(), stopwatch() as elapsed:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             pad_token_id=model.config.eos_token_id, **least, **extra)
    return elapsed.seconds, out.shape[1] - len(prompt)


def transformers_timings(target_dir: Path, draft_dir: Path, prompts: list[list[int]],
                         max_tokens: int, exactly: bool) -> dict[str, Timing]:
    """Greedy `generate` alone and with the draft as its assistant, on every prompt."""
    with torch_threads(cast(int, os.cpu_count())):  # None only where the count is unknown
        target, draft = load_model(target_dir), load_model(draft_dir)
        rows = {"transformers greedy": {}, "transformers assisted": {"assistant_model": draft}}
        timings = {}
        for name, extra in rows.items():
            generate_timed(target, prompts[0], max_tokens, exactly, **extra)  # warm-up
            runs = [generate_timed(target, p, max_tokens, exactly, **extra) for p in prompts]
            prefill = sum(generate_timed(target, p, 1, True)[0] for p in prompts)
            timings[name] = Timing(sum(tokens for _, tokens in runs), sum(seconds for seconds, _ in runs), prefill)
    return timings
