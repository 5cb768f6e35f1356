"""A TensorRT-LLM target: SSD's draft side as the user drafter of a TensorRT-LLM `LLM`.

TensorRT-LLM's PyTorch backend runs the decoding loop itself (in-flight batching, its
own KV cache, its own sampler), so this target cannot offer `Engine.verify`; it is a
`contracts.RequestTarget` instead: `Pipeline.generate` hands it whole requests. The
documented hook it uses (TensorRT-LLM's `UserProvidedDecodingConfig(max_draft_len=K,
drafter=...)`): before each iteration the executor calls the drafter's
`prepare_draft_tokens(scheduled_requests)`, which sets `request.py_draft_tokens` (and
`request.py_draft_logits` for rejection sampling) for every request in its generation
phase; the target verifies them in one batched forward and appends the accepted drafts
plus one token of its own to the request.

`SsdDrafter` is that drafter's logic, free of TensorRT-LLM: per request a `Speculator`
over our draft engine and a `rounds.DraftRounds`. At each call it reads the request's
tokens, derives the last round's outcome `(accepted, bonus)` from what TensorRT-LLM
appended, takes the next draft (a hit in the speculation cache: the pre-speculated
branch; a miss: an ordinary draft), hands it over, and starts pre-speculating its
outcomes, which the draft worker runs while TensorRT-LLM verifies. Pre-speculation, the
branch-keyed cache and the budget are exactly those of `decoding.Decoder.decode_round`.

What acceptance guarantees (TensorRT-LLM's sampler, `TwoModelSpecDecHandler`): greedy
requests are verified by exact match (token-identical to the target alone); sampled ones
get TensorRT-LLM's rejection sampling when the drafter passes draft logits, which it does
only where TensorRT-LLM recomputes exactly the q the drafts were sampled from (no top-k,
no top-p: it passes T * log q, and TensorRT-LLM takes softmax(logits / T)); elsewhere they
fall back to exact match against the target's own samples, which keeps the target's
distribution but accepts less. docs/gpu.md has the rest.

`tensorrt_llm` is imported only when a target starts (GPU machines), through
`tensorrt_llm_api`, the one place that knows how the admitted versions differ; everything
else here runs and is tested without it, against stand-ins of each version's API surface.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from saguaro.runtime.core.contracts import Draft, EngineInfo, VerifyResult, draft_cache_capacity
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.core.stats import GenerationStats
from saguaro.runtime.decoding.requests import Generation, Output, Request, finish
from saguaro.runtime.decoding.rounds import DraftRounds
from saguaro.runtime.decoding.speculator import Speculator
from saguaro.runtime.engines import load_draft_engine
from saguaro.runtime.engines.manifest import ManifestError, engine_info, sha256_file
from saguaro.runtime.engines.tensorrt_llm_api import TensorRTLLMApi, import_tensorrt_llm, request_sampling
from saguaro.runtime.engines.tensorrt_llm_settings import TensorRTLLMSettings

# The decoding knobs the drafter is built with; one started target serves only these.
FIXED_OPTIONS = ("mode", "num_draft_tokens", "fanout", "budget", "saguaro_factor", "prespeculate")
REPORTS_KEPT = 4096  # finished requests whose drafter figures a caller may still collect


# --- the drafter -----------------------------------------------------------------------

def sampling_arguments(sampling: SamplingParams, max_tokens: int, eos_token_id: int | None) -> dict:
    """`tensorrt_llm.SamplingParams` keywords for a request (`request_sampling` inverts it)."""
    arguments: dict[str, Any] = {"max_tokens": max_tokens, "seed": sampling.seed}
    if sampling.greedy:
        arguments["temperature"] = 0.0
    else:
        arguments.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                         top_p=None if sampling.top_p == 1 else sampling.top_p)
    if eos_token_id is None or eos_token_id < 0:
        arguments["ignore_eos"] = True
    else:
        arguments["end_id"] = eos_token_id
    return arguments


def draft_logits(draft: Draft, sampling: SamplingParams) -> torch.Tensor | None:
    """Logits from which TensorRT-LLM recomputes exactly the q each draft was sampled from,
    so that its rejection sampling is the lossless rule: T * log q, since it takes
    softmax(logits / T). Only without top-k and top-p, which it would apply to q again
    (top-p of an already renormalised nucleus cuts deeper); None there and for greedy
    requests, which are verified by exact match."""
    if sampling.greedy or draft.probs is None or sampling.top_k or sampling.top_p < 1:
        return None
    return sampling.temperature * torch.log(draft.probs.float())


def round_outcome(previous_ids: list[int], proposal: Draft, ids: list[int]) -> VerifyResult | None:
    """The outcome TensorRT-LLM's verification of `proposal` (drafted after `previous_ids`)
    left in `ids`: the accepted drafts and one token of the target's. None when `ids` do not
    continue that way (the request was re-scheduled, or its drafts trimmed)."""
    new = ids[len(previous_ids):]
    accepted = len(new) - 1
    if ids[:len(previous_ids)] != previous_ids or not 0 <= accepted <= len(proposal):
        return None
    if new[:accepted] != proposal.tokens[:accepted].tolist():
        return None
    return VerifyResult(accepted, new[-1])


class RequestDrafts:
    """One request's draft side: its speculator, its rounds, and the draft handed over last."""

    def __init__(self, draft_engine, options: DecodeOptions, sampling: SamplingParams, max_context: int,
                 worker: ThreadPoolExecutor, stats: GenerationStats):
        k, policy = options.draft_tokens, options.fanout_policy(draft_engine.info.max_branches)
        branches = policy.max_branches if options.prespeculating else 0
        speculator = Speculator(draft_engine, sampling, options.saguaro(sampling),
                                draft_cache_capacity(max_context, branches, k))
        self.sampling, self.stats = sampling, stats
        self.rounds = DraftRounds(speculator, k, policy, stats, worker, options.prespeculating)
        self.ids: list[int] | None = None
        self.proposal: Draft | None = None
        self.handed_at = 0.0

    def next(self, ids: list[int]) -> Draft:
        """The draft to verify after `ids`, and pre-speculation of its outcomes started."""
        if self.proposal is None:
            draft = self.rounds.draft(ids)
        else:
            verify_s = time.perf_counter() - self.handed_at  # TensorRT-LLM's iteration
            self.stats.verify_s += verify_s
            assert self.ids is not None  # set with the proposal
            outcome = round_outcome(self.ids, self.proposal, ids)
            self.rounds.collect()
            if outcome is None:
                draft = self.rounds.draft(ids)
            else:
                self.stats.record_round(outcome.accepted, len(self.proposal))
                draft = self.rounds.next_draft(ids, self.proposal, outcome)
        self.ids, self.proposal = ids, draft
        self.rounds.prespeculate(ids, draft)
        self.handed_at = time.perf_counter()
        return draft

    def close(self) -> None:
        self.rounds.collect()  # a pre-speculation still running finishes before the cache goes
        self.rounds.speculator.release()


