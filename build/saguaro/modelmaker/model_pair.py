"""Make a target/draft model pair from scratch: tokenizer, target, distilled draft, report.

    make_pair("tiny", Path("models/tiny"))  # seconds; the pair the tests use
    make_pair("bench", Path("models/bench"))  # about 25 minutes on 2 cores; benchmarks

writes `target/` and `draft/` (Hugging Face checkpoints: safetensors weights, config, and
the same tokenizer files in both) and `pair.json` (sizes, losses, measured acceptance,
timings). `pair.json` is written last, so its presence means the pair is complete.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from saguaro.modelmaker.acceptance import AcceptanceSettings, format_acceptance, measure_acceptance
from saguaro.modelmaker.corpus import Corpus, fingerprint, load_corpus
from saguaro.modelmaker.tokenizer import train_tokenizer
from saguaro.modelmaker.train import (
    DistillSettings,
    ModelShape,
    TrainSettings,
    distill_draft,
    encode_documents,
    held_out_loss,
    llama_config,
    parameter_count,
    target_continuations,
    train_target,
)


@dataclass(frozen=True)
class PairPreset:
    vocab_size: int
    max_positions: int
    target: ModelShape
    draft: ModelShape
    target_training: TrainSettings
    draft_training: DistillSettings
    acceptance: AcceptanceSettings
    threads: int  # fixed: bitwise reproducibility holds only for one thread count


PRESETS: dict[str, PairPreset] = {
    # For tests: the whole pair in about half a minute. One thread: these models are too
    # small to gain much from a second, and on a busy 2-core machine two threads stall.
    "tiny": PairPreset(
        vocab_size=512,
        max_positions=256,
        target=ModelShape(hidden=96, layers=2, heads=6, kv_heads=2, intermediate=256),
        draft=ModelShape(hidden=48, layers=1, heads=3, kv_heads=3, intermediate=128),
        target_training=TrainSettings(
            steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20
        ),
        draft_training=DistillSettings(
            train=TrainSettings(steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20),
            pool_size=256,
            prompt_len=32,
            sampled_fraction=0.5,
            corpus_fraction=0.25,
        ),
        acceptance=AcceptanceSettings(prompt_tokens=32, new_tokens=64, max_prompts=24),
        threads=1,
    ),
    # For benchmarks: a 37.7M target, big enough that CPU decode is bound by weight
    # bandwidth (150 MB in fp32, 38 MB in int8: more than the L3 cache), and a 2.1M draft
    # (18x smaller). Sized from timed steps on 2 free cores: target about 3.6 s a step
    # (14 min, about 4 passes over the corpus), continuations about 1.5 min, draft about
    # 1.2 s a step (7 min): about 24 min in all. A busy machine makes it slower.
    "bench": PairPreset(
        vocab_size=2048,
        max_positions=1024,
        target=ModelShape(hidden=640, layers=8, heads=10, kv_heads=5, intermediate=1728),
        draft=ModelShape(hidden=256, layers=2, heads=4, kv_heads=4, intermediate=704),
        target_training=TrainSettings(
            steps=240, batch_size=8, seq_len=256, lr=1e-3, warmup_steps=20
        ),
        draft_training=DistillSettings(
            train=TrainSettings(steps=350, batch_size=8, seq_len=256, lr=2e-3, warmup_steps=20),
            pool_size=384,
            prompt_len=64,
            sampled_fraction=0.5,
            corpus_fraction=0.25,
        ),
        acceptance=AcceptanceSettings(prompt_tokens=32, new_tokens=96, max_prompts=48),
        threads=2,
    ),
}


def make_pair(size: str, out_dir: Path, seed: int = 0, progress: bool = True) -> dict:
    """Train and save the `size` pair into `out_dir`; return the report in `pair.json`."""
    preset = preset_named(size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # fails now, not after training, on a file
    (out_dir / "pair.json").unlink(missing_ok=True)  # incomplete until written again
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    with pinned_torch(preset.threads):
        pair = train_pair(preset, seed, progress, seconds)
    with timed(seconds, "save"), transformers_bars(progress):
        save_checkpoint(pair.target, pair.tokenizer, out_dir / "target")
        save_checkpoint(pair.draft, pair.tokenizer, out_dir / "draft")
    seconds["total"] = round(time.perf_counter() - started, 2)
    report = pair_report(size, seed, preset, pair, seconds)
    (out_dir / "pair.json").write_text(json.dumps(report, indent=2) + "\n")
    if progress:
        print(f"{size} pair in {out_dir}: {format_acceptance(pair.acceptance)}")
    return report


def preset_named(size: str) -> PairPreset:
    if size not in PRESETS:
        raise ValueError(f"unknown model pair size {size!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[size]


@dataclass
class TrainedPair:
    corpus: Corpus
    tokenizer: PreTrainedTokenizerFast
    target: LlamaForCausalLM
    draft: LlamaForCausalLM
    train_tokens: int
    held_out_tokens: int
    losses: dict[str, dict[str, float]]
    acceptance: dict


def train_pair(
    preset: PairPreset, seed: int, progress: bool, seconds: dict[str, float]
) -> TrainedPair:
    """Tokenizer, target, draft and their evaluation; each phase's time goes in `seconds`."""
    corpus = load_corpus()
    with timed(seconds, "tokenizer"):
        tokenizer = train_tokenizer(corpus.train_texts(), preset.vocab_size)
        train_stream = encode_documents(tokenizer, corpus.train_texts())
        held_out_stream = encode_documents(tokenizer, corpus.held_out_texts())
    with timed(seconds, "target"):
        target_config = llama_config(preset.target, tokenizer, preset.max_positions)
        target, target_losses = train_target(
            target_config, train_stream, preset.target_training, seed, progress
        )
    # Distinct seeds per phase, so the draft's random draws do not mirror the target's.
    with timed(seconds, "continuations"):
        pool = target_continuations(target, train_stream, preset.draft_training, seed + 1)
    with timed(seconds, "draft"):
        draft_config = llama_config(preset.draft, tokenizer, preset.max_positions)
        draft, draft_losses = distill_draft(
            draft_config, target, train_stream, pool, preset.draft_training, seed + 2, progress
        )
    with timed(seconds, "evaluation"):
        seq_len = preset.target_training.seq_len
        losses = {
            # The draft's training loss is its distillation loss; held_out is plain CE.
            "target": loss_summary(target_losses, held_out_loss(target, held_out_stream, seq_len)),
            "draft": loss_summary(draft_losses, held_out_loss(draft, held_out_stream, seq_len)),
        }
        acceptance = measure_acceptance(
            target, draft, tokenizer, corpus.held_out_texts(), preset.acceptance
        )
    return TrainedPair(
        corpus=corpus,
        tokenizer=tokenizer,
        target=target,
        draft=draft,
        train_tokens=len(train_stream),
        held_out_tokens=len(held_out_stream),
        losses=losses,
        acceptance=acceptance,
    )


