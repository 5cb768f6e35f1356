"""How often the draft guesses the target's greedy tokens, on held-out prompts.

The target continues each prompt greedily; the draft is then teacher-forced along that
path, and each position records whether the draft's argmax equals the target's token.
Greedy speculative decoding with draft length K accepts exactly the run of such matches
(up to K) from where a round starts, then adds the target's bonus token: a round that
accepts `a` drafts moves `a + 1` tokens ahead. Replaying those rounds over the recorded
matches gives the accepted-length distribution without running a speculative decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast


@dataclass(frozen=True)
class AcceptanceSettings:
    prompt_tokens: int = 32
    new_tokens: int = 64
    max_prompts: int = 32
    k: int = 4  # draft length the accepted-length figures are for


def held_out_prompts(
    tokenizer: PreTrainedTokenizerFast, texts: list[str], prompt_tokens: int, max_prompts: int
) -> torch.Tensor:
    """Up to `max_prompts` consecutive `prompt_tokens`-long windows of the held-out texts:
    first every text's opening window (`<s>` + its first tokens), then every text's second
    window, and so on."""
    documents = [tokenizer.encode(text) for text in texts]  # prepends <s>
    windows: list[list[int]] = []
    offset = 0
    while len(windows) < max_prompts and any(len(d) >= offset + prompt_tokens for d in documents):
        for ids in documents:
            if len(ids) >= offset + prompt_tokens and len(windows) < max_prompts:
                windows.append(ids[offset : offset + prompt_tokens])
        offset += prompt_tokens
    return torch.tensor(windows, dtype=torch.long)


@torch.no_grad()
def greedy_continuations(
    target: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int
) -> list[torch.Tensor]:
    """The target's greedy continuation of each prompt, ending at (and keeping) `</s>`."""
    generated = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=target.config.pad_token_id,
    )
    eos_id = target.config.eos_token_id
    continuations = []
    for row in generated[:, prompts.shape[1] :]:
        ends = (row == eos_id).nonzero()
        continuations.append(row[: int(ends[0]) + 1] if len(ends) else row)
    return continuations


@torch.no_grad()
def draft_matches(
    draft: LlamaForCausalLM, prompt: torch.Tensor, continuation: torch.Tensor
) -> torch.Tensor:
    """Per continuation token: does the draft's argmax, given everything before it, equal it?"""
    path = torch.cat([prompt, continuation]).unsqueeze(0)
    logits = draft(input_ids=path[:, :-1]).logits[0]
    guesses = logits[len(prompt) - 1 :].argmax(-1)  # the rows that predict the continuation
    return guesses == continuation


def accepted_lengths(matches: list[bool], k: int) -> list[int]:
    """Accepted draft count of each greedy speculative round replayed along one path.

    A round starting at position i accepts the run of matches from i, capped at k; the
    next round starts after the bonus token. A round whose outcome the path does not
    determine (all matches, but fewer than k positions left) is not counted."""
    lengths = []
    start = 0
    while start < len(matches):
        window = matches[start : start + k]
        accepted = window.index(False) if False in window else len(window)
        if accepted == len(window) < k:
            break
        lengths.append(accepted)
        start += accepted + 1
    return lengths


def summarize(matches: list[list[bool]], k: int, prompt_tokens: int, new_tokens: int) -> dict:
    flat = [m for path in matches for m in path]
    lengths = [a for path in matches for a in accepted_lengths(path, k)]
    rounds = max(1, len(lengths))
    return {
        "k": k,
        "prompts": len(matches),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "tokens_scored": len(flat),
        "agreement": sum(flat) / max(1, len(flat)),
        "rounds": len(lengths),
        "mean_accepted": sum(lengths) / rounds,
        "accepted_histogram": [lengths.count(a) / rounds for a in range(k + 1)],
    }


def measure_acceptance(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    held_out_texts: list[str],
    settings: AcceptanceSettings,
) -> dict:
    target.eval()
    draft.eval()
    prompts = held_out_prompts(
        tokenizer, held_out_texts, settings.prompt_tokens, settings.max_prompts
    )
    paths = greedy_continuations(target, prompts, settings.new_tokens)
    matches = [
        draft_matches(draft, prompt, path).tolist() for prompt, path in zip(prompts, paths)
    ]
    return summarize(matches, settings.k, settings.prompt_tokens, settings.new_tokens)


def format_acceptance(report: dict) -> str:
    histogram = " / ".join(f"{share:.2f}" for share in report["accepted_histogram"])
    return (
        f"greedy agreement {report['agreement']:.3f} per token over {report['tokens_scored']} "
        f"tokens ({report['prompts']} held-out prompts); at K={report['k']}: mean accepted "
        f"{report['mean_accepted']:.2f}, accepted 0..{report['k']}: {histogram}"
    )
