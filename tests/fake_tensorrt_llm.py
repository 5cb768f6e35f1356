"""A stand-in for the parts of TensorRT-LLM (PyTorch backend, LLM API) the tensorrt_llm
target uses, so its logic runs on CPU: an `LLM` whose executor thread does in-flight
batching over a torch target and calls a user drafter the way TensorRT-LLM's PyExecutor
does (`prepare_draft_tokens(scheduled_requests, resource_manager)` then
`pad_draft_tokens_for_cuda_graph`, before each forward; overlap scheduler off).

Verification follows TensorRT-LLM's `TwoModelSpecDecHandler.process_draft_tokens`: a
greedy request, or a sampled one without draft logits, accepts drafts while they equal the
target's own token for that position (sampled with the request's strategy); a sampled one
with `py_draft_logits` takes rejection sampling with draft probabilities recomputed from
those logits with the request's strategy, accept when u <= q/p, on rejection draw from
max(target - draft, 0). Unless `TLLM_WORKER_USE_SINGLE_PROCESS=1`, the drafter is pickled
and unpickled first, as TensorRT-LLM's MPI worker process receives it.

Every API surface the admitted versions have is modelled (`VARIANTS`): the three forms of
`Drafter.__init__` (and what each pads to), and a request's sampling config as one-element
lists with `random_seed` or as scalars with `seed`. `install(monkeypatch, variant)` puts
the modules in `sys.modules`; `LLM.instances` and each LLM's `prepare_calls` record what
the drafter handed over.
"""
from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from saguaro.plugins.probs import logits_to_probs
from saguaro.runtime.engines.torch_engine import TorchEngine

# --- tensorrt_llm._torch.speculative.drafter, in each admitted form ------------------------

class DrafterBase(ABC):
    """What every form has: the abstract hook the executor calls each iteration."""

    @abstractmethod
    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None: ...

    def pad_to(self) -> int:
        raise NotImplementedError

    def pad_draft_tokens_for_cuda_graph(self, scheduled_requests, resource_manager=None) -> None:
        for request in scheduled_requests.generation_requests:
            request.py_draft_tokens.extend(0 for _ in range(self.pad_to() - len(request.py_draft_tokens)))


class ConcurrencyDrafter(DrafterBase):
    """1.0 - 1.1: only `max_concurrency`; padding reads `max_draft_len`, which the base never
    sets (a subclass must)."""

    def __init__(self, max_concurrency=None):
        self.max_concurrency = max_concurrency

    def pad_to(self) -> int:
        return self.max_draft_len


class DraftTokensDrafter(DrafterBase):
    """1.2.0 release candidates: `max_draft_tokens` required, padding to its static copy."""

    def __init__(self, max_draft_tokens, max_concurrency=None, draft_len_schedule=None):
        self.max_concurrency, self.draft_len_schedule = max_concurrency, draft_len_schedule
        self.max_draft_tokens = self._static_max_draft_tokens = max_draft_tokens

    def pad_to(self) -> int:
        return self._static_max_draft_tokens


class DraftLenDrafter(DrafterBase):
    """1.2: `max_draft_len` and `max_total_draft_tokens` (all keywords default to None)."""

    def __init__(self, max_draft_len=None, max_total_draft_tokens=None, max_concurrency=None,
                 draft_len_schedule=None):
        self.max_draft_len, self.max_total_draft_tokens = max_draft_len, max_total_draft_tokens
        self._static_max_total_draft_tokens = max_total_draft_tokens
        self.max_concurrency, self.draft_len_schedule = max_concurrency, draft_len_schedule

    def pad_to(self) -> int:
        return self._static_max_total_draft_tokens


class UnknownDrafter(DrafterBase):
    """A form no admitted version has (what a later release might bring)."""

    def __init__(self, spec_config, max_draft_len):
        self.spec_config, self.max_draft_len = spec_config, max_draft_len

    def pad_to(self) -> int:
        return self.max_draft_len


@dataclass(frozen=True)
class Variant:
    """One TensorRT-LLM API surface: the version it reports, its Drafter, and how a
    request's sampling config holds its values ("list": one-element lists and
    `random_seed`, the C++ binding; "scalar": plain values and `seed`)."""

    version: str
    drafter: type
    sampling_config: str


VARIANTS = {
    "1.0": Variant("1.0.0", ConcurrencyDrafter, "list"),
    "1.2.0rc": Variant("1.2.0rc2", DraftTokensDrafter, "list"),
    "1.2": Variant("1.2.1", DraftLenDrafter, "list"),
    # the scalar config of TensorRT-LLM's later sampler; the adapter reads both in any version
    "scalar-config": Variant("1.2.1", DraftLenDrafter, "scalar"),
}
DEFAULT_VARIANT = "1.2"
Drafter = VARIANTS[DEFAULT_VARIANT].drafter  # what `install` puts in place unless told otherwise


# --- tensorrt_llm.llmapi and tensorrt_llm ----------------------------------------------------

@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = None
    max_tokens: int | None = None


