"""Per-generation statistics as plain data: what a round did and where the time went."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    mode: str
    num_draft_tokens: int
    tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0  # drafts verified, over all rounds (the load policy may vary K per round)
    accepted_histogram: list[int] = field(default_factory=list)  # index a: rounds that accepted a drafts
    rounds_by_k: list[int] = field(default_factory=list)  # index k: rounds that verified k drafts
    probe_rounds: int = 0          # rounds that drafted only to measure acceptance (the policy had speculation off)
    prespeculated_rounds: int = 0  # rounds that pre-speculated their outcomes
    cache_hits: int = 0
    cache_misses: int = 0
    branches_drafted: int = 0
    # of the rounds that verified a pre-speculated draft (the branch of a hit)
    hit_rounds: int = 0
    hit_drafted: int = 0
    hit_accepted: int = 0
    prefill_s: float = 0.0
    verify_s: float = 0.0
    draft_s: float = 0.0        # drafting on the critical path (first draft, misses, plain SD)
    prespeculate_s: float = 0.0  # pre-speculation in the draft worker, overlapping verification
    wait_s: float = 0.0          # the target, done verifying, waiting for pre-speculation
    total_s: float = 0.0

    def __post_init__(self):
        if not self.accepted_histogram:
            self.accepted_histogram = [0] * (self.num_draft_tokens + 1)
        if not self.rounds_by_k:
            self.rounds_by_k = [0] * (self.num_draft_tokens + 1)

    def record_round(self, accepted: int, drafted: int | None = None, probe: bool = False,
                     prespeculated: bool = False, after_hit: bool = False) -> None:
        """`drafted`: the drafts the round verified (None: not known, as for a target that
        drafts itself); `prespeculated`: the round pre-speculated its outcomes; `after_hit`:
        its drafts are the branch a hit adopted."""
        self.rounds += 1
        self.accepted_histogram[accepted] += 1
        if drafted is not None:
            self.drafted_tokens += drafted
            self.rounds_by_k[drafted] += 1
        self.probe_rounds += probe
        self.prespeculated_rounds += prespeculated
        if after_hit:
            self.hit_rounds += 1
            self.hit_drafted += drafted or 0
            self.hit_accepted += accepted

    @property
    def accepted_tokens(self) -> int:
        return sum(a * n for a, n in enumerate(self.accepted_histogram))

    @property
    def mean_accepted(self) -> float:
        return sum(a * n for a, n in enumerate(self.accepted_histogram)) / max(self.rounds, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per drafted token (0 for autoregressive decoding)."""
        return self.mean_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def verified_acceptance(self) -> float:
        """Accepted drafts per draft verified: with K varying per round, the acceptance the
        rounds showed (0 when none verified a draft)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_k(self) -> float:
        """Drafts verified per round."""
        return self.drafted_tokens / max(self.rounds, 1)

    @property
    def prespeculated_acceptance(self) -> float:
        """Accepted per drafted token of pre-speculated drafts (a feature draft drafts
        them on its own predicted features; fresh drafts start from the target's)."""
        return self.hit_accepted / max(self.hit_drafted, 1)

    @property
    def fresh_acceptance(self) -> float:
        """Accepted per drafted token of drafts made after the round's outcome was known."""
        fresh_drafted = self.drafted_tokens - self.hit_drafted
        return (self.accepted_tokens - self.hit_accepted) / max(fresh_drafted, 1)

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hits / max(self.cache_hits + self.cache_misses, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def target_waited_for_draft_s(self) -> float:
        return self.draft_s + self.wait_s

    def as_dict(self) -> dict:
        derived = ("mean_accepted", "acceptance_rate", "verified_acceptance", "mean_k", "cache_hit_rate",
                   "tokens_per_s", "target_waited_for_draft_s", "prespeculated_acceptance", "fresh_acceptance")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class Elapsed:
    seconds: float = 0.0


@contextmanager
def stopwatch():
    """`with stopwatch() as elapsed:` ... afterwards `elapsed.seconds` is the block's time."""
    elapsed, started = Elapsed(), time.perf_counter()
    try:
        yield elapsed
    finally:
        elapsed.seconds = time.perf_counter() - started


@contextmanager
def timed(stats: GenerationStats, field: str):
    """Time a block, add it to `stats.<field>`, and hand the block's own time back."""
    with stopwatch() as elapsed:
        yield elapsed
    setattr(stats, field, getattr(stats, field) + elapsed.seconds)
