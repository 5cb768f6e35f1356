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
    """Counts of drafts verified and accepted at each depth 1..K, of the drafts asked for
    and proposed at each depth (a draft that may propose fewer than asked: the n-gram
    draft stops where nothing matches), and of cache lookups; with `fading` < 1 older
    rounds count less (shared counts follow the workload). A round that asked for no
    drafts tells nothing and fades nothing: with speculation off the estimate stays what
    the last drafts showed, until a probe measures it again."""

    verified: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    asked: list[float] = field(default_factory=list)     # asked[d]: rounds whose draft reached depth d, asked for more
    proposed: list[float] = field(default_factory=list)  # ... and proposed the draft at depth d + 1
    hits: float = 0.0
    lookups: float = 0.0
    fading: float = 1.0
    last: tuple[int, int] = (0, 0)  # the last round's (verified, accepted)

    def record(self, verified: int, accepted: int, asked: int | None = None) -> None:
        """A round's drafts: `verified` of the `asked` (default: as many as verified) were
        proposed and verified, `accepted` of them accepted."""
        self.last = (verified, accepted)
        asked = verified if asked is None else max(asked, verified)
        if not asked:
            return
        if self.fading < 1:
            for counts in (self.verified, self.accepted, self.asked, self.proposed):
                counts[:] = [self.fading * count for count in counts]
        grow(self.verified, self.accepted, length=verified)
        for depth in range(verified):
            if depth > accepted:
                break
            self.verified[depth] += 1
            self.accepted[depth] += depth < accepted
        grow(self.asked, self.proposed, length=min(asked, verified + 1))
        for depth in range(min(asked, verified + 1)):
            self.asked[depth] += 1
            self.proposed[depth] += depth < verified

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

    def proposal_rates(self, depths: int, priors: list[float] | None = None) -> list[float]:
        """P(the draft proposes a token at depth d + 1 | it proposed the d before), d <
        `depths`, smoothed toward `priors` (default 1: a model proposes every token asked)."""
        rates = []
        for depth in range(depths):
            seen = self.asked[depth] if depth < len(self.asked) else 0.0
            made = self.proposed[depth] if depth < len(self.proposed) else 0.0
            prior = priors[depth] if priors else 1.0
            rates.append((made + PRIOR_WEIGHT * prior) / (seen + PRIOR_WEIGHT))
        return rates

    def hit_rate(self, prior: float) -> float:
        return (self.hits + PRIOR_WEIGHT * prior) / (self.lookups + PRIOR_WEIGHT)


def grow(*counts: list[float], length: int) -> None:
    """Extend each list of counts with zeros to at least `length`."""
    for values in counts:
        values.extend([0.0] * (length - len(values)))
