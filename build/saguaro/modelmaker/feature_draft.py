"""Train an EAGLE-3 feature head for any Llama target on CPU, from the target's own answers.

    the target answers training prompts greedily, many sequences per forward
    (`feature_answers`), recording at every position its hidden states at the head's
    feature layers and its top tokens' probabilities (soft labels): bfloat16 where the CPU
    has fast bf16 kernels, the held-out answers in float32 so the reported agreement is
    the real one
    -> the head starts with the target's final norm and the target's lm_head rows for the
       draft vocabulary (the tokens the target answers with most, and its end tokens), and
       as the target's decoder layer that reads the highest feature (`copy_target_layer`)
    -> training-time test (EAGLE-3): each step unrolls `ttt_steps` drafting steps, the
       first on the target's features, the later ones on the head's own `hidden_out`,
       attending to the true-feature keys before the chain and to the chain's own keys;
       loss = cross-entropy against the target's soft labels and its greedy tokens, plus
       each step's `hidden_out` regressed on the target's last-layer output at the position
       it stands for (EAGLE-1's feature loss; here it keeps a head trained on few answers
       from learning them by heart)
    -> held-out report: greedy agreement per token (true features), the mean accepted
       length at K (each round drafts K tokens on its own features and counts the prefix
       the target's greedy answer agrees with), and the head's cost per step against the
       target's (batch 1, one thread)
    -> a release-format head folder (`feature_head.save_feature_head`), the target's
       tokenizer files, and draft.json (the report, naming the target it was trained for)

The unrolled chains over answers: `feature_chains`; the held-out report: `feature_report`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from saguaro.modelmaker.draft_for import (
    COPIED_FILES,
    check_output,
    coverage,
    decode_cost,
    encode_prompt,
    output_vocabulary,
)
from saguaro.modelmaker.draft_prompts import prompt_set
from saguaro.modelmaker.draft_training import output_rows_of, soft_cross_entropy
from saguaro.modelmaker.feature_answers import Answer, Room, collect_answers, fast_bfloat16
from saguaro.modelmaker.feature_chains import Batch, batch_of, unrolled
from saguaro.modelmaker.feature_report import acceptance, head_decode_cost, step_seconds
from saguaro.modelmaker.model_pair import pinned_torch
from saguaro.modelmaker.train import TrainSettings, fit
from saguaro.runtime.models.checkpoint import DRAFT_REPORT, load_checkpoint
from saguaro.runtime.models.feature_head import FeatureHead, FeatureHeadShape, default_feature_layers, save_feature_head
from saguaro.runtime.models.llama import DecoderLayer, Features, Llama

KIND = "feature"


@dataclass(frozen=True)
class FeatureDraftSettings:
    draft_vocab_size: int = 8192
    train_prompts: int = 1536
    held_out_prompts: int = 32
    new_tokens: int = 128
    chat_share: float = 0.75     # the rest are documentation-text prompts
    generation_batch: int = 32
    train: TrainSettings = TrainSettings(steps=3300, batch_size=4, seq_len=0, lr=1e-3, warmup_steps=20)
    # drafting steps unrolled per training step: 2 trained more steps in the same minutes
    # than 3 and measured better at every depth (docs/drafts.md, "Two unrolled steps")
    ttt_steps: int = 2
    step_decay: float = 0.8      # weight of step j's loss: step_decay ** (j - 1)
    soft_top: int = 16           # target tokens per position whose probabilities the head learns
    soft_weight: float = 1.0     # weight of that soft term against the greedy-token term
    # weight of the regression of each step's hidden_out on the target's last-layer output
    # (smooth L1): 1.0 raised held-out agreement 0.385 -> 0.414 on 384 answers x 1200 steps
    # (docs/drafts.md, "The feature loss")
    feature_weight: float = 1.0
    k: int = 4                   # the draft length acceptance is reported for
    threads: int = 2
    seed: int = 0
    # The whole run's time: training takes fewer steps where the answers and the configured
    # steps would not fit in it (the held-out report's few seconds kept aside). None: no bound.
    minutes: float | None = 29.0


PRESETS = {
    # The target answering 1536 prompts x 128 tokens in bf16 batches of 32, then up to 3300
    # steps of 4 answers x 2 unrolled steps, as many as the time bound holds: at most 29
    # minutes on 2 cores (11-15 answering; docs/drafts.md), fewer steps on a busier machine.
    "full": FeatureDraftSettings(),
    # The quickstart's: under 3 minutes on 2 cores: up to 384 answers (nine in ten to chat
    # questions) x 96 tokens and 660 steps of 2 unrolled steps, as many as the bound holds
    # (`training_room`): on a 2-core AMD EPYC with AVX512 about 290 answers and 540 steps,
    # held-out agreement 0.361, where the earlier caps (192, 330) stopped at 111 s with 0.341.
    "quick": FeatureDraftSettings(train_prompts=384, held_out_prompts=16, new_tokens=96, chat_share=0.9, minutes=2.9,
                                  train=TrainSettings(steps=660, batch_size=4, seq_len=0, lr=2e-3, warmup_steps=10)),
}


# The head and its training.

def initial_head(target: Llama, feature_layers: tuple[int, ...], vocab_ids: torch.Tensor) -> FeatureHead:
    """The target's final norm and lm_head rows for the draft vocabulary, and its decoder
    layer over the highest feature (`copy_target_layer`): every weight is the target's, so
    the head starts the same whatever the seed (which draws the training batches)."""
    s = target.shape
    shape = FeatureHeadShape(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size, num_heads=s.num_heads,
                             num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
                             rope_theta=s.rope_theta, rope_scaling=s.rope_scaling,
                             max_position_embeddings=s.max_position_embeddings, vocab_size=s.vocab_size,
                             draft_vocab_size=len(vocab_ids), feature_layers=tuple(feature_layers),
                             target_hidden_size=s.hidden_size)
    head = FeatureHead(shape, target.model.embed_tokens.weight)
    with torch.no_grad():
        head.norm.load_state_dict(target.model.norm.state_dict())
        head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids])
    copy_target_layer(head, target)
    head.set_vocabulary(vocab_ids)
    return head


def layer_copied(target: Llama, feature_layers: tuple[int, ...]) -> int:
    """The target layer a head starts as: the one that reads the highest feature (the
    hidden state entering layer i is feature i), or the last where that feature is the
    last layer's output."""
    return min(max(feature_layers), target.shape.num_layers - 1)