class SsdDrafter:
    """SSD's draft side for TensorRT-LLM's executor, one `RequestDrafts` per request.

    Picklable (TensorRT-LLM may send it to its worker process): the draft engine, the
    worker thread and the per-request state are rebuilt there, the engine loaded again
    from the engine directory. Its figures for each request are kept by client id
    (`report`) for a caller in the same process."""

    def __init__(self, engine_dir: str | Path, options: DecodeOptions, max_context: int, draft_engine=None):
        self.engine_dir, self.options, self.max_context = str(engine_dir), options, max_context
        self._draft_engine = draft_engine
        self._setup()

    def _setup(self) -> None:
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ssd-draft")
        self._requests: dict[int, RequestDrafts] = {}
        self._reports: OrderedDict[int, GenerationStats] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"engine_dir": self.engine_dir, "options": self.options, "max_context": self.max_context}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _draft_engine=None)
        self._setup()

    @property
    def k(self) -> int:
        return self.options.draft_tokens

    @property
    def draft_engine(self):
        if self._draft_engine is None:
            self._draft_engine = load_draft_engine(self.engine_dir)
        return self._draft_engine

    def prepare(self, requests) -> None:
        """Set each generation-phase request's K draft tokens (and draft logits where its
        rejection sampling can use them); drop the state of requests no longer scheduled."""
        scheduled = {request.py_request_id for request in requests}
        for request_id in [r for r in self._requests if r not in scheduled]:
            self._requests.pop(request_id).close()
        for request in requests:
            drafts = self._request(request)
            draft = drafts.next(list(request.get_tokens(0)))
            request.py_draft_tokens = draft.tokens.tolist()
            logits = draft_logits(draft, drafts.sampling)
            request.py_draft_logits = None if logits is None else logits.to(_device())

    def _request(self, request) -> RequestDrafts:
        drafts = self._requests.get(request.py_request_id)
        if drafts is None:
            stats = self._stats_for(request.py_client_id)
            sampling = request_sampling(request.sampling_config).with_seed()  # draws are keyed by a seed
            drafts = RequestDrafts(self.draft_engine, self.options, sampling, self.max_context, self._worker, stats)
            self._requests[request.py_request_id] = drafts
        return drafts

    def _stats_for(self, client_id: int) -> GenerationStats:
        """The request's figures: kept across a re-scheduling, and for `report`."""
        with self._lock:
            stats = self._reports.get(client_id)
            if stats is None:
                stats = self._reports[client_id] = GenerationStats(self.options.mode, self.k)
                while len(self._reports) > REPORTS_KEPT:
                    self._reports.popitem(last=False)
            return stats

    def report(self, client_id: int) -> GenerationStats | None:
        """The drafter's figures for a finished request, once (None if it drafted none here)."""
        with self._lock:
            return self._reports.pop(client_id, None)

    def close(self) -> None:
        for drafts in self._requests.values():
            drafts.close()
        self._requests.clear()
        self._worker.shutdown(wait=True)


