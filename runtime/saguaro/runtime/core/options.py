"""Decoding options, validated before any work starts; errors name the offending value.

`DecodeOptions` is the one home of every decoding default (K, fan-out, mode, length):
command lines and the server read their defaults from it. `parse_fanout` and
`parse_budget` are the one parser of each knob's text form ("3" or "3,3,2,1,1"; "8" or
"auto"), shared by every command line and by the serving configuration.
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.runtime.control.budget import OnlineBudget, StaticFanout
from saguaro.runtime.core.sampling import SaguaroSampling, SamplingParams

MODES = ("autoregressive", "speculative", "ssd")
# what drafts: the engine folder's or checkpoint's draft model | n-gram matching over the
# sequence's own tokens (`engines.ngram_draft`: no draft model) | the matches in the rounds
# they lead, the draft model in the others (`decoding.speculator.Speculator.match`)
DRAFT_METHODS = ("model", "ngram", "ngram+model")
NO_MODEL_METHOD = "ngram"
DEFAULT_FANOUT = (3,)  # the official code's static default: 3 candidates at every depth
AUTO_BUDGET_CAP = 16   # budget "auto": the load policy sizes B each round, up to 16 (or the engines' built maximum)


def uses_draft_model(draft_method: str) -> bool:
    return draft_method != NO_MODEL_METHOD


@dataclass(frozen=True)
class DecodeOptions:
    """A request's decoding knobs. The library default pins K (`adapt_k` False), so a caller
    gets the K it asks for and a seed replays exactly; the command lines and the servers
    turn the load policy on (their `--fixed-k` pins K)."""

    mode: str = "ssd"
    num_draft_tokens: int = 4
    fanout: tuple[int, ...] = DEFAULT_FANOUT  # F_j: one value for every depth, or K+1 values
    budget: int | str | None = None           # instead of fanout: B branches placed online;
                                              # "auto": the load policy sizes B each round
    saguaro_factor: float | None = None       # Saguaro sampling (temperature > 0) when set
    saguaro_top: int = max(DEFAULT_FANOUT) + 1  # ... scaling the draft's `saguaro_top` likeliest tokens
    prespeculate: bool = True                 # ssd only; off reduces ssd to speculative
    adapt_k: bool = False                     # True: K per round from the load policy, up
                                              # to num_draft_tokens (load_policy); the
                                              # command lines and the server turn it on.
                                              # Sampled output follows the target's law
                                              # for every K, but a seed replays exactly
                                              # only when the same K are chosen: pin K
                                              # (False, --fixed-k) for exact replay
    max_tokens: int = 64
    eos_token_id: int | None = None           # None: the model's; -1: never stop early

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"decoding mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if not (isinstance(self.num_draft_tokens, int) and self.num_draft_tokens >= 0):
            raise ValueError(f"num_draft_tokens (K) must be an integer >= 0, got {self.num_draft_tokens!r}")
        if not (self.fanout and all(isinstance(f, int) and f >= 0 for f in self.fanout)):
            raise ValueError(f"fanout must be integers >= 0, got {self.fanout!r}")
        if len(self.fanout) not in (1, self.num_draft_tokens + 1):
            raise ValueError(f"fanout needs 1 or K+1 = {self.num_draft_tokens + 1} values, got {list(self.fanout)}")
        if self.budget not in (None, "auto") and not (isinstance(self.budget, int) and self.budget >= 1):
            raise ValueError(f"budget must be an integer >= 1 or 'auto', got {self.budget!r}")
        SaguaroSampling(top=self.saguaro_top, factor=1.0 if self.saguaro_factor is None else self.saguaro_factor)
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    @property
    def draft_tokens(self) -> int:
        """K as the loops use it: autoregressive decoding drafts nothing."""
        return 0 if self.mode == "autoregressive" else self.num_draft_tokens

    @property
    def prespeculating(self) -> bool:
        """A fan-out of all zeros places no branch: nothing to pre-speculate (speculative
        decoding, as with prespeculate off)."""
        places_branches = self.budget is not None or any(self.fanout)
        return self.mode == "ssd" and self.prespeculate and self.num_draft_tokens > 0 and places_branches

    @property
    def adapts(self) -> bool:
        """Its K per round is the load policy's: `adapt_k`, for a request that may draft (an
        autoregressive one, or one of K = 0, leaves the policy nothing to choose, though the
        servers' default turns `adapt_k` on for every request that does not name its K)."""
        return self.adapt_k and self.draft_tokens > 0

    @property
    def steered(self) -> bool:
        """The load policy decides something for it: its K (`adapts`), or the size of its
        "auto" budget (and, with either, whether a round pre-speculates)."""
        return self.adapts or (self.budget == "auto" and self.draft_tokens > 0)

    def fanout_policy(self, max_branches: int | None = None) -> StaticFanout | OnlineBudget:
        """Where the branches go; `max_branches` (the engines' limit) caps an "auto" budget,
        whose size each round is the load policy's."""
        if self.budget is not None:
            budget = min(AUTO_BUDGET_CAP, max_branches or AUTO_BUDGET_CAP) if self.budget == "auto" else self.budget
            assert isinstance(budget, int)  # validated: an int >= 1 or "auto"
            return OnlineBudget(budget, self.num_draft_tokens)
        return StaticFanout(list(self.fanout), self.num_draft_tokens)

    def saguaro(self, sampling: SamplingParams) -> SaguaroSampling | None:
        """Saguaro rescaling of the draft's `saguaro_top` likeliest tokens (by default the
        default fan-out's keys plus the draft's own pick). A fixed number, not the fan-out
        or budget: q, and so the sampled text for a seed, must not depend on how many
        branches are pre-speculated. Greedy decoding has nothing to rescale."""
        if self.saguaro_factor is None or sampling.greedy:
            return None
        return SaguaroSampling(top=self.saguaro_top, factor=self.saguaro_factor)