def pair_report(
    size: str, seed: int, preset: PairPreset, pair: TrainedPair, seconds: dict[str, float]
) -> dict:
    target_params, draft_params = parameter_count(pair.target), parameter_count(pair.draft)
    return {
        "size": size,
        "seed": seed,
        "threads": preset.threads,
        "corpus": {
            "fingerprint": fingerprint(pair.corpus),
            "train_topics": len(pair.corpus.train),
            "held_out_topics": len(pair.corpus.held_out),
            "train_tokens": pair.train_tokens,
            "held_out_tokens": pair.held_out_tokens,
        },
        "vocab_size": len(pair.tokenizer),
        "params": {
            "target": target_params,
            "draft": draft_params,
            "ratio": round(target_params / draft_params, 2),
        },
        "shapes": {"target": asdict(preset.target), "draft": asdict(preset.draft)},
        "acceptance": pair.acceptance,
        "losses": pair.losses,
        "seconds": seconds,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }


def loss_summary(losses: list[float], held_out: float) -> dict[str, float]:
    tail = losses[-max(1, len(losses) // 10) :]  # the last tenth smooths batch noise
    return {
        "steps": len(losses),
        "first": round(losses[0], 4),
        "final": round(sum(tail) / len(tail), 4),
        "held_out": round(held_out, 4),
    }


@contextmanager
def pinned_torch(threads: int) -> Iterator[None]:
    """Fixed intra-op threads and a private random state, both restored afterwards, so a
    caller (a test session) sees no side effects."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    seconds[phase] = round(time.perf_counter() - start, 2)


@contextmanager
def transformers_bars(enabled: bool) -> Iterator[None]:
    """Turn `transformers`' own progress bars (e.g. "Writing model shards") on or off."""
    bars = transformers.utils.logging
    was_enabled = bars.is_progress_bar_enabled()
    (bars.enable_progress_bar if enabled else bars.disable_progress_bar)()
    try:
        yield
    finally:
        (bars.enable_progress_bar if was_enabled else bars.disable_progress_bar)()


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path
) -> None:
    if folder.exists():
        shutil.rmtree(folder)  # no stale files from an earlier pair
    model.save_pretrained(folder)  # safetensors, the default
    tokenizer.save_pretrained(folder)
