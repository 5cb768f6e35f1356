"""The `Engine` protocol over ONNX Runtime graphs built by `scripts/build_engines.py`.

KV cache without per-step copies: the graphs take past K/V and return present K/V
(`[layers, 1, kv_heads, entries, head_dim]`, the export form). A cache owns two flat
buffers ("slots"); the live cache is a contiguous view of one slot's prefix, bound as the
graph's past input through IOBinding, and present is bound straight into the other slot,
which then becomes live. So a step copies nothing outside the graph (its Concat is the
only copy). Only a change of layout copies, once: truncation (rolled-back drafts), a
branch commit (the `GatherKV` graph) and fork.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from plugins.branch_draft.reference import BranchPlan
from runtime.engine import EngineInfo, causal_mask
from runtime.engines import EngineLimits
from runtime.sampling import SamplingParams


class SlotKVCache:
    """One sequence's keys and values in two slots (see the module docstring). The TensorRT
    engine uses the same class with its slots on the GPU."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, gather_graph=None,
                 device: str = "cpu"):
        self.dims, self._capacity = (layers, kv_heads, head_dim), capacity
        self._slots = torch.zeros(2, 2, layers * kv_heads * capacity * head_dim, device=device)  # [slot, k/v, flat]
        self._live = 0
        self._gather_graph = gather_graph  # runs GatherKV; None: gather with torch
        self.length = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def view(self, slot: int, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values of `slot` laid out for `entries` entries: contiguous, batch 1."""
        layers, heads, dim = self.dims
        size = layers * heads * entries * dim
        return tuple(self._slots[slot, i, :size].view(layers, 1, heads, entries, dim) for i in (0, 1))

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view(self._live, self.length)

    def spare(self, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view(1 - self._live, entries)

    def swap(self, length: int) -> None:
        """The spare slot, just written with `length` entries, becomes the live one."""
        self._live, self.length = 1 - self._live, length

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if length == self.length:
            return
        for source, target in zip(self.live(), self.spare(length)):
            _copy(target, source[:, :, :, :length])
        self.swap(length)

    def gather(self, start: int, source_indices: torch.Tensor) -> None:
        """Keep `[0, start)`, then the entries at `source_indices`, in order (a branch commit)."""
        source_indices = torch.as_tensor(source_indices, dtype=torch.int64).contiguous()
        count = len(source_indices)
        if not 0 <= start <= self.length or (count and not 0 <= int(source_indices.min())
                                               <= int(source_indices.max()) < self.length):
            raise ValueError(f"gather({start}, {source_indices.tolist()}) is outside the "
                             f"cache's {self.length} entries")
        if self._gather_graph is not None:
            self._gather_graph(self.live(), start, source_indices, self.spare(start + count))
        else:
            for source, target in zip(self.live(), self.spare(start + count)):
                _copy(target[:, :, :, :start], source[:, :, :, :start])
                _copy(target[:, :, :, start:], source[:, :, :, source_indices])
        self.swap(start + count)

    def fork(self) -> "SlotKVCache":
        twin = SlotKVCache(*self.dims, self._capacity, self._gather_graph, self._slots.device)
        for source, target in zip(self.live(), twin.view(0, self.length)):
            _copy(target, source)
        twin.length = self.length
        return twin


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """Host copies go through numpy: single-threaded, so no torch OpenMP pool wakes up and
    spins on the core the other model runs on (measured: 3-4x slower ORT steps)."""
    if target.device.type == "cpu":
        np.copyto(target.numpy(), source.numpy())
    else:
        target.copy_(source)


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

    def __init__(self, sessions: dict, info: EngineInfo, tokenizer, shape: dict, limits: EngineLimits):
        self.sessions, self.info, self.tokenizer, self.limits = sessions, info, tokenizer, limits
        self.kv_dims = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"])
        self.vocab_size = shape["vocab_size"]
        self._no_draft_probs = torch.zeros(limits.max_draft_tokens, self.vocab_size)

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
    from build.config import SessionSettings
    from build.onnxruntime_builder import open_session

    model = manifest["models"][role]
    session = manifest["build"]["session"]
    settings = SessionSettings(threads=threads or session["threads"],
                               pin_cores=tuple(session["pin_cores"]) if session["pin_cores"] else None,
                               spin=session["spin"])
    sessions = {kind: open_session(engine_dir / files["engine"], settings)
                for kind, files in model["graphs"].items()}
    limits = EngineLimits.from_manifest(manifest)
    info = EngineInfo(backend="onnxruntime", path=str(engine_dir / role), vocab_size=model["shape"]["vocab_size"],
                      max_context=limits.max_context, eos_token_id=model["eos_token_id"],
                      bos_token_id=model["bos_token_id"], tokenizer_fingerprint=model["tokenizer_fingerprint"],
                      max_draft_tokens=limits.max_draft_tokens, max_branches=limits.max_branches)
    return OnnxRuntimeEngine(sessions, info, tokenizer, model["shape"], limits)
