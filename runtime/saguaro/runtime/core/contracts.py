"""The contracts between the decoding loops and the engines under them, in one place.

An engine runs one model over KV caches it allocates, one per sequence (a "slot" of its
cache pool). `forward_batch` runs several sequences in one batched forward: each `Step`
appends its own tokens, at its own positions, under its own attention mask (causal when
none is given; a tree mask for draft branches), to its own cache, and gets its own
logits. `verify_batch` does the same for verification rounds and runs the fused
verification op on each, so only the outcomes `(accepted, bonus)` leave the engine;
`plan_branches` runs the branch-keyed drafting op. Caches truncate (roll back), gather
(commit a branch), fork and release their slot. `forward` and `verify` are the
one-sequence forms. Implementations: `engines/torch_engine.py` (eager reference),
`engines/onnxruntime_engine.py` and `engines/tensorrt_engine.py` (compiled engines).

A `RequestTarget` is the other kind of target: one that runs whole generations itself
and asks a drafter for each round's draft (TensorRT-LLM's executor,
`engines/tensorrt_llm_target.py`), so that its acceptance happens inside it; the pipeline
hands it requests instead of driving `verify`.

The loops exchange small result records: a `Draft` (K proposed tokens), a `VerifyResult`
(the round's outcome) and a `SpeculationCache` (pre-speculated drafts keyed by outcome).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from saguaro.plugins.branch_draft.reference import BranchPlan
from saguaro.runtime.control.calibration import Calibration
from saguaro.runtime.core.sampling import SamplingParams


def draft_cache_capacity(max_context: int, max_branches: int, num_draft_tokens: int) -> int:
    """KV entries a draft cache needs: the context, then a round's speculation window (the
    K drafts, the last fed by the glue forward, and K steps of each of `max_branches`
    branches; none without pre-speculation), plus one spare entry."""
    return max_context + (max_branches + 1) * num_draft_tokens + 1


def target_cache_capacity(max_context: int, num_draft_tokens: int) -> int:
    """KV entries a target cache needs: the context, and a verification's K drafts."""
    return max_context + num_draft_tokens + 1


@dataclass(frozen=True)
class EngineLimits:
    """What compiled engines were built for; larger requests fail with these numbers named."""

    max_draft_tokens: int
    max_branches: int
    max_context: int
    max_batch: int

    @property
    def max_cache_entries(self) -> int:
        return draft_cache_capacity(self.max_context, self.max_branches, self.max_draft_tokens)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "EngineLimits":
        build = manifest["build"]
        return cls(build["max_draft_tokens"], build["max_branches"], build["max_context"], build["max_batch"])


