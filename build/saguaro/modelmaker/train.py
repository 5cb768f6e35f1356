"""Deterministic training of the target and of the draft distilled from it.

The target learns next-token prediction on the corpus token stream (documents as
`<s> text </s>`). The draft learns from the target, not from the text: on every position
it is pulled towards the target's distribution, softened by a temperature (KL), and
towards the target's argmax (cross-entropy), over two kinds of context: windows of the
corpus, and the target's own greedy and sampled continuations (sequence-level
distillation). The second kind is what speculative decoding sees at run time, and the
argmax term is what greedy acceptance counts: without it the tiny draft agreed with the
target on 0.29 of greedy tokens instead of 0.82.

Same seed and same thread count give bitwise-identical weights: every random draw (model
init, window positions, sampling) comes from a seed, and fp32 CPU kernels with a fixed
thread count are deterministic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int  # fewer than `heads` means grouped-query attention
    intermediate: int


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class DistillSettings:
    train: TrainSettings
    pool_size: int  # target continuations generated once, reused every step
    prompt_len: int  # continuations start from corpus windows this long
    sampled_fraction: float  # share of the pool sampled at temperature 1 (the rest greedy)
    corpus_fraction: float  # share of each batch's rows taken from the corpus
    # Softens both distributions in the KL term; 1 (none) did as well as 2 on the tiny pair.
    temperature: float = 1.0
    hard_weight: float = 1.0  # weight of cross-entropy against the target's argmax


def llama_config(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast, max_positions: int
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Tied input/output embeddings: at these vocab sizes the embedding is a large share
        # of a small model, and tying it costs the draft nothing in agreement.
        tie_word_embeddings=True,
    )


def new_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One flat token stream: `<s> text </s>` for each text, in order."""
    ids: list[int] = []
    for text in texts:
        ids.append(tokenizer.bos_token_id)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(
    stream: torch.Tensor, rows: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length + 1, (rows,), generator=generator)
    return torch.stack([stream[start : start + length] for start in starts.tolist()])


def make_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    # Decay matrices only; norm gains stay undecayed, as usual for transformers.
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": settings.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, settings: TrainSettings, total: Callable[[], int] | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay down to `min_lr_ratio` of the peak rate at step
    `total()` (`settings.steps` unless given: `fit` may end a run early)."""

    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        steps = total() if total is not None else settings.steps
        progress = (step - settings.warmup_steps) / max(1, steps - settings.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fit(
    model: torch.nn.Module,
    settings: TrainSettings,
    batch_loss: Callable[[], torch.Tensor],
    progress: bool,
    desc: str,
    deadline: float | None = None,
) -> list[float]:
    """Run `settings.steps` optimiser steps on `batch_loss()`; return the loss per step.
    `deadline` (`time.monotonic()`): fewer steps where they would not all end by then,
    the count set from the pace so far (after the warm-up, then every `RECOUNT_EVERY`
    steps) and the decay ending at it, so that a run on a busy machine keeps its time."""
    optimizer = make_optimizer(model, settings)
    steps = settings.steps
    schedule = warmup_cosine(optimizer, settings, lambda: steps)
    losses: list[float] = []
    model.train()
    bar = tqdm(total=steps, desc=desc, disable=not progress, dynamic_ncols=True)
    started = time.monotonic()
    while len(losses) < steps:
        loss = batch_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.update()
        done = len(losses)
        if deadline is not None and (done == settings.warmup_steps or done % RECOUNT_EVERY == 0):
            steps = steps_by(deadline, done, time.monotonic() - started, settings.steps)
            bar.total = steps
        if done % 20 == 1 or done == steps:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    return losses


RECOUNT_EVERY = 100  # steps between recounts of what fits before a deadline


def steps_by(deadline: float, done: int, elapsed_s: float, most: int) -> int:
    """How many steps end by `deadline` at the pace of the `done` steps so far (at least
    one more than done: the recount is not a stop), at most `most`."""
    pace = elapsed_s / done
    return max(done + 1, min(most, done + int((deadline - time.monotonic()) / pace)))


def next_token_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def train_target(
    config: LlamaConfig,
    stream: torch.Tensor,
    settings: TrainSettings,
    seed: int,
    progress: bool = True,
) -> tuple[LlamaForCausalLM, list[float]]:
    """A fresh target (initialised from `seed`) trained on next-token prediction."""
    model = new_model(config, seed)
    windows = torch.Generator().manual_seed(seed)

    def batch_loss() -> torch.Tensor:
        batch = random_windows(stream, settings.batch_size, settings.seq_len + 1, windows)
        return next_token_loss(model, batch)

    return model, fit(model, settings, batch_loss, progress, "target")


@torch.no_grad()
def target_continuations(
    target: LlamaForCausalLM, stream: torch.Tensor, settings: DistillSettings, seed: int
) -> torch.Tensor:
    """`pool_size` rows of a corpus prompt followed by the target's own continuation,
    `seq_len` tokens each: the first `sampled_fraction` of rows sampled, the rest greedy.

    A row ends with pad ids after the target emits an end of sequence; the pad marks where
    the row's valid context ends."""
    torch.manual_seed(seed)  # generate() samples from the global generator
    prompts = random_windows(
        stream, settings.pool_size, settings.prompt_len, torch.Generator().manual_seed(seed)
    )
    sampled_rows = round(settings.pool_size * settings.sampled_fraction)
    rows = [
        continue_prompts(target, prompts[:sampled_rows], settings.train.seq_len, sample=True),
        continue_prompts(target, prompts[sampled_rows:], settings.train.seq_len, sample=False),
    ]
    return torch.cat(rows)


