"""Make a draft for any target checkpoint: pruned from the target, distilled on its own output.

    the target answers training prompts greedily (its own generations are the labels:
    greedy acceptance counts exactly where the draft's argmax equals them)
    -> the draft keeps a few of the target's layers, its embeddings, and an lm_head over
       the tokens the target actually produces (`output_vocab`; every other token gets
       probability 0, which keeps speculative decoding lossless)
    -> distillation: cross-entropy against the target's greedy tokens and against its
       distribution over its top tokens at each of them (recorded while it generated, so
       no extra target forward), embeddings frozen
    -> agreement and accepted length at K measured on held-out prompts' generations
    -> a checkpoint folder with the target's tokenizer files and draft.json (the report)

The draft's cost per decode step is its layers plus its small lm_head; the embedding
lookup costs nothing. So a 4-of-30-layer draft with an 8192-row head reads about a sixth
of the target's weights per token, and runs 4 layers' worth of kernels instead of 30.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from saguaro.modelmaker.draft_prompts import Prompt, prompt_set
from saguaro.modelmaker.draft_training import Sequence, agreement, distill, output_rows_of
from saguaro.modelmaker.model_pair import pinned_torch
from saguaro.modelmaker.train import TrainSettings
from saguaro.runtime.models.checkpoint import (
    DRAFT_REPORT,
    OUTPUT_VOCAB_KEY,
    CheckpointError,
    end_of_generation_ids,
    load_checkpoint,
)
from saguaro.runtime.models.llama import Llama
from saguaro.runtime.models.prompts import chat_messages, encode_chat, encode_text, has_chat_template


class Answered(Protocol):
    """A prompt and the target's continuation: a pruned draft's `Sequence`, a feature
    head's `feature_answers.Answer`."""

    ids: list[int]
    start: int

    @property
    def continuation(self) -> list[int]: ...

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


@dataclass(frozen=True)
class DraftSettings:
    num_layers: int = 4
    output_vocab: int = 8192
    train_prompts: int = 960
    held_out_prompts: int = 32
    new_tokens: int = 64
    chat_share: float = 0.6      # the rest are documentation-text prompts
    generation_batch: int = 32
    train: TrainSettings = TrainSettings(steps=400, batch_size=16, seq_len=0, lr=5e-4, warmup_steps=20)
    soft_top: int = 16           # target tokens per position whose probabilities the draft learns
    soft_weight: float = 1.0     # weight of that soft term against the greedy-token term
    k: int = 4                   # the draft length acceptance is reported for
    threads: int = 2
    seed: int = 0


PRESETS = {
    # The target answering 960 prompts (5 minutes on 2 free cores), then 400 steps (9
    # minutes); on cores shared with other jobs, 2-4 times that.
    "full": DraftSettings(),
    # For the quickstart: a couple of minutes, a weak but real draft (output stays exact).
    # One thread: it runs beside the rest of the quickstart on a shared 2-core machine.
    "quick": DraftSettings(train_prompts=48, held_out_prompts=16, new_tokens=32, generation_batch=16, threads=1,
                           train=TrainSettings(steps=24, batch_size=8, seq_len=0, lr=1e-3, warmup_steps=4)),
}


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if prompt.chat and has_chat_template(tokenizer):
        return encode_chat(tokenizer, chat_messages(prompt.text))
    return encode_text(tokenizer, prompt.text)


@torch.no_grad()
def target_generations(target, tokenizer, prompts: list[Prompt], new_tokens: int, batch: int,
                       stop_ids: tuple[int, ...], soft_top: int, progress: bool) -> list[Sequence]:
    """Greedy continuations, batched with left padding (transformers' generate), with the
    target's top `soft_top` log-probabilities at every generated position."""
    pad = stop_ids[0] if stop_ids else 0
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    sequences = []
    for first in range(0, len(encoded), batch):
        rows = encoded[first:first + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=list(stop_ids) or None, pad_token_id=pad,
                              output_logits=True, return_dict_in_generate=True)
        steps = [step.float().log_softmax(-1).topk(soft_top, dim=-1) for step in out.logits]
        top_logprobs = torch.stack([s.values for s in steps], 1)  # [rows, steps, soft_top]
        top_ids = torch.stack([s.indices for s in steps], 1)
        for index, (row, prompt_ids) in enumerate(zip(out.sequences[:, width:].tolist(), rows)):
            stop = next((i for i, token in enumerate(row) if token in stop_ids), None)
            length = len(row) if stop is None else stop + 1
            sequences.append(Sequence(prompt_ids + row[:length], len(prompt_ids),
                                      top_ids[index, :length].clone(), top_logprobs[index, :length].clone()))
        if progress:
            print(f"  target answered {len(sequences)}/{len(encoded)} prompts", flush=True)
    return sequences


def output_vocabulary(sequences: Seq[Answered], size: int, vocab_size: int,
                      always: tuple[int, ...]) -> torch.Tensor:
    """The `size` token ids the draft scores: end-of-generation tokens, then the target's
    outputs by frequency, then prompt tokens, then the lowest ids (in a BPE vocabulary,
    the earliest merges: the commonest pieces)."""
    outputs = Counter(t for s in sequences for t in s.continuation)
    prompts = Counter(t for s in sequences for t in s.ids[:s.start])
    ranked = list(always) + [t for t, _ in outputs.most_common()] + [t for t, _ in prompts.most_common()]
    chosen = list(dict.fromkeys(ranked + list(range(vocab_size))))[:min(size, vocab_size)]
    return torch.tensor(sorted(chosen))