# What a build is sized for unless its config says otherwise (`compiler.config.BuildConfig`
# reads these); torch engines, which compile nothing, size their caches from them too.
BUILD_DEFAULT_LIMITS = EngineLimits(max_draft_tokens=8, max_branches=16, max_context=512, max_batch=8)


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    path: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]  # generation stops at any of them (e.g. end of turn, end of text)
    bos_token_id: int | None
    tokenizer_fingerprint: str
    limits: EngineLimits | None = None  # None: no limit beyond max_context (torch engines)
    # what the forwards cost on the machine that built the engines (`control.calibration`);
    # None: not measured
    calibration: Calibration | None = None
    # A target's: the layers whose hidden states it returns with its logits, for a feature
    # draft (`llama.Features`); empty: none. A draft's: whether it reads them (`Step.hidden`).
    feature_layers: tuple[int, ...] = ()
    reads_features: bool = False
    # A draft's acceptance by depth measured on held-out prompts when it was made
    # (`checkpoint.measured_acceptance`): where the load policy starts; empty: unknown
    acceptance: tuple[float, ...] = ()
    # A draft whose steps are a little host Python, not forwards (the n-gram draft): its
    # ordinary drafts run in the decoding thread, since handing them to the draft's worker
    # thread costs more than they do
    on_host: bool = False
    # A model draft's n-gram lead (draft method "ngram+model"): the smallest and largest n of
    # the matches that draft a round alone, with no forward of the model, where one proposes
    # its first token (`Speculator.match`); None: every round is the model's
    ngram_lead: tuple[int, int] | None = None
    # A batched forward pads every row to the widest row's tokens (ONNX Runtime engines'
    # `[B, S]` inputs), so a verification costs rows x that width, not the tokens fed: one
    # row of 5 among 16 of 1 made it cost as 80 (`RoundReport.verified_tokens`)
    pads_rows: bool = False

    @property
    def eos_token_id(self) -> int | None:
        """The first (main) end-of-generation token."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_draft_tokens(self) -> int | None:
        return None if self.limits is None else self.limits.max_draft_tokens

    @property
    def max_branches(self) -> int | None:
        return None if self.limits is None else self.limits.max_branches

    def hidden_budget(self, k: int) -> int | None:
        """Branches that hide under a verify of K+1 tokens at batch 1, at most the engines'
        built maximum (the calibration's rule); None when not measured or K is beyond the
        engines'."""
        if self.calibration is None or self.limits is None or not 0 <= k <= self.limits.max_draft_tokens:
            return None
        return self.calibration.hidden_branches(k, self.limits.max_branches) if k else 0


class Cache(Protocol):
    length: int

    @property
    def capacity(self) -> int: ...
    def truncate(self, length: int) -> None: ...
    def gather(self, start: int, source_indices: torch.Tensor) -> None: ...
    def fork(self) -> "Cache": ...
    def release(self) -> None: ...


@dataclass
class Step:
    """One sequence's part of a batched forward."""

    cache: Cache
    tokens: torch.Tensor               # [n] int64
    positions: torch.Tensor            # [n] int64
    mask: torch.Tensor | None = None   # [n, cache.length + n] bool; None: causal
    # A feature draft's input: for the token at position p, the feature of position p - 1
    # (the target's, projected, or the draft's own prediction); None: zeros
    hidden: torch.Tensor | None = None  # [n, hidden]
    # Only the last token's logits are read (a prefill, a draft's sync): an engine may
    # score that row alone, and return logits [1, V]
    last_only: bool = False


class Rows(NamedTuple):
    """A step's results: its logits, and the hidden states a feature draft reads (a
    target's `feature_layers`, or a feature draft's own predicted features); None else."""

    logits: torch.Tensor                # [n, V]; [1, V] for a `last_only` step, where the engine scores it alone
    hidden: torch.Tensor | None = None  # [n, features]
    # False: the draft has nothing to propose after the step's last row (an n-gram draft
    # that found no match), so drafting stops there; a model always proposes
    proposes: bool = True


@dataclass
class VerifyStep:
    """One sequence's verification round: `step` feeds `[last, d_1..d_K]`."""

    step: Step
    draft_tokens: torch.Tensor         # [K]
    draft_probs: torch.Tensor | None   # [K, V]; None when greedy
    uniforms: torch.Tensor             # [K + 1]
    sampling: SamplingParams
    logprobs: bool = False             # also return the committed tokens' log-probabilities


@dataclass(frozen=True)
class VerifyResult:
    """A round's outcome: `accepted` drafts (0..K), then the target's `bonus` token; with
    `logprobs` asked for, the target's log-probability of each of those `accepted + 1`
    tokens (`saguaro.runtime.core.logprobs`); from a target with feature layers, their hidden
    states at the `accepted + 1` positions whose next token was committed (`[last,
    d_1..d_accepted]`), for a feature draft."""

    accepted: int
    bonus: int
    logprobs: tuple[float, ...] | None = None
    # [accepted + 1, features]; numpy rows from an ONNX Runtime round without drafts (no torch call)
    hidden: torch.Tensor | np.ndarray | None = None


class Engine(Protocol):
    info: EngineInfo
    tokenizer: object

    def new_cache(self, capacity: int) -> Cache: ...
    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]: ...
    def forward_rows(self, steps: Sequence[Step]) -> list[Rows]: ...
    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]: ...
    def plan_branches(self, scores: torch.Tensor, draft_tokens: torch.Tensor,
                      fanout: torch.Tensor, context_length: int) -> BranchPlan: ...


