"""The `Engine` protocol over ONNX Runtime graphs built by `scripts/build_engines.py`.

Each graph is one ORT session; its KV cache is a `kv_cache.SlotKVCache` bound through
IOBinding, so a step copies nothing outside the graph. `SessionSettings` and
`session_options` say how every session runs (threads, pinning, spinning); the build
uses the same options when it lets ORT optimise a graph offline.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from saguaro.plugins.branch_draft.reference import BranchPlan
from saguaro.runtime.contracts import EngineInfo, causal_mask
from saguaro.runtime.engines.manifest import engine_info
from saguaro.runtime.kv_cache import SlotKVCache
from saguaro.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class SessionSettings:
    """How a built engine runs: intra-op threads per engine, optional core pinning, spinning.

    Spinning is off by default: on a 2-core machine a spinning idle pool steals the core
    the other model (draft or target) is computing on.
    """

    threads: int = 1
    pin_cores: tuple[int, ...] | None = None  # cores for intra-op worker threads (threads > 1)
    spin: bool = False

    @classmethod
    def from_manifest(cls, manifest: dict, threads: int | None = None) -> "SessionSettings":
        session = manifest["build"]["session"]
        pins = session["pin_cores"]
        return cls(threads=threads or session["threads"], pin_cores=tuple(pins) if pins else None,
                   spin=session["spin"])


def session_options(settings: SessionSettings,
                    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                    optimized_path: Path | None = None) -> ort.SessionOptions:
    """Threads, pinning and spinning from the build config; sequential execution (one
    request's steps are a chain, and the other core belongs to the other model)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = level
    options.log_severity_level = 3  # ORT warns about unused initializers of the exporter's
    spin = "1" if settings.spin else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if settings.pin_cores and settings.threads > 1:
        # ORT numbers logical processors from 1; worker threads exclude the caller's thread
        workers = [str(core + 1) for core in settings.pin_cores[:settings.threads - 1]]
        options.add_session_config_entry("session.intra_op_thread_affinities", ";".join(workers))
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return options


def open_session(path: Path, settings: SessionSettings) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), session_options(settings), providers=["CPUExecutionProvider"])


_NUMPY_TYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}


def _bind_input(binding, name: str, tensor: torch.Tensor) -> None:
    binding.bind_input(name, "cpu", 0, _NUMPY_TYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())


def _bind_output(binding, name: str, tensor: torch.Tensor) -> None:
    binding.bind_output(name, "cpu", 0, _NUMPY_TYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())


