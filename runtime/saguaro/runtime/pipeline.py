"""A loaded draft/target pair and the one entry point that scripts and servers call.

`Pipeline.load` opens either two Hugging Face checkpoints (torch engines) or a built
engine directory; `Pipeline.generate` validates a request completely before any model
runs, then dispatches to the decoding loop of its mode, or hands it to a target that
decodes requests itself (`contracts.RequestTarget`: TensorRT-LLM).
"""
from __future__ import annotations

import gc
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from saguaro.runtime.core.contracts import Engine, RequestTarget
from saguaro.runtime.core.options import (
    DRAFT_METHODS,
    NO_MODEL_METHOD,
    DecodeOptions,
    LimitError,
    check_engine_limits,
    uses_draft_model,
)
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.decoding import tensorrt_llm_loop
from saguaro.runtime.decoding.decoder import Decoder
from saguaro.runtime.decoding.requests import Cancelled, Generation, OnStart, OnTokens, Request
from saguaro.runtime.decoding.scheduler import Scheduler
from saguaro.runtime.engines import REQUEST_LEVEL_BACKENDS, load_engine_tokenizer, open_engine
from saguaro.runtime.engines.manifest import validate_engine_dir
from saguaro.runtime.engines.ngram_draft import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramDraft
from saguaro.runtime.engines.torch_engine import TorchEngine, torch_draft
from saguaro.runtime.models.checkpoint import check_pair_compatible
from saguaro.runtime.models.prompts import PromptError, chat_messages, encode_chat, encode_text


def method_draft(draft_method: str, target: Engine, model: Engine | None) -> Engine:
    """The draft `draft_method` names, over the draft model `model` where it uses one."""
    if draft_method == NO_MODEL_METHOD:
        return NgramDraft(target)
    assert model is not None  # loaded for every other method
    if draft_method == "ngram+model":
        model.info = replace(model.info, ngram_lead=(DEFAULT_MIN_NGRAM, DEFAULT_MAX_NGRAM))
    return model


def open_engine_folder(engine_dir: Path, with_draft: bool = True):
    """`(target, draft)` of a built engine folder, validated first (the draft None unless
    `with_draft`). The loop is chosen here, once: a backend whose target decodes whole
    requests (TensorRT-LLM) gets its request loop as the target; every other target is an
    engine the decoding round drives."""
    manifest = validate_engine_dir(engine_dir)
    tokenizer = load_engine_tokenizer(engine_dir, manifest)
    if manifest["backend"] in REQUEST_LEVEL_BACKENDS:
        target = tensorrt_llm_loop.open_target(engine_dir, manifest, tokenizer)
    else:
        target = open_engine(engine_dir, manifest, "target", tokenizer)
    return target, open_engine(engine_dir, manifest, "draft", tokenizer) if with_draft else None



class RequestError(ValueError):
    """A request that cannot run, rejected before any work; the message names the input."""


@dataclass(frozen=True)
class RequestNames:
    """What a caller calls each part of a request, so that an error names what it sent:
    command-line flags by default; a server passes its input names."""

    prompt: str = "--prompt"
    num_draft_tokens: str = "--num-draft-tokens"
    branches: str = "--fanout/--budget"
    lower: str = "lower --fanout or --budget"


BATCHING = ("iteration", "per-request")  # one scheduler for all requests | one thread each


def freeze_loaded_heap() -> None:
    """For a process that loads its pipeline once and then serves (the Triton model, a
    worker): what is alive now (modules, engines, tokenizer: about 250,000 objects) lives
    as long as the process, so it leaves the garbage collector's care (`gc.freeze`, as
    vLLM's engine does after start-up). The collector's full passes walk every object it
    tracks, and with the loaded heap among them one pass took 50-120 ms, run by whichever
    thread allocated last: at 16 streams on the tiny engines, in one process, a pass in
    the scheduler's round cost a phase of 512 rounds 7% of its time. Not for a process
    that loads and drops pipelines: a frozen pipeline's reference cycles are never
    collected."""
    gc.collect()  # garbage of the loading itself is not frozen
    gc.freeze()


