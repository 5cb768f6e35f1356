"""Random verification rounds, shared by the tests of every fused-verification form."""
from __future__ import annotations

import torch


def random_round(generator, k, vocab, drafts_are_argmax):
    """Target logits, draft tokens (random, or the target's argmax), q, uniforms."""
    logits = torch.randn(k + 1, vocab, generator=generator) * 3
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 2, dim=-1)
    if drafts_are_argmax:
        drafts = logits[:k].argmax(-1)
    else:
        drafts = torch.multinomial(q, 1, generator=generator).view(k) if k else torch.zeros(0, dtype=torch.int64)
    return logits, drafts, q, torch.rand(k + 1, generator=generator)
