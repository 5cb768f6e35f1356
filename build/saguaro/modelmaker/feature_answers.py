"""The target's answers a feature head is trained on: many greedy sequences per forward.

    prompts (token ids) -> one prefill forward per batch of rows, then one token per row
    per `Llama.forward_packed` step over a batch of cache rows (rows that stop leave the
    batch) -> per answer: the tokens, the target's joined features at the head's layers
    for every position fed, its last layer's output there (what the head's own `hidden_out`
    is regressed on), and its top tokens' log-probabilities (soft labels) for every
    continuation token.

Run in the model's own dtype: bfloat16 where the CPU has fast bf16 kernels
(`fast_bfloat16`), float32 for the held-out answers whose agreement is reported.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.runtime.models.llama import Llama


@dataclass
class Answer:
    """A prompt and the target's greedy continuation (ending at a stop token if reached),
    the target's joined features and last hidden states of positions 0..len - 2 (the last
    token is never fed), and its top tokens and log-probabilities for each continuation
    token."""

    ids: list[int]
    start: int                   # index of the first continuation token
    features: torch.Tensor       # [len(ids) - 1, feature_width]
    finals: torch.Tensor         # [len(ids) - 1, hidden]: the last layer's output, before the final norm
    top_ids: torch.Tensor        # [len(ids) - start, soft_top]
    top_logprobs: torch.Tensor   # [len(ids) - start, soft_top]

    @property
    def continuation(self) -> list[int]:
        return self.ids[self.start:]


def fast_bfloat16() -> bool:
    """bf16 matrix kernels beat fp32 on CPUs with AVX512-BF16 or AMX (oneDNN uses them)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return torch.backends.mkldnn.is_available() and ("avx512_bf16" in flags or "amx_bf16" in flags)


# Whether another batch of answers is worth starting: given the answers it would bring the
# total to and when it would end at the pace so far (`time.monotonic()`).
Room = Callable[[int, float], bool]


@torch.no_grad()
def collect_answers(model: Llama, prompts: list[list[int]], new_tokens: int, batch: int, stop_ids: tuple[int, ...],
                    soft_top: int, feature_layers: tuple[int, ...], progress: bool = False,
                    room: Room | None = None) -> list[Answer]:
    """Greedy answers to `prompts` (token ids) in batches of `batch` sequences, in the
    model's own dtype; rows that have stopped leave the batch. `room`: asked before each
    batch but the first, whether it is worth starting; the first is always answered."""
    answers: list[Answer] = []
    started = time.monotonic()
    for first in range(0, len(prompts), batch):
        chunk = prompts[first:first + batch]
        if answers and room is not None:
            batch_seconds = (time.monotonic() - started) / (first // batch)
            if not room(len(answers) + len(chunk), time.monotonic() + batch_seconds):
                if progress:
                    print(f"  stopped at {len(answers)} answers: more would leave training too few steps", flush=True)
                break
        answers += answer_batch(model, chunk, new_tokens, stop_ids, soft_top, feature_layers)
        if progress:
            print(f"  target answered {len(answers)}/{len(prompts)} prompts", flush=True)
    return answers


def answer_batch(model: Llama, prompts: list[list[int]], new_tokens: int, stop_ids: tuple[int, ...],
                 soft_top: int, feature_layers: tuple[int, ...]) -> list[Answer]:
    rows, lengths = len(prompts), [len(p) for p in prompts]
    dtype = model.lm_head.weight.dtype
    layers, heads, dim = model.shape.kv_shape
    kv = torch.zeros(layers, 2, rows, heads, max(lengths) + new_tokens, dim, dtype=dtype)
    taken = (*feature_layers, model.shape.num_layers)  # the features, then the last layer's output
    last, features = prefill(model, kv, prompts, taken)
    records = [Record(list(p), [features[r, :len(p)]]) for r, p in enumerate(prompts)]
    alive = list(range(rows))
    for step in range(new_tokens):
        tokens = take_top(records, alive, last, soft_top)
        alive, keep = still_going(records, alive, tokens, stop_ids, step == new_tokens - 1)
        if not alive:
            break
        if len(keep) < kv.shape[2]:  # rows stopped: the batch shrinks (one copy of the cache)
            kv, tokens = kv[:, :, keep], tokens[keep]
        last, features = decode_step(model, kv, tokens, [len(records[r].ids) - 1 for r in alive], taken)
        for row, r in enumerate(alive):
            records[r].features.append(features[row:row + 1])
    return [record.answer(length, model.shape.hidden_size) for record, length in zip(records, lengths)]


@dataclass
class Record:
    ids: list[int]
    features: list[torch.Tensor]
    top_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)
    top_logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def answer(self, start: int, hidden: int) -> Answer:
        """Each recorded row holds the head's features, then the last layer's output (`hidden` wide)."""
        taken = torch.cat(self.features)[:len(self.ids) - 1]
        return Answer(self.ids, start, taken[:, :-hidden].clone(), taken[:, -hidden:].clone(),
                      torch.stack(self.top_ids), torch.stack(self.top_logprobs))


def prefill(model: Llama, kv: torch.Tensor, prompts: list[list[int]], feature_layers):
    """The prompts in one forward, their K/V copied into the cache rows; returns each
    row's next-token logits and the features of every prompt position. The concat form
    without logits: the lm_head over every prompt position would cost more than the rest."""
    rows, width = len(prompts), max(map(len, prompts))
    tokens = torch.zeros(rows, width, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        tokens[r, :len(prompt)] = torch.tensor(prompt)
    mask = (torch.arange(width) <= torch.arange(width).unsqueeze(1)).expand(rows, width, width)
    layers, heads, dim = model.shape.kv_shape
    empty = torch.zeros(layers, rows, heads, 0, dim, dtype=kv.dtype)
    h, keys, values, features = model.hidden_concat(tokens, torch.arange(width).expand(rows, width), mask, empty,
                                                    empty, feature_layers)
    kv[:, 0, :, :, :width], kv[:, 1, :, :, :width] = keys, values  # past a row's prompt: overwritten or unseen
    last = torch.stack([h[r, len(prompt) - 1] for r, prompt in enumerate(prompts)])
    return model.output_logits(last), features


def decode_step(model: Llama, kv: torch.Tensor, tokens: torch.Tensor, positions: list[int], feature_layers):
    """One new token per row at its own position; returns the next-token logits and features."""
    rows, position = len(positions), torch.tensor(positions)
    total = max(positions) + 1
    mask = (torch.arange(total) <= position.unsqueeze(1)).unsqueeze(1)
    logits, features = model.forward_packed(kv, tokens[:, None], position[:, None], position,
                                            torch.ones(rows, dtype=torch.long), mask, feature_layers)
    assert features is not None  # feature_layers given
    return logits[:, 0], features[:, 0]


def take_top(records: list[Record], alive: list[int], logits: torch.Tensor, soft_top: int) -> torch.Tensor:
    """Record each live row's top tokens; returns the greedy ones."""
    top = logits.float().log_softmax(-1).topk(soft_top, dim=-1)
    for row, r in enumerate(alive):
        records[r].top_ids.append(top.indices[row])
        records[r].top_logprobs.append(top.values[row])
        records[r].ids.append(int(top.indices[row, 0]))
    return top.indices[:, 0]


def still_going(records, alive, tokens, stop_ids, last_step) -> tuple[list[int], torch.Tensor]:
    """The rows that go on (neither stopped nor at the token limit) and their batch indices."""
    keep = [row for row, token in enumerate(tokens.tolist()) if token not in stop_ids and not last_step]
    return [alive[row] for row in keep], torch.tensor(keep, dtype=torch.long)