class _BatchedForms(Protocol):
    """What `OneSequenceForms` builds on: the batched forms its subclasses define."""

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]: ...
    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]: ...


class OneSequenceForms:
    """`forward` and `verify` for one sequence, in terms of an engine's batched forms;
    `forward_rows` for an engine that returns no hidden states; and `run_alone`: the
    decoder's word that nothing of the other model's runs during the block, which an
    engine that can may use to compute on more cores (no-op here)."""

    def forward_rows(self: _BatchedForms, steps: Sequence[Step]) -> list[Rows]:
        return [Rows(logits) for logits in self.forward_batch(steps)]

    def run_alone(self) -> ContextManager[None]:
        return nullcontext()

    def forward(self: _BatchedForms, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_batch([Step(cache, tokens, positions, mask)])[0]

    def verify(self: _BatchedForms, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor, draft_tokens: torch.Tensor,
               draft_probs: torch.Tensor | None, uniforms: torch.Tensor, sampling: SamplingParams) -> VerifyResult:
        return self.verify_batch([VerifyStep(Step(cache, tokens, positions), draft_tokens, draft_probs,
                                             uniforms, sampling)])[0]


@runtime_checkable
class RequestTarget(Protocol):
    """A target that decodes whole requests, drafting with `draft` (an `Engine`) through the
    same speculator, pre-speculation and budget as the loops; returns a
    `decoding.Generation`. Its decoding knobs are fixed once it starts."""

    info: EngineInfo
    tokenizer: object

    def start(self, options, draft) -> None: ...

    def check_options(self, options) -> None: ...

    def generate(self, draft, request): ...  # a `decoding.Request`


def causal_mask(past: int, count: int) -> torch.Tensor:
    """`[count, past + count]`: new token i sees the past and new tokens 0..i.

    Compared in numpy, not `tril`led: torch's tril kernel hands even a two-row mask to its
    thread pool, and waking a pool thread on a busy machine costs a scheduler tick (4-8 ms,
    more than a whole draft step) on every verify and tree step; torch's comparison of
    two small ranges costs twice numpy's (10 against 5 us), and a batched round of 16
    tiny sequences builds 16 masks."""
    return torch.from_numpy(np.arange(past + count) <= np.arange(past, past + count)[:, None])


@dataclass
class Draft:
    """K proposed tokens, the q each was sampled from (None when greedy), and the draft's
    logits at each of their positions (what branch keys are ranked by)."""

    tokens: torch.Tensor         # [K] int64
    probs: torch.Tensor | None   # [K, V]
    logits: torch.Tensor         # [K, V]; [K, 0] for n-gram matches (no branches grow from them)
    # a feature draft's own features at the rows the tokens were drafted from (row i: the
    # feature of the position before token i); None from other drafts
    hidden: torch.Tensor | None = None  # [K, hidden]
    # the draft proposed nothing after these tokens, though asked for more (`Rows.proposes`)
    stopped: bool = False
    # proposed by n-gram matching alone (`EngineInfo.ngram_lead`): the draft model's cache did
    # not move, so no branches are drafted from it
    matched: bool = False

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def prefix(self, count: int) -> "Draft":
        """The first `count` drafts (a round that verifies fewer than were drafted)."""
        if count == len(self):
            return self
        return Draft(self.tokens[:count], None if self.probs is None else self.probs[:count], self.logits[:count],
                     None if self.hidden is None else self.hidden[:count], matched=self.matched)


@dataclass
class SpeculationCache:
    """Pre-speculated drafts keyed by outcome `(accepted, bonus)`; `scores` `[K+1, V]` are
    the logits the keys were ranked by (the round's draft logits plus the glue row)."""

    keys: dict[tuple[int, int], int]  # (j, t) -> branch index
    drafts: list[Draft]
    scores: torch.Tensor
    context_length: int
    seconds: float = 0.0  # how long pre-speculating it took

    def lookup(self, accepted: int, bonus: int) -> int | None:
        return self.keys.get((accepted, bonus))
