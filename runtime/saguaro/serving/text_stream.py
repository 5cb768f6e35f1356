"""A generation's token ids as the text a client reads, with text-level stop strings.

The HTTP front end gets each decoding round's token ids and turns them into text the way
the postprocessing model does (`detokenizer.text_delta`: never half a character). Stop
strings are matched on that text, not on token ids, because a string can be spelled by
many token sequences. While a stop string may still be forming, the text that could be
its beginning is held back, so a client never receives part of a stop string; once one
appears, the text ends just before it (as OpenAI's API and vLLM do) and the generation
can be cancelled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro.runtime.models.detokenizer import Decode, prefix_window, text_delta


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in `text` (None: nowhere)."""
    starts = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(starts) if starts else None


@dataclass
class TextStream:
    """Feed it each round's ids (`add`); it returns the text the client may see now."""

    decode: Decode
    stops: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every id received (the stop's own tokens included)
    pending: str = ""      # decoded, not yet released: it may begin a stop string
    stopped: bool = False  # a stop string appeared; nothing more is released
    tokens_to_stop: int | None = None  # ids up to the one that completed the stop string

    def add(self, new_ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        start = len(self.ids)
        self.ids += new_ids
        self.pending += text_delta(self.decode, prefix_window(self.ids, start), list(new_ids), final)
        cut = first_stop(self.pending, self.stops)
        if cut is not None:
            self.stopped = True
            self.tokens_to_stop = self.stop_token_count(start)
            released, self.pending = self.pending[:cut], ""
            return released
        keep = 0 if final else held_back(self.pending, self.stops)
        released, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return released

    def stop_token_count(self, start: int) -> int:
        """The fewest ids whose text already holds a stop string (checked from `start`)."""
        for end in range(start + 1, len(self.ids) + 1):
            if first_stop(self.decode(self.ids[:end]), self.stops) is not None:
                return end
        return len(self.ids)

    @property
    def completion_tokens(self) -> int:
        """Tokens the completion cost: up to the stop string's last token, if one stopped it."""
        return self.tokens_to_stop if self.tokens_to_stop is not None else len(self.ids)