@dataclass
class Pipeline:
    """`batching` "iteration" (the default) decodes up to `max_concurrency` requests
    together in one scheduler; "per-request" decodes each alone, in a thread of its own,
    up to `max_concurrency` at once (the baseline that iteration-level batching replaces).
    `max_concurrency` is at most what both engines have KV slots for (their max_batch)."""

    target: Engine | RequestTarget
    draft: Engine
    batching: str = BATCHING[0]
    max_concurrency: int | None = None
    schedulers: list[Scheduler] = field(init=False)

    def __post_init__(self):
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}; got {self.batching!r}")
        slots = min(engine.info.limits.max_batch for engine in (self.target, self.draft))
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        concurrency = min(self.max_concurrency or slots, slots)
        if self.batching == "iteration":
            self.schedulers = [Scheduler(Decoder(self.target, self.draft), concurrency)]
        else:
            # several decoders on the same engines: the target never has the draft's core to itself
            self.schedulers = [Scheduler(Decoder(self.target, self.draft, alone=concurrency == 1), 1)
                               for _ in range(concurrency)]

    @property
    def max_active(self) -> int:
        """Requests decoded at once."""
        return sum(scheduler.max_active for scheduler in self.schedulers)

    @property
    def queued(self) -> int:
        """Requests waiting for a KV slot."""
        return sum(scheduler.queued for scheduler in self.schedulers)

    def observe_rounds(self, on_round) -> None:
        """Tell `on_round(batch, report)` of every round, after it ran (`report`: the
        round's `RoundReport`, what it measured)."""
        for scheduler in self.schedulers:
            scheduler.on_round = on_round

    def close(self) -> None:
        """Finish what was submitted and stop the decoding threads."""
        for scheduler in self.schedulers:
            scheduler.close()
            scheduler.decoder.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None,
             engines: str | Path | None = None, threads: int | None = 1,
             options: DecodeOptions | None = None, draft_method: str = DRAFT_METHODS[0],
             **scheduling) -> "Pipeline":
        """Checkpoint folders (`target` and `draft`, a checkpoint or a feature draft's
        head) or a built engine folder (`engines`). `draft_method` "ngram" drafts by n-gram
        matching over each sequence's own tokens instead (no draft model is loaded, and
        `draft` is not needed); "ngram+model" drafts a round by such matching alone where a
        match proposes its first token and the matches have been accepted at least as often
        as the model's drafts, every other round with the draft model (`Speculator.match`).

        `threads` sets torch's intra-op threads: the target and the draft each run on one
        core, so a second thread each would oversubscribe a 2-core machine. `options`
        starts a request-level target (TensorRT-LLM) with those decoding knobs now rather
        than at the first request. `scheduling`: `batching`, `max_concurrency`.
        """
        if draft_method not in DRAFT_METHODS:
            raise RequestError(f"draft method must be one of {', '.join(DRAFT_METHODS)}; got {draft_method!r}")
        by_model = uses_draft_model(draft_method)
        if threads:
            torch.set_num_threads(threads)
        if engines is not None:
            target_engine, draft_engine = open_engine_folder(Path(engines), with_draft=by_model)
        elif target is not None and (draft is not None or not by_model):
            target_engine = TorchEngine(target)
            draft_engine = None if draft is None or not by_model else torch_draft(draft, target_engine)
        else:
            raise RequestError("give either an engine folder or both target and draft checkpoints (a target alone "
                               f"with draft_method {NO_MODEL_METHOD!r})")
        draft_engine = method_draft(draft_method, target_engine, draft_engine)
        check_pair_compatible(target_engine.info.vocab_size, draft_engine.info.vocab_size,
                              target_engine.info.tokenizer_fingerprint,
                              draft_engine.info.tokenizer_fingerprint)
        if options is not None and isinstance(target_engine, RequestTarget):
            target_engine.start(options, draft_engine)
        return cls(target_engine, draft_engine, **scheduling)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def max_context(self) -> int:
        return self.target.info.max_context

    def encode(self, text: str) -> list[int]:
        """A plain prompt, encoded as its tokenizer says (see `prompts`)."""
        try:
            return encode_text(self.tokenizer, text)
        except PromptError as error:
            raise RequestError(str(error)) from None

    def encode_chat(self, user: str, system: str | None = None) -> list[int]:
        """One user turn rendered with the checkpoint's chat template, assistant turn opened."""
        try:
            return encode_chat(self.tokenizer, chat_messages(user, system))
        except PromptError as error:
            raise RequestError(str(error)) from None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_request(self, prompt_ids: list[int], options: DecodeOptions,
                      names: RequestNames = RequestNames()) -> None:
        if not prompt_ids:
            raise RequestError(f"{names.prompt} is empty: give at least one token")
        if len(prompt_ids) >= self.max_context:
            raise RequestError(f"{names.prompt}: a prompt of {len(prompt_ids)} tokens does not fit the context "
                               f"of {self.max_context} tokens (it must leave room for one new token)")
        vocab = self.target.info.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"{names.prompt}: token ids must lie in [0, {vocab}); "
                               f"got {min(prompt_ids)}..{max(prompt_ids)}")
        try:
            check_engine_limits(options, self.draft.info.max_draft_tokens, self.draft.info.max_branches,
                                names.num_draft_tokens, names.branches, names.lower)
        except LimitError as error:
            raise RequestError(str(error)) from None
        if isinstance(self.target, RequestTarget):
            try:
                self.target.check_options(options)
            except ValueError as error:
                raise RequestError(str(error)) from error

    def request(self, prompt_ids: list[int], options: DecodeOptions, sampling: SamplingParams,
                on_tokens: OnTokens | None = None, cancelled: Cancelled = lambda: False,
                logprobs: list[float] | None = None, on_start: OnStart | None = None) -> Request:
        """A checked request with its seed and end tokens fixed (errors name the input).
        `logprobs`, `on_start`: see `decoding.Request`."""
        prompt_ids = [int(i) for i in prompt_ids]
        self.check_request(prompt_ids, options)
        if logprobs is not None and isinstance(self.target, RequestTarget):
            raise RequestError("log-probabilities are not returned by a target that decodes requests itself "
                               "(tensorrt_llm)")
        return Request(prompt_ids, options, sampling.with_seed(), self.end_tokens(options), on_tokens, cancelled,
                       logprobs, on_start)

    def end_tokens(self, options: DecodeOptions) -> frozenset[int]:
        """The model's end-of-generation tokens, or the one a request names (-1: none)."""
        if options.eos_token_id is None:
            return frozenset(self.target.info.eos_token_ids)
        return frozenset() if options.eos_token_id == -1 else frozenset([options.eos_token_id])

    def generate(self, prompt_ids: list[int], options: DecodeOptions, sampling: SamplingParams,
                 on_tokens: OnTokens | None = None, cancelled: Cancelled = lambda: False) -> Generation:
        return self.generate_batch([self.request(prompt_ids, options, sampling, on_tokens, cancelled)])[0]

    def generate_batch(self, requests: list[Request]) -> list[Generation]:
        """Several requests decoded together, rounds batched across them (a target that
        decodes requests itself gets them one by one)."""
        if isinstance(self.target, RequestTarget):
            return [self.target.generate(self.draft, request) for request in requests]
        return [future.result() for future in [self.submit(request) for request in requests]]

    def submit(self, request: Request) -> Future:
        """Queue a checked request (`request`) for the scheduler; its future's result is
        the `Generation`. Requests submitted from several threads batch together."""
        return min(self.schedulers, key=lambda scheduler: scheduler.load).submit(request)