@torch.no_grad()
def copy_target_layer(head: FeatureHead, target: Llama) -> None:
    """Start the head as the target's layer `layer_copied` over the highest feature: `fc`
    passes that feature through, and the layer's weights read it where the head's q/k/v
    read the feature (its norm in `hidden_norm`), the embedding's side at zero. The head
    then computes that layer's output from its input (up to the biases and q/k norms some
    targets' attention has and the head has not), and training starts from a layer that
    already transforms the target's hidden states (EAGLE-3 heads start at random). On the
    quick preset's answers (SmolLM2, 330 steps, two seeds), held-out agreement 0.297 and
    0.308 from random weights, 0.335 and 0.338 from the copy (docs/drafts.md)."""
    feature_layers, width, hidden = head.shape.feature_layers, head.shape.target_hidden_size, head.shape.hidden_size
    source = cast(DecoderLayer, target.model.layers[layer_copied(target, feature_layers)])
    layer = head.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(layer.self_attn, name).weight  # reads [embedding ; feature], each `hidden` wide
        weight[:, :hidden] = 0.0
        weight[:, hidden:] = getattr(source.self_attn, name).weight
    layer.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
    layer.hidden_norm.weight.copy_(source.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    highest = feature_layers.index(max(feature_layers))
    head.fc.weight.zero_()
    head.fc.weight[:, highest * width:(highest + 1) * width] = torch.eye(width)


def draft_vocabulary(answers: list[Answer], size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """As the pruned draft's: end tokens, then the target's answer tokens by frequency."""
    return output_vocabulary(answers, size, vocab_size, always)


def step_targets(batch: Batch, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For step `step`, per element: whether it has a label, the greedy token it should
    predict (position e + 1 + step), and the target's soft labels there."""
    span = slice(1 + step, 1 + step + batch.width)
    return batch.scored[:, span], batch.ids[:, span], batch.soft_ids[:, span], batch.soft_probs[:, span]


def ttt_loss(head: FeatureHead, batch: Batch, settings: FeatureDraftSettings) -> torch.Tensor:
    total: torch.Tensor | float = 0.0
    unscored = head.shape.draft_vocab_size
    for step, hidden in enumerate(unrolled(head, batch, settings.ttt_steps), start=1):
        scored, labels, soft_ids, soft_probs = step_targets(batch, step)
        log_q = head.draft_logits(hidden[scored]).log_softmax(-1)
        rows = output_rows_of(head)[labels[scored]]
        hard = F.nll_loss(log_q, torch.where(rows == unscored, -100, rows), ignore_index=-100)
        soft = soft_cross_entropy(log_q, output_rows_of(head)[soft_ids[scored]], soft_probs[scored], unscored)
        loss = hard + settings.soft_weight * soft + settings.feature_weight * feature_loss(hidden, batch, step)
        total = total + settings.step_decay ** (step - 1) * loss
    return cast(torch.Tensor, total)  # a tensor after the first of the ttt_steps


def feature_loss(hidden: torch.Tensor, batch: Batch, step: int) -> torch.Tensor:
    """Step `step`'s hidden_out at element e stands for the target's last hidden state at
    position e + step (the one its norm and lm_head score): smooth L1 between the two,
    wherever that position was fed (prompt positions too: they have no labels)."""
    span = slice(step, step + batch.width)
    fed = batch.fed[:, span]
    return F.smooth_l1_loss(hidden[fed].float(), batch.finals[:, span][fed].float())


def train_head(head: FeatureHead, answers: list[Answer], settings: FeatureDraftSettings, bf16: bool,
               progress: bool, deadline: float | None = None) -> list[float]:
    return fit(head, settings.train, loss_on_draws(head, answers, settings, bf16), progress, "feature head", deadline)


def loss_on_draws(head: FeatureHead, answers: list[Answer], settings: FeatureDraftSettings,
                  bf16: bool) -> Callable[[], torch.Tensor]:
    """Each call: the loss on `settings.train.batch_size` answers drawn at random (seeded)."""
    draws = torch.Generator().manual_seed(settings.seed)

    def batch_loss() -> torch.Tensor:
        picks = torch.randint(len(answers), (settings.train.batch_size,), generator=draws).tolist()
        batch = batch_of([answers[i] for i in picks], settings.ttt_steps, settings.soft_top)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return ttt_loss(head, batch, settings)

    return batch_loss


def training_pace(head: FeatureHead, answers: list[Answer], settings: FeatureDraftSettings, bf16: bool,
                  warmup: int = 3, timed: int = 4) -> float:
    """Seconds a training step takes on this machine now: the median of `timed` steps of
    `head` (a throwaway) over `answers`, after `warmup` untimed. A fresh process's first
    steps are slow (each new batch shape builds its kernels): on a 2-core host the second
    and third steps took 0.35 and 0.25 s where the run's 330 then averaged 0.15, and
    timing those two stopped the quick preset at 128 of its 192 answers."""
    batch_loss = loss_on_draws(head, answers, settings, bf16)
    starts: list[float] = []

    def marked_loss() -> torch.Tensor:
        starts.append(time.perf_counter())
        return batch_loss()

    fit(head, dataclasses.replace(settings.train, steps=warmup + timed), marked_loss, False, "")
    starts.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(starts[warmup:], starts[warmup + 1:]))


# The whole run.

def make_feature_draft(target_dir: str | Path, out: str | Path,
                       settings: FeatureDraftSettings = PRESETS["full"],
                       feature_layers: tuple[int, ...] | None = None, progress: bool = True) -> dict:
    """Collect the target's answers, train the head, measure it, and save the folder;
    returns the report (also `out/draft.json`)."""
    target_dir, out = Path(target_dir), Path(out)
    check_output(out)
    checkpoint = load_checkpoint(target_dir)
    layers = tuple(feature_layers or default_feature_layers(checkpoint.shape.num_layers))
    Features(layers, checkpoint.shape.num_layers)  # refuses layers outside the target's, before any work
    seconds: dict[str, float] = {}
    deadline = run_deadline(settings)
    bf16 = fast_bfloat16()
    with pinned_torch(settings.threads):
        torch.manual_seed(settings.seed)
        train, held_out = target_answers(checkpoint, settings, layers, bf16, progress, seconds, deadline)
        vocab_ids = draft_vocabulary(train, settings.draft_vocab_size, checkpoint.shape.vocab_size,
                                     checkpoint.eos_token_ids)
        head = initial_head(checkpoint.model, layers, vocab_ids)
        before = acceptance(head, held_out, settings.k)
        mark = time.perf_counter()
        bound = f", fewer if the run's {settings.minutes:g} minutes end first" if deadline is not None else ""
        say(progress, f"training the head: {settings.train.steps} steps of {settings.train.batch_size} answers, "
                      f"{settings.ttt_steps} unrolled drafting steps each{' (bf16 autocast)' if bf16 else ''}{bound}")
        losses = train_head(head, train, settings, bf16, progress, deadline)
        seconds["training"] = time.perf_counter() - mark
        mark = time.perf_counter()
        after = acceptance(head, held_out, settings.k)
        costs = step_seconds(head, checkpoint.model)
        seconds["report"] = time.perf_counter() - mark
    report = {"kind": KIND, "target": str(target_dir.resolve()), "feature_layers": list(layers),
              "output_vocab": len(vocab_ids), "settings": dataclasses.asdict(settings),
              "collection_dtype": "bfloat16" if bf16 else "float32", "held_out_dtype": "float32",
              "train_answers": len(train), "train_tokens": sum(len(a.continuation) for a in train),
              "output_coverage": coverage(held_out, vocab_ids),
              "decode_weights": {"target": decode_cost(checkpoint.model), "draft": head_decode_cost(head)},
              "step_seconds": costs,
              "trained_steps": len(losses),
              "loss": {"first": losses[0], "final": sum(losses[-10:]) / len(losses[-10:])},
              "acceptance_before_distillation": before, "acceptance": after,
              "seconds": {key: round(value, 1) for key, value in seconds.items()}}
    save_draft_folder(head, target_dir, out, report)
    say(progress, f"feature head in {out} ({len(losses)} steps): agreement {after['agreement']:.3f}, mean accepted "
                  f"{after['mean_accepted']:.2f} at K={settings.k}, step cost {costs['ratio']:.3f} of the target's")
    return report


REPORT_RESERVE_S = 12.0  # the held-out report and saving after training (5 s on the full preset), and the imports before
# The passes over its answers a head's training is worth: a bounded run answers no more
# prompts than leave time for this many (or the preset's steps, if fewer). The quick
# preset on a 2-core AVX2 host with fp32 answers (docs/drafts.md, "Answers sized to the
# steps"): 192 answers left 50 steps (held-out agreement 0.147); 128 answers x 141 steps
# 0.222, 96 x 185 0.235, 64 x 237 0.226. Where answers are fast (bf16) every prompt is
# answered, as before.
PASSES = 8


def run_deadline(settings: FeatureDraftSettings) -> float | None:
    """When training must end (`time.monotonic()`) for the run to keep `settings.minutes`."""
    if settings.minutes is None:
        return None
    return time.monotonic() + 60 * settings.minutes - REPORT_RESERVE_S


def training_room(settings: FeatureDraftSettings, step_seconds: float, deadline: float) -> Room:
    """Whether answers that reach `count` at `ends` still leave training, by `deadline`,
    the steps they are worth: `PASSES` over them at `batch_size` answers a step, at most
    the preset's steps, each taking `step_seconds`."""
    def room(count: int, ends: float) -> bool:
        steps = min(settings.train.steps, PASSES * count / settings.train.batch_size)
        return ends + steps * step_seconds <= deadline

    return room


def target_answers(checkpoint, settings: FeatureDraftSettings, layers: tuple[int, ...], bf16: bool,
                   progress: bool, seconds: dict, deadline: float | None = None) -> tuple[list[Answer], list[Answer]]:
    """Held-out answers in fp32, then training answers (in bf16 when fast, features stored
    in it): within a `deadline`, as many as leave training the steps they are worth, at
    the pace of training steps timed here on the held-out answers."""
    mark = time.perf_counter()
    say(progress, f"target answering {settings.held_out_prompts} held-out prompts (fp32)")
    held_out = collect_answers(checkpoint.model, encoded_prompts(checkpoint.tokenizer, settings, True),
                               settings.new_tokens, settings.generation_batch, checkpoint.eos_token_ids,
                               settings.soft_top, layers, progress)
    seconds["held_out_answers"] = time.perf_counter() - mark
    room = None
    if deadline is not None:
        mark = time.perf_counter()
        step_seconds = training_pace(provisional_head(checkpoint.model, layers, held_out, settings), held_out,
                                     settings, bf16)
        seconds["pace"] = time.perf_counter() - mark
        room = training_room(settings, step_seconds, deadline)
        say(progress, f"  a training step takes {step_seconds:.2f} s here: answers stop where more would leave "
                      f"fewer than {PASSES} passes over them")
    collector = copy.deepcopy(checkpoint.model).to(torch.bfloat16) if bf16 else checkpoint.model
    mark = time.perf_counter()
    say(progress, f"target answering {settings.train_prompts} training prompts ({settings.new_tokens} tokens, "
                  f"batches of {settings.generation_batch}, {'bf16' if bf16 else 'fp32'})")
    train = collect_answers(collector, encoded_prompts(checkpoint.tokenizer, settings, False),
                            settings.new_tokens, settings.generation_batch, checkpoint.eos_token_ids,
                            settings.soft_top, layers, progress, room)
    seconds["target_answers"] = time.perf_counter() - mark
    return train, held_out


def provisional_head(target: Llama, layers: tuple[int, ...], answers: list[Answer],
                     settings: FeatureDraftSettings) -> FeatureHead:
    """A head of the run's shape, only to time training steps on."""
    vocab_ids = draft_vocabulary(answers, settings.draft_vocab_size, target.shape.vocab_size, ())
    return initial_head(target, layers, vocab_ids)


def encoded_prompts(tokenizer, settings: FeatureDraftSettings, held_out: bool) -> list[list[int]]:
    count = settings.held_out_prompts if held_out else settings.train_prompts
    return [encode_prompt(tokenizer, p) for p in prompt_set(count, settings.chat_share, held_out, settings.seed)]


def save_draft_folder(head: FeatureHead, target_dir: Path, out: Path, report: dict) -> None:
    staging = out.resolve().with_name(f".{out.resolve().name}.making")
    shutil.rmtree(staging, ignore_errors=True)
    save_feature_head(head, staging)
    for name in COPIED_FILES:
        if (target_dir / name).is_file():
            shutil.copy2(target_dir / name, staging / name)
    (staging / DRAFT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def say(progress: bool, line: str) -> None:
    if progress:
        print(line, flush=True)