def parse_fanout(text: str) -> tuple[int, ...]:
    """"3" (every depth) or "3,3,2,1,1" (one value per depth 0..K)."""
    try:
        fanout = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"fanout takes integers like 3 or 3,3,2,1,1; got {text!r}") from None
    if any(f < 0 for f in fanout):
        raise ValueError(f"fanout values must be >= 0; got {text!r}")
    return fanout


def parse_budget(text: str) -> int | str:
    """A number of branches, or "auto"."""
    if str(text).strip() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"budget takes an integer or 'auto'; got {text!r}") from None


def hidden_branch_options(hidden_branches: int | None, num_draft_tokens: int) -> dict:
    """The `DecodeOptions` branch fields that spend an engine's hidden budget
    (`EngineInfo.hidden_budget(K)`: the branches whose pre-speculation fits under one
    verify): the same fan-out F = B // (K+1) at every depth when that places a branch at
    each, else B placed online where hits are likeliest, none when B is 0 (pre-speculation
    would only make the target wait); the default fan-out when B was never measured."""
    if hidden_branches is None:
        return {"fanout": DEFAULT_FANOUT, "budget": None}
    per_depth = hidden_branches // (num_draft_tokens + 1)
    if per_depth >= 1:
        return {"fanout": (per_depth,), "budget": None}
    if hidden_branches >= 1:
        return {"fanout": DEFAULT_FANOUT, "budget": hidden_branches}
    return {"fanout": (0,), "budget": None}


class LimitError(ValueError):
    """A request past what the engines were built for; the message names the input."""


def check_engine_limits(options: DecodeOptions, max_draft_tokens: int | None, max_branches: int | None,
                        draft_name: str = "--num-draft-tokens", branches_name: str = "--fanout/--budget",
                        hint: str = "lower --fanout or --budget") -> None:
    """The one check of K and the branches a request places against the engines' built
    maximums (None: not bounded), before any work."""
    if max_draft_tokens is not None and options.draft_tokens > max_draft_tokens:
        raise LimitError(f"{draft_name}: {options.draft_tokens} draft tokens exceed the engines' built maximum "
                         f"{max_draft_tokens}")
    wanted = options.fanout_policy(max_branches).max_branches
    if max_branches is not None and options.prespeculating and wanted > max_branches:
        raise LimitError(f"{branches_name}: {wanted} branches exceed the engines' built maximum {max_branches} "
                         f"({hint})")
