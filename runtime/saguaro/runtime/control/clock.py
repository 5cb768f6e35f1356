"""Speculation checked by the clock: committed tokens per second of wall time, for the
rounds the load policy let draft and the rounds it did not, by batch size.

The policy's model prices a round from measured curves (verification, draft steps, host
work), and a drafting round's own price is checked against what the round took
(`costs.Misprediction`). What neither sees is the time between rounds: the scheduler's
joins and leaves, the server's threads that detokenise and send each response, whatever
holds the interpreter while a round waits to start. Through the server at 4 streams (the
bench pair, w8a8) the model chose K = 1-2 in most rounds and SSD ran at 0.93-0.94x
batched autoregressive decoding; in one process the same engines drafted in 3-7% of
rounds. So a round's period is measured from its start to the next round's start (a
period in which requests joined is left out: its prefill belongs to neither kind, and so
is a round whose drafts first fed what a draft cache lacked after a stretch without drafts:
at one stream on the bench pair, short bursts of drafting after such stretches put the
drafting rate at 131-191 tok/s against 197-204 without drafts, and drafting was vetoed for
256 rounds; its steady rounds then measured 206-241), and
where the rounds that drafted committed fewer tokens per second than the rounds that
did not, at the same batch size, by more than the two rates' standard error (a drafting
round commits 1 to K + 1 tokens a request, so a few rounds' rate is noisy: at one stream on
the bench pair a fresh process's first nine drafting rounds, three of them accepting 0 or
1 of 4 drafts, measured 282 tok/s against 331 without drafts, and drafting was vetoed for
the 256 rounds of most of the first requests, where it ran at 430-530 tok/s after),
speculation is turned off there for `VETO_ROUNDS` rounds; then the model's choice runs
again for `RETRY_ROUNDS`, so that drafting is measured afresh. While drafting, one round
in `UNDRAFTED_EVERY` at a batch size drafts nothing, so that the other side of the
comparison stays measured too (on the bench pair at one stream, where SSD runs at 1.2x,
that round costs about half a percent); one in `UNMEASURED_EVERY` until it is measured
there (once drafting is), so that the clock can judge within the first hundred rounds at
a batch size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

CLOCK_FADING = 0.97    # weight of the earlier rounds of a kind after each new one
CLOCK_MEASURED = 8.0   # rounds of each kind (fading) before the clock overrules the model
UNDRAFTED_EVERY = 32   # while drafting at a batch size, one round in this many drafts nothing ...
UNMEASURED_EVERY = 4   # ... one in this many until speculation off is measured there
VETO_ROUNDS = 256      # rounds speculation stays off at a batch size where it measured slower ...
RETRY_ROUNDS = 16      # ... before the model's choice is measured again for this many


@dataclass
class Rate:
    """Committed tokens over seconds of the rounds of one kind, older rounds fading; with
    the sums its standard error needs."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0
    squares: tuple[float, float, float] = (0.0, 0.0, 0.0)  # sums of tokens², tokens x seconds, seconds²
    weight_squares: float = 0.0  # the sum of each round's weight squared (it fades twice as fast)

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = CLOCK_FADING * self.tokens + tokens
        self.seconds = CLOCK_FADING * self.seconds + seconds
        self.rounds = CLOCK_FADING * self.rounds + 1
        tokens_2, tokens_seconds, seconds_2 = self.squares
        self.squares = (CLOCK_FADING * tokens_2 + tokens * tokens, CLOCK_FADING * tokens_seconds + tokens * seconds,
                        CLOCK_FADING * seconds_2 + seconds * seconds)
        self.weight_squares = CLOCK_FADING ** 2 * self.weight_squares + 1

    @property
    def measured(self) -> bool:
        return self.rounds >= CLOCK_MEASURED and self.seconds > 0

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def variance(self) -> float:
        """Of `per_second`, a ratio of weighted sums: the rounds' mean squared residual
        (tokens - rate x seconds) times the sum of squared weights, over seconds squared."""
        rate = self.per_second
        tokens_2, tokens_seconds, seconds_2 = self.squares
        residual = max(tokens_2 - 2 * rate * tokens_seconds + rate * rate * seconds_2, 0.0) / self.rounds
        return residual * self.weight_squares / (self.seconds * self.seconds)


@dataclass
class SizeClock:
    """The rounds of one batch size: both kinds' rates and where the check stands."""

    drafting: Rate = field(default_factory=Rate)
    undrafted: Rate = field(default_factory=Rate)
    drafting_rounds: int = 0  # rounds let draft since the last one that measured speculation off
    vetoed: int = 0           # rounds speculation stays off
    retrying: int = 0         # rounds the model's choice runs again, measured

    @property
    def losing(self) -> bool:
        """Drafting measured slower than drafting nothing beyond the noise of either rate,
        both measured enough."""
        if not (self.drafting.measured and self.undrafted.measured):
            return False
        noise = math.sqrt(self.drafting.variance + self.undrafted.variance)
        return self.drafting.per_second + noise < self.undrafted.per_second

    def allows(self) -> bool:
        """Whether this round, one its model chose to draft in, may: not while a veto holds,
        nor where drafting measured slower (a veto starts), nor in a round that measures
        speculation off."""
        if self.retrying:
            self.retrying -= 1
            return True
        if self.vetoed:
            self.vetoed -= 1
            self.retrying = 0 if self.vetoed else RETRY_ROUNDS
            return False
        if self.losing:
            self.vetoed = VETO_ROUNDS - 1
            return False
        self.drafting_rounds += 1
        if not self.drafting.measured:  # nothing to compare yet (nor ever, where no period is reported)
            return True
        if self.drafting_rounds >= (UNDRAFTED_EVERY if self.undrafted.measured else UNMEASURED_EVERY):
            self.drafting_rounds = 0
            return False
        return True


class ClockCheck:
    """The load policy asks `allows(requests)` of each round its model chose to draft in,
    says what each round counts as (`counts`) and what it committed (`committed`); the
    decoder reports the round's period (`observe_period`)."""

    def __init__(self) -> None:
        self.sizes: dict[int, SizeClock] = {}
        self._kind: bool | None = None  # this round drafts, as the clock counts it; None: not its to check
        self._pending: tuple[int, bool, int] | None = None  # the last round: requests, kind, tokens

    def allows(self, requests: int) -> bool:
        """Whether a round of `requests` may draft as the model chose."""
        return self.sizes.setdefault(requests, SizeClock()).allows()

    def counts(self, drafted: bool | None) -> None:
        """This round counts as drafting (or not); None: the clock does not judge it (every
        request pinned its own K, or its drafts first caught up a draft cache)."""
        self._kind = drafted

    def committed(self, requests: int, tokens: int) -> None:
        """The round of `requests` committed `tokens`; its period comes next."""
        self._pending = None if self._kind is None else (requests, self._kind, tokens)

    def observe_period(self, seconds: float) -> None:
        """The last round's period, from its start to the next round's."""
        if self._pending is not None:
            self.observe(*self._pending, seconds)
            self._pending = None

    def observe(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A round of `requests` that drafted (or not) committed `tokens` in `seconds`,
        from its start to the next round's."""
        if seconds <= 0:
            return
        size = self.sizes.setdefault(requests, SizeClock())
        (size.drafting if drafted else size.undrafted).observe(tokens, seconds)