def _device() -> str:
    """Where TensorRT-LLM's sampler wants draft logits: beside its target probabilities."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- the target --------------------------------------------------------------------------

class TensorRTLLMTarget:
    """A target checkpoint run by TensorRT-LLM's `LLM`, with `SsdDrafter` as its drafter.

    The `LLM` starts with one set of decoding knobs (K, fan-out or budget, Saguaro factor,
    mode): on `Pipeline.load(..., options=...)`, or else at the first request. Requests
    asking for other knobs are refused (`check_options`) rather than silently served with
    the wrong ones; per-request sampling, seed, length and EOS are TensorRT-LLM's own."""

    def __init__(self, engine_dir: Path, checkpoint: Path, settings: TensorRTLLMSettings, info: EngineInfo,
                 tokenizer):
        self.engine_dir, self.checkpoint, self.settings = Path(engine_dir), Path(checkpoint), settings
        self.info, self.tokenizer = info, tokenizer
        self.options: DecodeOptions | None = None
        self.llm: Any = None  # a `tensorrt_llm.LLM` (untyped), once started
        self.drafter: SsdDrafter | None = None
        self._lock = threading.Lock()

    def llm_arguments(self, api: TensorRTLLMApi, options: DecodeOptions, draft_engine) -> dict:
        arguments = dict(model=str(self.checkpoint), backend="pytorch", max_batch_size=self.settings.max_batch_size,
                         max_seq_len=self.info.max_context,
                         # the drafter reads each request's tokens of the iteration before
                         disable_overlap_scheduler=True,
                         kv_cache_config=api.KvCacheConfig(
                             enable_block_reuse=False,
                             free_gpu_memory_fraction=self.settings.kv_cache_free_gpu_memory_fraction))
        if options.draft_tokens:
            self.drafter = SsdDrafter(self.engine_dir, options, self.info.max_context, draft_engine)
            arguments["speculative_config"] = api.UserProvidedDecodingConfig(
                max_draft_len=options.draft_tokens, drafter=api.Drafter(self.drafter))
        return arguments

    def start(self, options: DecodeOptions, draft_engine, api: TensorRTLLMApi | None = None) -> None:
        """Create the `LLM` for these decoding knobs (once; later calls must agree)."""
        with self._lock:
            if self.llm is not None:
                self.check_options(options)
                return
            api = api or import_tensorrt_llm()
            if self.settings.single_process:
                # read when the LLM creates its executor: keep it (and the drafter) here
                os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
            self.llm = api.LLM(**self.llm_arguments(api, options, draft_engine))
            self.api, self.options = api, options

    def check_options(self, options: DecodeOptions) -> None:
        """A started target serves the decoding knobs it started with; ValueError otherwise."""
        if self.options is None:
            return
        for name in FIXED_OPTIONS:
            if getattr(options, name) != getattr(self.options, name):
                raise ValueError(f"the tensorrt_llm target runs with {name}={getattr(self.options, name)!r} "
                                 f"(fixed when it started); this request asks for {getattr(options, name)!r}")

    def generate(self, draft, request: Request) -> Generation:
        """One request through TensorRT-LLM, streamed one iteration (one round) at a time."""
        options, sampling, cancelled = request.options, request.sampling, request.cancelled
        prompt_ids, eos_token_id = request.prompt_ids, next(iter(request.eos_token_ids), None)
        self.start(options, draft)
        stats = GenerationStats(options.mode, options.draft_tokens)
        started = time.perf_counter()
        out = Output(request, self.info.max_context)
        params = self.api.SamplingParams(**sampling_arguments(sampling, out.room, eos_token_id))
        result = self.llm.generate_async(list(prompt_ids), sampling_params=params, streaming=True)
        seen = 0
        for response in result:
            tokens = list(response.outputs[0].token_ids)
            new, first = tokens[seen:], seen == 0
            seen = len(tokens)
            if first:  # the prefill's token, then (if any) a first round's
                stats.prefill_s = time.perf_counter() - started
                out.commit(new[:1])
                new = new[1:]
            if new:  # one iteration: the accepted drafts and the target's token
                stats.record_round(min(len(new) - 1, options.draft_tokens))
                out.commit(new)
            if out.finish_reason is not None:
                break
            if cancelled():
                result.abort()
                break
        self.merge_drafter_report(stats, result.request_id)
        return finish(out, stats, started, sampling.seed)

    def merge_drafter_report(self, stats: GenerationStats, client_id: int) -> None:
        """The drafter's figures, when it ran in this process."""
        report = self.drafter.report(client_id) if self.drafter is not None else None
        if report is None:
            return
        for name in ("cache_hits", "cache_misses", "branches_drafted", "draft_s", "prespeculate_s", "wait_s",
                     "verify_s"):
            setattr(stats, name, getattr(report, name))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
        if self.drafter is not None:
            self.drafter.close()


def check_target_checkpoint(checkpoint: Path, manifest: dict) -> None:
    """The checkpoint TensorRT-LLM will load is the one the engines were built against."""
    config = checkpoint / "config.json"
    expected = manifest["inputs"].get("target/config.json")
    if not config.is_file():
        raise ManifestError(f"the tensorrt_llm target checkpoint {str(checkpoint)!r} is missing (no config.json)")
    if expected is not None and sha256_file(config) != expected:
        raise ManifestError(f"the tensorrt_llm target checkpoint {str(checkpoint)!r} changed since the build "
                            "(its config.json differs); rebuild the engines")


def open_target(engine_dir: Path, manifest: dict, tokenizer) -> "TensorRTLLMTarget":
    """The target of a tensorrt_llm engine folder, from the checkpoint it was built against
    (its draft is an ordinary engine: `engines.open_engine`)."""
    settings = TensorRTLLMSettings.from_manifest(manifest)
    checkpoint = Path(manifest["models"]["target"]["checkpoint"])
    check_target_checkpoint(checkpoint, manifest)
    info = engine_info("tensorrt_llm", engine_dir, "target", manifest)
    return TensorRTLLMTarget(engine_dir, checkpoint, settings, info, tokenizer)
