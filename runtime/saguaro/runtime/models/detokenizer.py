"""Incremental detokenisation that never splits a multi-byte character, with no state.

A streamed generation reaches the text side one round of tokens at a time. A byte-level
tokenizer can end a round halfway through a UTF-8 character; decoding that round alone
would print replacement characters. So each chunk travels with a short window of the
tokens before it (`prefix_window`), and `text_delta` returns the text those new tokens
add, holding back a trailing incomplete character until a later chunk completes it (or
the final chunk flushes it). The window makes every call independent, which is what a
stateless Triton postprocessing model needs: it keeps nothing between responses.
"""
from __future__ import annotations

from typing import Callable

# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; a few more keep
# tokenizers whose decoding depends on neighbours (leading-space rules) consistent.
PREFIX_TOKENS = 8
REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete or invalid byte sequence

Decode = Callable[[list[int]], str]


def prefix_window(generated: list[int], start: int) -> list[int]:
    """The tokens just before `generated[start:]` that a stateless decoder needs."""
    return list(generated[max(0, start - PREFIX_TOKENS):start])


def stable_text(text: str) -> str:
    """Text minus a trailing replacement character, which a later token may complete.

    A truncated character decodes to exactly one replacement character, so only one is
    held back; a run of invalid bytes before it is final and stays.
    """
    return text[:-1] if text.endswith(REPLACEMENT) else text


def common_prefix_length(a: str, b: str) -> int:
    length = 0
    for left, right in zip(a, b):
        if left != right:
            break
        length += 1
    return length


def text_delta(decode: Decode, prefix_ids: list[int], new_ids: list[int], final: bool) -> str:
    """The text `new_ids` add after `prefix_ids` (held-back characters included)."""
    shown = stable_text(decode(list(prefix_ids))) if prefix_ids else ""
    text = decode(list(prefix_ids) + list(new_ids))
    if not final:
        text = stable_text(text)
    if text.startswith(shown):
        return text[len(shown):]
    # A decoder that rewrites earlier text (space clean-up) breaks the prefix property;
    # emit from where the two decodings part rather than duplicate what was shown.
    return text[common_prefix_length(shown, text):]


def stream_text(decode: Decode, chunks: list[list[int]]) -> str:
    """What a client sees when `chunks` stream through `text_delta` one at a time."""
    generated: list[int] = []
    pieces = []
    for index, chunk in enumerate(chunks):
        prefix = prefix_window(generated, len(generated))
        pieces.append(text_delta(decode, prefix, chunk, final=index == len(chunks) - 1))
        generated += chunk
    return "".join(pieces)