def kept_layers(total: int, count: int) -> list[int]:
    """The first `count - 1` layers and the last one: the early layers build the token
    representations, the last maps them onto the output embedding."""
    if not 1 <= count <= total:
        raise ValueError(f"a draft keeps 1 to {total} of the target's layers, not {count}")
    return list(range(count - 1)) + [total - 1]


def pruned_draft(target: Llama, layers: list[int], vocab_ids: torch.Tensor) -> Llama:
    shape = dataclasses.replace(target.shape, num_layers=len(layers), output_vocab=len(vocab_ids),
                                tie_word_embeddings=False)
    draft = Llama(shape)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        for mine, theirs in zip(draft.model.layers, layers):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab_ids])
        output_rows_of(draft)[vocab_ids] = torch.arange(len(vocab_ids))
    draft.model.embed_tokens.weight.requires_grad_(False)  # shared with the target, never trained
    return draft


def decode_cost(model: Llama) -> int:
    """Weights read per decode step: the layers, the final norm and the lm_head (a tied
    lm_head is the embedding table read whole); the embedding lookup itself is free."""
    body = sum(p.numel() for name, p in model.named_parameters() if name != "model.embed_tokens.weight")
    return body + (model.lm_head.weight.numel() if model.shape.tie_word_embeddings else 0)


def save_draft(draft: Llama, target_dir: Path, out: Path, report: dict) -> None:
    """A checkpoint folder the runtime loads: the target's config with the draft's depth
    and output vocabulary, the weights, the target's tokenizer files, and the report."""
    staging = out.resolve().with_name(f".{out.resolve().name}.making")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = json.loads((target_dir / "config.json").read_text())
    config.update({"num_hidden_layers": draft.shape.num_layers, "tie_word_embeddings": False,
                   OUTPUT_VOCAB_KEY: draft.shape.output_vocab})
    config.pop("layer_types", None)  # per-layer lists of the target's depth
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {name: tensor.contiguous() for name, tensor in draft.state_dict().items()}
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED_FILES:
        if (target_dir / name).is_file():
            shutil.copy2(target_dir / name, staging / name)
    (staging / DRAFT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def check_output(out: Path) -> None:
    if out.exists() and not (out.is_dir() and ((out / DRAFT_REPORT).is_file() or not any(out.iterdir()))):
        raise CheckpointError(f"output {str(out)!r} exists and is not a draft made here; choose another --out")


def make_draft_for(target_dir: str | Path, out: str | Path, settings: DraftSettings = PRESETS["full"],
                   progress: bool = True) -> dict:
    """Make and save the draft; returns the report (also `out/draft.json`)."""
    target_dir, out = Path(target_dir), Path(out)
    check_output(out)
    checkpoint = load_checkpoint(target_dir)  # fails fast, naming the folder, on a bad target
    layers = kept_layers(checkpoint.shape.num_layers, settings.num_layers)
    seconds: dict[str, float] = {}
    with pinned_torch(settings.threads):
        torch.manual_seed(settings.seed)
        mark = time.perf_counter()
        hf_target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
        stop_ids = end_of_generation_ids(target_dir, json.loads((target_dir / "config.json").read_text()),
                                         checkpoint.tokenizer)
        train = target_generations(hf_target, checkpoint.tokenizer, prompt_set(
            settings.train_prompts, settings.chat_share, False, settings.seed), settings.new_tokens,
            settings.generation_batch, stop_ids, settings.soft_top, progress)
        held_out = target_generations(hf_target, checkpoint.tokenizer, prompt_set(
            settings.held_out_prompts, settings.chat_share, True, settings.seed), settings.new_tokens,
            settings.generation_batch, stop_ids, settings.soft_top, progress)
        del hf_target
        seconds["target_generations"] = time.perf_counter() - mark
        vocab_ids = output_vocabulary(train, settings.output_vocab, checkpoint.shape.vocab_size, stop_ids)
        draft = pruned_draft(checkpoint.model, layers, vocab_ids)
        before = agreement(draft, held_out, settings.k)
        mark = time.perf_counter()
        losses = distill(draft, train, settings.train, settings.soft_top, settings.soft_weight, settings.seed,
                         progress)
        seconds["distillation"] = time.perf_counter() - mark
        after = agreement(draft, held_out, settings.k)
    report = {"target": str(target_dir.resolve()), "layers": layers, "output_vocab": len(vocab_ids),
              "settings": dataclasses.asdict(settings),
              "train_tokens": sum(len(s.continuation) for s in train),
              "output_coverage": coverage(held_out, vocab_ids),
              "decode_weights": {"target": decode_cost(checkpoint.model), "draft": decode_cost(draft)},
              "loss": {"first": losses[0], "final": sum(losses[-10:]) / len(losses[-10:])},
              "acceptance_before_distillation": before, "acceptance": after,
              "seconds": {key: round(value, 1) for key, value in seconds.items()}}
    save_draft(draft, target_dir, out, report)
    return report


def coverage(sequences: Seq[Answered], vocab_ids: torch.Tensor) -> float:
    """Share of held-out target tokens the draft can propose at all."""
    tokens = torch.tensor([t for s in sequences for t in s.continuation])
    return float(torch.isin(tokens, vocab_ids).float().mean())