@dataclass
class UserProvidedDecodingConfig:
    max_draft_len: int
    drafter: object
    resource_manager: object = None

    def __post_init__(self):
        if self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0")


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    end_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature is not None and self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return (self.temperature is None and self.top_p is None and self.top_k is None) \
            or self.top_k == 1 or self.top_p == 0.0 or self.temperature == 0


def _listed(value):
    return None if value is None else [value]


def sampling_config(params: SamplingParams, form: str) -> types.SimpleNamespace:
    """A request's `sampling_config` in one of the two forms (`Variant.sampling_config`)."""
    if form == "list":
        return types.SimpleNamespace(temperature=_listed(params.temperature), top_k=_listed(params.top_k),
                                     top_p=_listed(params.top_p), random_seed=_listed(params.seed))
    return types.SimpleNamespace(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                 seed=params.seed)


@dataclass
class LlmRequest:
    """The LlmRequest attributes a drafter reads and writes."""

    py_request_id: int
    py_client_id: int
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    py_draft_tokens: list[int] = field(default_factory=list)
    py_draft_logits: torch.Tensor | None = None
    py_num_accepted_draft_tokens: int = 0
    sampling_config: types.SimpleNamespace = None
    finish_reason: str | None = None
    cancelled: bool = False

    sampling_form: str = "list"

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.sampling_config = sampling_config(self.params, self.sampling_form)

    def get_tokens(self, beam: int) -> list[int]:
        assert beam == 0
        return list(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclass
class ScheduledRequests:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)


@dataclass
class CompletionOutput:
    token_ids: list[int]
    finish_reason: str | None = None


class RequestOutput:
    """`generate_async(..., streaming=True)`'s result: iterating yields it once per
    executor response, its `outputs[0].token_ids` growing."""

    def __init__(self, client_id: int, llm: "LLM"):
        self.request_id, self._llm = client_id, llm
        self._responses: queue.Queue = queue.Queue()
        self.outputs = [CompletionOutput([])]
        self.finished = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        tokens, finish_reason = self._responses.get(timeout=60)
        self.outputs = [CompletionOutput(tokens, finish_reason)]
        self.finished = finish_reason is not None
        return self

    def abort(self) -> None:
        self._llm.aborted.append(self.request_id)
        self._llm.cancel(self.request_id)


