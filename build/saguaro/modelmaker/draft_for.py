"""Make a draft for any target checkpoint: pruned from the target, distilled on its own output.

    the target answers training prompts greedily (its own generations are the labels:
    greedy acceptance counts exactly where the draft's argmax equals them)
    -> the draft keeps a few of the target's layers, its embeddings, and an lm_head over
       the tokens the target actually produces (`output_vocab`; every other token gets
       probability 0, which keeps speculative decoding lossless)
    -> distillation: cross-entropy against the target's greedy tokens, embeddings frozen
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from saguaro.modelmaker.acceptance import summarize
from saguaro.modelmaker.draft_prompts import Prompt, prompt_set
from saguaro.modelmaker.model_pair import pinned_torch
from saguaro.modelmaker.train import TrainSettings, fit
from saguaro.runtime.checkpoint import OUTPUT_VOCAB_KEY, CheckpointError, end_of_generation_ids, load_checkpoint
from saguaro.runtime.llama import Llama
from saguaro.runtime.prompts import chat_messages, encode_chat, encode_text, has_chat_template

REPORT_FILE = "draft.json"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


@dataclass(frozen=True)
class DraftSettings:
    num_layers: int = 4
    output_vocab: int = 8192
    train_prompts: int = 384
    held_out_prompts: int = 32
    new_tokens: int = 64
    chat_share: float = 0.6      # the rest are documentation-text prompts
    generation_batch: int = 16
    train: TrainSettings = TrainSettings(steps=200, batch_size=16, seq_len=0, lr=5e-4, warmup_steps=20)
    k: int = 4                   # the draft length acceptance is reported for
    # One thread: on a shared 2-core machine a second one stalls more often than it helps.
    threads: int = 1
    seed: int = 0


PRESETS = {
    # About half an hour on 2 shared cores: the target answering 320 prompts, then 200 steps.
    "full": DraftSettings(train_prompts=320),
    # For the quickstart: a couple of minutes, a weak but real draft (output stays exact).
    "quick": DraftSettings(train_prompts=48, held_out_prompts=16, new_tokens=32,
                           train=TrainSettings(steps=24, batch_size=8, seq_len=0, lr=1e-3, warmup_steps=4)),
}


@dataclass
class Sequence:
    """A prompt's ids followed by the target's greedy continuation (ending at EOS if reached)."""

    ids: list[int]
    start: int  # index of the first continuation token

    @property
    def continuation(self) -> list[int]:
        return self.ids[self.start:]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if prompt.chat and has_chat_template(tokenizer):
        return encode_chat(tokenizer, chat_messages(prompt.text))
    return encode_text(tokenizer, prompt.text)


@torch.no_grad()
def target_generations(target, tokenizer, prompts: list[Prompt], new_tokens: int, batch: int,
                       stop_ids: tuple[int, ...], progress: bool) -> list[Sequence]:
    """Greedy continuations, batched with left padding (transformers' generate)."""
    pad = stop_ids[0] if stop_ids else 0
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    sequences = []
    for first in range(0, len(encoded), batch):
        rows = encoded[first:first + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=list(stop_ids) or None, pad_token_id=pad)
        for row, prompt_ids in zip(out[:, width:].tolist(), rows):
            stop = next((i for i, token in enumerate(row) if token in stop_ids), None)
            sequences.append(Sequence(prompt_ids + row[:len(row) if stop is None else stop + 1], len(prompt_ids)))
        if progress:
            print(f"  target answered {len(sequences)}/{len(encoded)} prompts", flush=True)
    return sequences


def output_vocabulary(sequences: list[Sequence], size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
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
        draft.output_rows[vocab_ids] = torch.arange(len(vocab_ids))
    draft.model.embed_tokens.weight.requires_grad_(False)  # shared with the target, never trained
    return draft


def batch_of(sequences: list[Sequence], output_rows: torch.Tensor, unscored: int):
    """Right-padded ids, a causal mask, positions, and labels: the draft's output row of
    each continuation token (-100 for prompt tokens and tokens the draft cannot score)."""
    width = max(len(s.ids) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100)
    for row, s in enumerate(sequences):
        ids[row, :len(s.ids)] = torch.tensor(s.ids)
        rows = output_rows[torch.tensor(s.continuation)]
        labels[row, s.start:len(s.ids)] = torch.where(rows == unscored, -100, rows)
    mask = torch.ones(width, width, dtype=torch.bool).tril().expand(len(sequences), width, width)
    return ids, mask, torch.arange(width).expand(len(sequences), width), labels


def empty_past(model: Llama, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers, heads, dim = model.shape.kv_shape
    return torch.zeros(layers, batch, heads, 0, dim), torch.zeros(layers, batch, heads, 0, dim)


def distill(draft: Llama, sequences: list[Sequence], settings: TrainSettings, seed: int, progress: bool) -> list[float]:
    """Cross-entropy of the draft's next-token scores against the target's greedy tokens."""
    draws = torch.Generator().manual_seed(seed)

    def batch_loss() -> torch.Tensor:
        picks = torch.randint(len(sequences), (settings.batch_size,), generator=draws).tolist()
        ids, mask, positions, labels = batch_of([sequences[i] for i in picks], draft.output_rows,
                                                draft.shape.output_vocab)
        hidden, _, _ = draft.hidden_concat(ids, positions, mask, *empty_past(draft, len(picks)))
        logits = draft.output_logits(hidden[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    return fit(draft, settings, batch_loss, progress, "draft")


@torch.no_grad()
def agreement(draft: Llama, sequences: list[Sequence], k: int) -> dict:
    """Per continuation token: does the draft's argmax (full vocabulary) equal the target's?"""
    draft.eval()
    matches = []
    for s in sequences:
        ids, mask, positions, _ = batch_of([s], draft.output_rows, draft.shape.output_vocab)
        logits, _, _ = draft.forward_concat(ids, positions, mask, *empty_past(draft, 1))
        guesses = logits[0, s.start - 1:len(s.ids) - 1].argmax(-1)
        matches.append((guesses == torch.tensor(s.continuation)).tolist())
    return summarize(matches, k, sum(s.start for s in sequences) // len(sequences),
                     max(len(s.continuation) for s in sequences))


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
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def check_output(out: Path) -> None:
    if out.exists() and not (out.is_dir() and ((out / REPORT_FILE).is_file() or not any(out.iterdir()))):
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
            settings.generation_batch, stop_ids, progress)
        held_out = target_generations(hf_target, checkpoint.tokenizer, prompt_set(
            settings.held_out_prompts, settings.chat_share, True, settings.seed), settings.new_tokens,
            settings.generation_batch, stop_ids, progress)
        del hf_target
        seconds["target_generations"] = time.perf_counter() - mark
        vocab_ids = output_vocabulary(train, settings.output_vocab, checkpoint.shape.vocab_size, stop_ids)
        draft = pruned_draft(checkpoint.model, layers, vocab_ids)
        before = agreement(draft, held_out, settings.k)
        mark = time.perf_counter()
        losses = distill(draft, train, settings.train, settings.seed, progress)
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


def coverage(sequences: list[Sequence], vocab_ids: torch.Tensor) -> float:
    """Share of held-out target tokens the draft can propose at all."""
    tokens = torch.tensor([t for s in sequences for t in s.continuation])
    return float(torch.isin(tokens, vocab_ids).float().mean())