@torch.no_grad()
def continue_prompts(
    target: LlamaForCausalLM, prompts: torch.Tensor, length: int, sample: bool
) -> torch.Tensor:
    """Extend equal-length `prompts` to `length` tokens with the target's continuation."""
    pad_id = target.config.pad_token_id
    rows = []
    for chunk in prompts.split(64):  # bounded batches keep memory flat
        generated = target.generate(
            chunk,
            attention_mask=torch.ones_like(chunk),
            max_new_tokens=length - chunk.shape[1],
            do_sample=sample,
            # Plain temperature-1 sampling (top_k=0 turns off generate()'s default top-50).
            **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}),
            pad_token_id=pad_id,
        )
        rows.append(F.pad(generated, (0, length - generated.shape[1]), value=pad_id))
    return torch.cat(rows) if rows else prompts.new_empty((0, length))


def distillation_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    valid: torch.Tensor,
    settings: DistillSettings,
) -> torch.Tensor:
    """Per position: T^2 * KL(target_T || draft_T) + hard_weight * CE(draft, target argmax),
    averaged over the valid positions."""
    t = settings.temperature
    soft = F.kl_div(
        F.log_softmax(draft_logits / t, dim=-1),
        F.log_softmax(target_logits / t, dim=-1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    hard = F.cross_entropy(
        draft_logits.flatten(0, 1), target_logits.argmax(-1).flatten(), reduction="none"
    ).view_as(soft)
    per_position = soft * t * t + settings.hard_weight * hard
    return (per_position * valid).sum() / valid.sum()


def distill_draft(
    config: LlamaConfig,
    target: LlamaForCausalLM,
    stream: torch.Tensor,
    continuations: torch.Tensor,
    settings: DistillSettings,
    seed: int,
    progress: bool = True,
) -> tuple[LlamaForCausalLM, list[float]]:
    """A fresh draft (initialised from `seed`) distilled from `target` on corpus windows
    mixed with rows of `continuations` (from `target_continuations`)."""
    draft = new_model(config, seed)
    target.eval()
    draws = torch.Generator().manual_seed(seed)
    train = settings.train
    corpus_rows = round(train.batch_size * settings.corpus_fraction)
    pad_id = config.pad_token_id

    def batch_loss() -> torch.Tensor:
        windows = random_windows(stream, corpus_rows, train.seq_len, draws)
        pool_rows = train.batch_size - corpus_rows
        picks = torch.randint(len(continuations), (pool_rows,), generator=draws)
        batch = torch.cat([windows, continuations[picks]])
        assert pad_id is not None  # `llama_config` takes the tokenizer's <pad>
        valid = (batch != pad_id).float()
        with torch.no_grad():
            target_logits = target(input_ids=batch).logits
        return distillation_loss(draft(input_ids=batch).logits, target_logits, valid, settings)

    return draft, fit(draft, train, batch_loss, progress, "draft")


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross-entropy over consecutive windows of `stream`."""
    usable = (len(stream) - 1) // seq_len * seq_len
    inputs = stream[:usable].view(-1, seq_len)
    labels = stream[1 : usable + 1].view(-1, seq_len)
    total = 0.0
    for start in range(0, len(inputs), 16):
        logits = model(input_ids=inputs[start : start + 16]).logits
        total += F.cross_entropy(
            logits.flatten(0, 1), labels[start : start + 16].flatten(), reduction="sum"
        ).item()
    return total / labels.numel()