class LLM:
    instances: list["LLM"] = []
    variant: Variant = VARIANTS[DEFAULT_VARIANT]

    def __init__(self, model, backend=None, max_batch_size=8, max_seq_len=None, disable_overlap_scheduler=False,
                 kv_cache_config=None, speculative_config=None, **unknown):
        assert not unknown, f"unexpected LLM arguments {unknown}"
        assert backend == "pytorch"
        if speculative_config is not None:
            assert disable_overlap_scheduler, "a user drafter reads the previous iteration's tokens"
            assert isinstance(speculative_config.drafter, sys.modules[DRAFTER_MODULE].Drafter)
        self.arguments = dict(model=model, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                              kv_cache_config=kv_cache_config, speculative_config=speculative_config)
        self.target = TorchEngine(model, max_batch=64)  # TensorRT-LLM pages its own KV cache
        drafter = speculative_config.drafter if speculative_config else None
        self.in_process = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") == "1"
        if drafter is not None and not self.in_process:
            drafter = pickle.loads(pickle.dumps(drafter))  # what the worker process receives
        self.drafter = drafter
        self.prepare_calls: list[list[dict]] = []
        self.aborted: list[int] = []
        self._incoming: queue.Queue = queue.Queue()
        self._active: dict[int, tuple] = {}
        self._next_id = 100
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._executor = threading.Thread(target=self._run, name="fake-executor", daemon=True)
        self._executor.start()
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params: SamplingParams, streaming: bool = False) -> RequestOutput:
        assert streaming and isinstance(inputs, list) and isinstance(inputs[0], int)
        with self._lock:
            self._next_id += 1
            client_id = self._next_id
        result = RequestOutput(client_id, self)
        request = LlmRequest(py_request_id=client_id * 7, py_client_id=client_id, prompt=list(inputs),
                             params=sampling_params, sampling_form=LLM.variant.sampling_config)
        self._incoming.put((request, result))
        return result

    def cancel(self, client_id: int) -> None:
        with self._lock:
            for request, _, _ in self._active.values():
                if request.py_client_id == client_id:
                    request.cancelled = True

    def shutdown(self) -> None:
        self._stop.set()
        self._executor.join(timeout=30)

    # --- the executor loop --------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._admit()
            if not self._active:
                self._stop.wait(0.005)
                continue
            with self._lock:
                for request, _, _ in self._active.values():
                    if request.cancelled and request.finish_reason is None:
                        request.finish_reason = "cancelled"
                generation = [r for r, _, _ in self._active.values() if r.finish_reason is None]
            if generation and self.drafter is not None:
                scheduled = ScheduledRequests(generation_requests=generation)
                self.drafter.prepare_draft_tokens(scheduled, None)
                self.drafter.pad_draft_tokens_for_cuda_graph(scheduled)
                self.prepare_calls.append([self._record(r) for r in generation])
            for request in generation:
                self._verify(request)
            self._respond()

    def _record(self, request: LlmRequest) -> dict:
        logits = request.py_draft_logits
        return {"client_id": request.py_client_id, "tokens": len(request.tokens), "drafts": list(request.py_draft_tokens),
                "logits": None if logits is None else logits.clone()}

    def _admit(self) -> None:
        """Context phase: prefill, then the first token (as TensorRT-LLM's first response).
        At most `max_batch_size` requests are in flight; the rest wait, as in TensorRT-LLM."""
        while not self._incoming.empty() and len(self._active) < self.arguments["max_batch_size"]:
            request, result = self._incoming.get()
            cache = self.target.new_cache(self.target.info.max_context)
            generator = torch.Generator().manual_seed(request.params.seed or 0)
            if len(request.prompt) > 1:  # prefill: the cache holds the prompt but its last token
                self.target.forward(cache, torch.tensor(request.prompt[:-1]), torch.arange(len(request.prompt) - 1))
            with self._lock:
                self._active[request.py_client_id] = (request, result, (cache, generator))
            self._verify(request, drafts_allowed=False)
            result._responses.put((request.generated, None))

    def _strategy_probs(self, request: LlmRequest, logits: torch.Tensor) -> torch.Tensor:
        p = request.params
        return logits_to_probs(logits, p.temperature or 1.0, p.top_k or 0, 1.0 if p.top_p is None else p.top_p)

    def _verify(self, request: LlmRequest, drafts_allowed: bool = True) -> None:
        """One forward over [last, drafts] and TensorRT-LLM's acceptance rule."""
        if request.finish_reason is not None:
            return
        cache, generator = self._active[request.py_client_id][2]
        drafts = list(request.py_draft_tokens) if drafts_allowed else []
        start = len(request.tokens) - 1
        rows = self.target.forward(cache, torch.tensor([request.tokens[-1], *drafts]),
                                   torch.arange(start, start + len(drafts) + 1))
        if request.params.greedy or request.py_draft_logits is None or not drafts:
            new = self._exact_match(request, rows, drafts, generator)
        else:
            new = self._rejection_sampling(request, rows, drafts, generator)
        request.py_num_accepted_draft_tokens = len(new) - 1
        cache.truncate(start + len(new))
        self._append(request, new)
        request.py_draft_tokens, request.py_draft_logits = [], None

    def _target_token(self, request, row, generator) -> int:
        if request.params.greedy:
            return int(row.argmax())
        return int(torch.multinomial(self._strategy_probs(request, row), 1, generator=generator))

    def _exact_match(self, request, rows, drafts, generator) -> list[int]:
        new = [self._target_token(request, rows[0], generator)]
        for index, draft in enumerate(drafts):
            if draft != new[-1]:
                break
            new.append(self._target_token(request, rows[index + 1], generator))
        return new

    def _rejection_sampling(self, request, rows, drafts, generator) -> list[int]:
        draft_probs = self._strategy_probs(request, request.py_draft_logits.float())
        target_probs = self._strategy_probs(request, rows)
        new = []
        for index, draft in enumerate(drafts):
            p, q = draft_probs[index, draft], target_probs[index, draft]
            if float(torch.rand((), generator=generator)) > float(torch.clamp(q / p, max=1.0)):
                residual = torch.clamp(target_probs[index] - draft_probs[index], min=0)
                return new + [int(torch.multinomial(residual, 1, generator=generator))]
            new.append(draft)
        return new + [int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))]

    def _append(self, request: LlmRequest, new: list[int]) -> None:
        p = request.params
        for token in new:
            request.tokens.append(token)
            if not p.ignore_eos and p.end_id is not None and token == p.end_id:
                request.finish_reason = "stop"
                return
            if len(request.generated) >= p.max_tokens:
                request.finish_reason = "length"
                return

    def _respond(self) -> None:
        with self._lock:
            for client_id, (request, result, _) in list(self._active.items()):
                result._responses.put((request.generated, request.finish_reason))
                if request.finish_reason is not None:
                    del self._active[client_id]


DRAFTER_MODULE = "tensorrt_llm._torch.speculative.drafter"


def install(monkeypatch, variant: str | Variant = DEFAULT_VARIANT) -> Variant:
    """Make `import tensorrt_llm` (and the submodules the target uses) find this stand-in,
    with the API surface of `variant` (a name of `VARIANTS`, or a `Variant`)."""
    variant = VARIANTS[variant] if isinstance(variant, str) else variant
    root = types.ModuleType("tensorrt_llm")
    root.__version__, root.LLM, root.SamplingParams = variant.version, LLM, SamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig, llmapi.UserProvidedDecodingConfig = KvCacheConfig, UserProvidedDecodingConfig
    drafter = types.ModuleType(DRAFTER_MODULE)
    drafter.Drafter = variant.drafter
    modules = {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi, "tensorrt_llm._torch": types.ModuleType("t"),
               "tensorrt_llm._torch.speculative": types.ModuleType("s"), DRAFTER_MODULE: drafter}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "saguaro.runtime.engines.tensorrt_llm_drafter", raising=False)
    monkeypatch.setattr(LLM, "variant", variant)
    LLM.instances.clear()
    return variant