def _scalar(value, dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


class OnnxRuntimeEngine:
    """One model's graphs (`forward`, plus `verify` for a target or `branch_draft` and
    `kv_gather` for a draft), each an ORT session; see `runtime.engine.Engine`."""

    def __init__(self, sessions: dict, info: EngineInfo, tokenizer, shape: dict):
        self.sessions, self.info, self.tokenizer, self.limits = sessions, info, tokenizer, info.limits
        self.kv_dims = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"])
        self.vocab_size = shape["vocab_size"]
        self._no_draft_probs = torch.zeros(self.limits.max_draft_tokens, self.vocab_size)

    def new_cache(self, capacity: int) -> SlotKVCache:
        if capacity > self.limits.max_cache_entries:
            raise ValueError(f"cache capacity {capacity} exceeds what the engines were built for: "
                             f"max_context + (max_branches + 1) * max_draft_tokens + 1 = "
                             f"{self.limits.max_cache_entries}")
        gather = self._run_gather if "kv_gather" in self.sessions else None
        return SlotKVCache(*self.kv_dims, capacity, gather)

    def _bind_step(self, binding, cache: SlotKVCache, tokens, positions, mask) -> tuple[int, list]:
        """Bind a forward's inputs and its present K/V. Returns the new cache length and
        the bound input tensors, which must outlive the run (ORT reads their memory)."""
        past, count = cache.length, len(tokens)
        if past + count > cache.capacity:
            raise ValueError(f"KV cache overflow: {past} + {count} entries > capacity {cache.capacity}")
        if mask is None:
            mask = causal_mask(past, count)
        if tuple(mask.shape) != (count, past + count):
            raise ValueError(f"mask shape {tuple(mask.shape)} is not [n, cache length + n] = {[count, past + count]}")
        inputs = [t.to(dtype).reshape(1, *t.shape).contiguous() for t, dtype in
                  ((tokens, torch.int64), (positions, torch.int64), (mask, torch.bool))]
        for name, tensor in zip(("input_ids", "position_ids", "attention_mask"), inputs):
            _bind_input(binding, name, tensor)
        for name, tensor in zip(("past_keys", "past_values"), cache.live()):
            _bind_input(binding, name, tensor)
        for name, tensor in zip(("present_keys", "present_values"), cache.spare(past + count)):
            _bind_output(binding, name, tensor)
        return past + count, inputs

    def forward(self, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        session = self.sessions["forward"]
        binding = session.io_binding()
        length, _inputs = self._bind_step(binding, cache, tokens, positions, mask)
        logits = torch.empty(1, len(tokens), self.vocab_size)
        _bind_output(binding, "logits", logits)
        session.run_with_iobinding(binding)
        cache.swap(length)
        return logits[0]

    def verify(self, cache: SlotKVCache, tokens, positions, draft_tokens, draft_probs, uniforms,
               sampling: SamplingParams) -> tuple[int, int]:
        """One forward over `[last, d_1..d_K]` and the FusedVerify node: only `(a, t)` leaves."""
        if "verify" not in self.sessions:
            raise ValueError(f"{self.info.path}: this is a draft engine; it has no verify graph")
        k = len(draft_tokens)
        if k > self.limits.max_draft_tokens:
            raise ValueError(f"K={k} draft tokens exceeds the engines' max_draft_tokens "
                             f"{self.limits.max_draft_tokens}; rebuild with a larger --max-draft-tokens")
        if len(tokens) != k + 1 or len(uniforms) != k + 1:
            raise ValueError(f"verify takes K+1 = {k + 1} tokens ([last, d_1..d_K]) and uniforms, "
                             f"got {len(tokens)} and {len(uniforms)}")
        session = self.sessions["verify"]
        binding = session.io_binding()
        length, _inputs = self._bind_step(binding, cache, tokens, positions, None)
        probs = self._no_draft_probs[:k] if draft_probs is None else draft_probs.float().contiguous()
        extras = {"draft_tokens": torch.as_tensor(draft_tokens, dtype=torch.int64).contiguous(),
                  "draft_probs": probs, "uniforms": uniforms.float().contiguous(),
                  "temperature": _scalar(sampling.temperature, torch.float32),
                  "top_k": _scalar(sampling.top_k, torch.int64), "top_p": _scalar(sampling.top_p, torch.float32)}
        for name, tensor in extras.items():
            _bind_input(binding, name, tensor)
        outcome = {"accepted": _scalar(0, torch.int64), "bonus": _scalar(0, torch.int64)}
        for name, tensor in outcome.items():
            _bind_output(binding, name, tensor)
        session.run_with_iobinding(binding)
        cache.swap(length)
        return int(outcome["accepted"]), int(outcome["bonus"])

    def plan_branches(self, scores, draft_tokens, fanout, context_length: int) -> BranchPlan:
        if "branch_draft" not in self.sessions:
            raise ValueError(f"{self.info.path}: this is a target engine; it has no branch_draft graph")
        branches = int(torch.as_tensor(fanout).sum())
        if branches > self.limits.max_branches:
            raise ValueError(f"fan-out of {branches} branches exceeds the engines' max_branches "
                             f"{self.limits.max_branches}; rebuild with a larger --max-branches")
        feeds = {"scores": scores.float().numpy(), "draft_tokens": np.asarray(draft_tokens, dtype=np.int64),
                 "fanout": np.asarray(fanout, dtype=np.int64), "context_length": np.array(context_length, np.int64)}
        depth, token, rank, positions, window_mask = self.sessions["branch_draft"].run(None, feeds)
        return BranchPlan(*(torch.from_numpy(a) for a in (depth, token, rank, positions, window_mask)))

    def _run_gather(self, live, start: int, source_indices: torch.Tensor, spare) -> None:
        session = self.sessions["kv_gather"]
        binding = session.io_binding()
        for name, tensor in zip(("keys", "values"), live):
            _bind_input(binding, name, tensor)
        start_tensor = _scalar(start, torch.int64)
        _bind_input(binding, "start", start_tensor)
        _bind_input(binding, "source_indices", source_indices)
        for name, tensor in zip(("gathered_keys", "gathered_values"), spare):
            _bind_output(binding, name, tensor)
        session.run_with_iobinding(binding)


def open_engine(engine_dir: Path, role: str, manifest: dict, tokenizer, threads: int | None = None):
    """The `role` ("target" or "draft") engine of a validated engine directory."""
    model = manifest["models"][role]
    settings = SessionSettings.from_manifest(manifest, threads)
    sessions = {kind: open_session(engine_dir / files["engine"], settings)
                for kind, files in model["graphs"].items()}
    info = engine_info("onnxruntime", engine_dir, role, manifest)
    return OnnxRuntimeEngine(sessions, info, tokenizer, model["shape"])
