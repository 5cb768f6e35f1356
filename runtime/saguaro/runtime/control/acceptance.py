"""Acceptance counts: how often a draft's tokens were accepted at each depth, and how often
a pre-speculated branch was the outcome, per request and shared by the requests of a kind
(greedy or sampled); the load policy's estimates of both, smoothed toward a prior."""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_WEIGHT = 8.0                # pseudo-rounds of the shared estimate in a request's own
# Before anything was measured: optimistic about acceptance, so that the first rounds
# draft and measure it.
UNSEEN_ACCEPTANCE = 0.8


@dataclass
class Acceptance:
    """Counts of drafts verified and accepted at each depth 1..K, and of cache lookups;
    with `fading` < 1 older rounds count less (shared counts follow the workload). A round
    that verified no drafts tells nothing and fades nothing: with speculation off the
    estimate stays what the last drafts showed, until a probe measures it again."""

    verified: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    hits: float = 0.0
    lookups: float = 0.0
    fading: float = 1.0
    last: tuple[int, int] = (0, 0)  # the last round's (verified, accepted)

    def record(self, verified: int, accepted: int) -> None:
        self.last = (verified, accepted)
        if not verified:
            return
        if self.fading < 1:
            self.verified = [self.fading * v for v in self.verified]
            self.accepted = [self.fading * a for a in self.accepted]
        while len(self.verified) < verified:
            self.verified.append(0.0)
            self.accepted.append(0.0)
        for depth in range(verified):
            if depth > accepted:
                break
            self.verified[depth] += 1
            self.accepted[depth] += depth < accepted

    def record_lookup(self, hit: bool) -> None:
        self.hits, self.lookups = self.fading * self.hits + hit, self.fading * self.lookups + 1

    def rate(self, depth: int, prior: float) -> float:
        """P(accept the draft at `depth` + 1 | the ones before accepted), smoothed toward `prior`."""
        seen = self.verified[depth] if depth < len(self.verified) else 0.0
        taken = self.accepted[depth] if depth < len(self.accepted) else 0.0
        return (taken + PRIOR_WEIGHT * prior) / (seen + PRIOR_WEIGHT)

    def rates(self, depths: int, priors: list[float] | None = None) -> list[float]:
        """`rate` at depths 0..depths-1; a depth seen little leans on `priors`, or else on
        the depth before it (drafts a policy rarely verifies that deep are not assumed bad)."""
        rates: list[float] = []
        for depth in range(depths):
            prior = priors[depth] if priors else (rates[-1] if rates else UNSEEN_ACCEPTANCE)
            rates.append(self.rate(depth, prior))
        return rates

    def hit_rate(self, prior: float) -> float:
        return (self.hits + PRIOR_WEIGHT * prior) / (self.lookups + PRIOR_WEIGHT)
