"""A feature head measured on held-out answers: greedy agreement per token (true
features), the mean accepted length at K (each round drafts K tokens on the head's own
features and counts the prefix the target's greedy answer agrees with), its cost per
step against the target's (batch 1, one thread), and the weights a step reads."""
from __future__ import annotations

import statistics
import time

import torch

from saguaro.modelmaker.feature_answers import Answer
from saguaro.modelmaker.feature_chains import batch_of, unrolled
from saguaro.runtime.models.feature_head import FeatureHead
from saguaro.runtime.models.llama import Llama


@torch.no_grad()
def acceptance(head: FeatureHead, answers: list[Answer], k: int, batch: int = 8) -> dict:
    """Agreement per continuation token on true features, and the accepted lengths of
    greedy rounds of K drafts, each drafted on the head's own features."""
    head.eval()
    flat, lengths = [], []
    for first in range(0, len(answers), batch):
        group = answers[first:first + batch]
        packed = batch_of(group, k, 1)
        guesses = [head.target_ids()[head.draft_logits(h).argmax(-1)] for h in unrolled(head, packed, k)]
        for row, a in enumerate(group):
            matches = [(guesses[j][row] == packed.ids[row, 2 + j:2 + j + packed.width]).tolist() for j in range(k)]
            flat += matches[0][max(a.start, 2) - 2:len(a.ids) - 2]  # element e predicts position e + 2
            lengths += round_lengths(matches, a, k)
    rounds = max(1, len(lengths))
    return {"k": k, "prompts": len(answers), "prompt_tokens": sum(a.start for a in answers) // len(answers),
            "new_tokens": max(len(a.continuation) for a in answers), "tokens_scored": len(flat),
            "agreement": sum(flat) / max(1, len(flat)), "rounds": len(lengths),
            "mean_accepted": sum(lengths) / rounds,
            "accepted_histogram": [lengths.count(a) / rounds for a in range(k + 1)]}


def round_lengths(matches: list[list[bool]], answer: Answer, k: int) -> list[int]:
    """Replay greedy rounds along one answer: a round whose bonus token is at position i
    drafts from element i - 1, and draft j matches if it equals the token at i + j. A
    round the answer does not decide (all matched, fewer than K tokens left) is left out."""
    lengths, position, end = [], answer.start, len(answer.ids)
    while (available := min(k, end - 1 - position)) > 0:
        window = [matches[j][position - 1] for j in range(available)]
        accepted = window.index(False) if False in window else available
        if accepted == available < k:
            break
        lengths.append(accepted)
        position += accepted + 1
    return lengths


def step_seconds(head: FeatureHead, target: Llama, context: int = 128, repeats: int = 15) -> dict:
    """Median seconds of one decode step at batch 1 and one thread, after `context`
    cached entries: the target's, and the head's (fc projection included)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        token, mask = torch.tensor([[1]]), torch.ones(1, 1, context + 1, dtype=torch.bool)
        at, one = torch.tensor([[context]]), torch.ones(1, dtype=torch.long)
        layers, heads, dim = target.shape.kv_shape
        target_kv = torch.zeros(layers, 2, 1, heads, context + 1, dim)
        head_kv = torch.zeros(1, 2, 1, head.shape.num_kv_heads, context + 1, head.shape.head_dim)
        features = torch.randn(1, 1, head.shape.feature_width)

        def target_step():
            target.forward_packed(target_kv, token, at, at[0], one, mask)

        def head_step():
            with torch.inference_mode():
                head.forward_packed(head_kv, token, head.project(features), at, at[0], one, mask)

        seconds = {"target": median_seconds(target_step, repeats), "draft": median_seconds(head_step, 4 * repeats)}
    finally:
        torch.set_num_threads(previous)
    return {**{key: round(value, 5) for key, value in seconds.items()},
            "ratio": round(seconds["draft"] / seconds["target"], 4), "context": context, "threads": 1}


def median_seconds(run, repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        mark = time.perf_counter()
        run()
        times.append(time.perf_counter() - mark)
    return statistics.median(times)


def head_decode_cost(head: FeatureHead) -> int:
    """Weights read per drafting step: everything but the shared embedding (a lookup)."""
    return sum(p.numel() for p in head.parameters())
