"""What the load policy plans for each request of a round, and what the round reports
back: the decoder fills a `RoundReport` once per round and hands it to the load policy and
to the servers' round observers (their metrics read the same report)."""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro.runtime.control.acceptance import Acceptance


@dataclass
class Plan:
    """What a round does for one request: drafts to verify, whether to pre-speculate
    their outcomes, and the branches it may use."""

    draft_tokens: int
    prespeculate: bool = True
    branches: int | None = None  # None: as many as the request's fan-out places
    quiet: int = 0               # rounds in a row, this one included, that the policy had it draft nothing
    probe: bool = False          # drafts only so that acceptance is measured (speculation is off)
    rejected_probes: int = 0     # probes in a row, since speculation was last on, that accepted nothing
    undrafted: str | None = None  # K = 0 for a request that may draft: why (UNDRAFTED_REASONS)
    # drafts a round that n-gram matches lead may verify (`EngineInfo.ngram_lead`), priced
    # apart from the model's: such a round runs no forward of the draft
    matched_tokens: int = 0


# Why a round drafted nothing, the most telling first: the clock overruled the model's
# choice (a veto, or one of the rounds that keep speculation off measured), a choice of K = 0
# for all held through joins and leaves (`_quiet_holds`), the model priced every K below
# K = 0; "asked": no request in it may draft (each pinned K = 0, or has no room left).
UNDRAFTED_REASONS = ("clock", "held", "priced", "asked")


def undrafted_reason(plans) -> str | None:
    """Why a round with these plans drafted nothing (`UNDRAFTED_REASONS`); None: it drafted."""
    if any(plan.draft_tokens for plan in plans):
        return None
    reasons = {plan.undrafted for plan in plans}
    return next((reason for reason in UNDRAFTED_REASONS if reason in reasons), "asked")


def verify_size(widths: list[int], padded: bool) -> int:
    """The size a verification of rows of `widths` tokens costs as: the tokens fed, or
    for a target that pads rows to the widest (`EngineInfo.pads_rows`), rows x that width."""
    return len(widths) * max(widths, default=0) if padded else sum(widths)


@dataclass
class SequenceRound:
    """One request's part of a round: its acceptance counts, the drafts verified and
    accepted, and the speculation-cache lookup (None: it pre-speculated nothing)."""

    acceptance: Acceptance
    greedy: bool
    verified: int
    accepted: int
    hit: bool | None = None
    asked: int | None = None  # drafts asked for that the draft could have proposed (None: `verified`)
    matched: bool = False     # its drafts were n-gram matches (`acceptance` is then the matches')


@dataclass
class RoundReport:
    """What one round of the decoding loop measured, handed to its observers at once."""

    requests: int
    verified_tokens: int                  # the verification's size (`verify_size`)
    verify_s: float
    alone: bool                           # verified on the wide session, nothing beside it
    wait_s: float = 0.0                   # for the draft worker after the verification
    draft_s: float = 0.0                  # ordinary drafting on the critical path
    # ordinary drafting's steps: (requests, steps, seconds, seconds of the forwards after the first)
    drafting: tuple[int, int, float, float] | None = None
    prespeculation: tuple[int, int, float] | None = None  # (branch rows, steps, seconds)
    sequences: list[SequenceRound] = field(default_factory=list)
    undrafted: str | None = "asked"       # why no request drafted (`undrafted_reason`); None: some did
    host_s: float = 0.0                   # what the round took beyond its forwards and waits
    caught_up: bool = False               # some draft cache first fed the tokens of a stretch without drafts

    @property
    def drafted(self) -> bool:
        return self.undrafted is None

    @property
    def matched(self) -> bool:
        """Some request verified n-gram matches, which the load policy priced apart."""
        return any(sequence.matched for sequence in self.sequences)
