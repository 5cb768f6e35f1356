"""KV caches: a pool of per-sequence slots (the torch and ONNX Runtime engines), and the
two-slot cache of the TensorRT engine.

A cache holds one sequence. The index of an entry is not its position: branch entries of
a draft tree sit after the prefix with positions of their own. Entries `[0, length)` are
live; `truncate` rolls back, `gather` commits a branch (keep `[0, start)`, then the
entries at `source_indices`, in order), `fork` copies, `release` frees the slot.
"""
from __future__ import annotations

import threading
import weakref
from typing import cast

import numpy as np
import torch


class KVPool:
    """The KV caches of up to `slots` sequences of one model, in one buffer
    `[layers, 2 (keys, values), slots, kv_heads, capacity, head_dim]` float32.

    A sequence owns one slot (`allocate`). Layer i of the slots `first..last` is the
    contiguous view `buffer[i, k|v, first:last + 1]`: a batched forward binds it as both
    its past input and its present output, so new entries are written in place and a
    step copies nothing. The buffer is numpy memory that torch views without a copy.
    A slot is free again when its cache is released or garbage-collected.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int):
        self.buffer = np.zeros((layers, 2, slots, kv_heads, capacity, head_dim), np.float32)
        self.tensor = torch.from_numpy(self.buffer)
        self.capacity = capacity
        self._free = list(range(slots))
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        return self.buffer.shape[2]

    def allocate(self, capacity: int) -> "PooledCache":
        if capacity > self.capacity:
            raise ValueError(f"cache capacity {capacity} exceeds the {self.capacity} entries a slot holds")
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.slots} KV slots are in use (the engines' max_batch); "
                                   "release a cache or build with a larger --max-batch")
            slot = min(self._free)  # low slots first: a batch then binds a short range
            self._free.remove(slot)
        return PooledCache(self, slot, capacity)

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def entries(self, slot: int) -> np.ndarray:
        """`[layers, 2, kv_heads, capacity, head_dim]`: one slot's keys and values (a view)."""
        return self.buffer[:, :, slot]

# TensorRT's setTensorAddress requires 256-byte aligned pointers; the views a cache binds
# start at multiples of this from its buffer, whose own start the allocators align further
# (torch's CUDA caching allocator: 512 bytes).
VIEW_ALIGNMENT_BYTES = 256


def aligned_length(count: int, element_size: int, alignment: int = VIEW_ALIGNMENT_BYTES) -> int:
    """`count` elements rounded up so that the next one starts `alignment`-aligned."""
    per_block = alignment // element_size
    return -(-count // per_block) * per_block


def check_truncate(current: int, length: int) -> None:
    """A cache of `current` entries may roll back to `length` (every cache's rule)."""
    if not 0 <= length <= current:
        raise ValueError(f"cannot truncate a cache of length {current} to {length}")


def check_gather(current: int, start: int, source_indices) -> np.ndarray:
    """A branch commit's sources within a cache of `current` entries; returns them as int64."""
    sources = np.asarray(source_indices, dtype=np.int64)
    if not 0 <= start <= current or (len(sources) and not 0 <= sources.min() <= sources.max() < current):
        raise ValueError(f"gather({start}, {sources.tolist()}) is outside the cache's {current} entries")
    return sources


class PooledCache:
    """One sequence's cache: a slot of a `KVPool` and its live length."""

    def __init__(self, pool: KVPool, slot: int, capacity: int):
        self.pool, self.slot, self._capacity = pool, slot, capacity
        self.length = 0
        self._free_slot = weakref.finalize(self, pool._release, slot)

    @property
    def capacity(self) -> int:
        return self._capacity

    def truncate(self, length: int) -> None:
        """Roll back: entries past `length` are dead and the next forward overwrites them."""
        check_truncate(self.length, length)
        self.length = length

    def gather(self, start: int, source_indices: torch.Tensor) -> None:
        """Keep `[0, start)`, then the entries at `source_indices`, in order (a branch commit),
        in place. Sources lie at or after their destinations; the gather reads before it writes."""
        sources = check_gather(self.length, start, source_indices)
        entries = self.pool.entries(self.slot)
        entries[..., start:start + len(sources), :] = entries[..., sources, :]
        self.length = start + len(sources)

    def fork(self) -> "PooledCache":
        twin = self.pool.allocate(self._capacity)
        self.pool.entries(twin.slot)[..., :self.length, :] = self.pool.entries(self.slot)[..., :self.length, :]
        twin.length = self.length
        return twin

    def release(self) -> None:
        self._free_slot()


class SlotKVCache:
    """The compiled engines' cache, for graphs that take past K/V and return present K/V
    (`[layers, 1, kv_heads, entries, head_dim]`) without copies outside the graph.

    Two flat buffers ("slots"): the live cache is a contiguous view of one slot's prefix,
    bound as the graph's past input, and present is bound straight into the other slot,
    which then becomes live. Only a change of layout copies, once: truncation, a branch
    commit (a `GatherKV` graph when given, else torch) and fork. The TensorRT engine
    keeps its slots on the GPU; each of the four (slot, keys/values) regions starts
    `VIEW_ALIGNMENT_BYTES`-aligned, as TensorRT requires of every bound address (the
    padding costs ONNX Runtime nothing)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, gather_graph=None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.dims, self._capacity = (layers, kv_heads, head_dim), capacity
        region = aligned_length(layers * kv_heads * capacity * head_dim, dtype.itemsize)
        self._slots = torch.zeros(2, 2, region, device=device, dtype=dtype)  # [slot, k/v, flat]
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
        pair = tuple(self._slots[slot, i, :size].view(layers, 1, heads, entries, dim) for i in (0, 1))
        return cast("tuple[torch.Tensor, torch.Tensor]", pair)

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view(self._live, self.length)

    def spare(self, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view(1 - self._live, entries)

    def swap(self, length: int) -> None:
        """The spare slot, just written with `length` entries, becomes the live one."""
        self._live, self.length = 1 - self._live, length

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        if length == self.length:
            return
        for source, target in zip(self.live(), self.spare(length)):
            _copy(target, source[:, :, :, :length])
        self.swap(length)

    def gather(self, start: int, source_indices: torch.Tensor) -> None:
        """Keep `[0, start)`, then the entries at `source_indices`, in order (a branch commit)."""
        check_gather(self.length, start, source_indices)
        source_indices = torch.as_tensor(source_indices, dtype=torch.int64).contiguous()
        count = len(source_indices)
        if self._gather_graph is not None:
            self._gather_graph(self.live(), start, source_indices, self.spare(start + count))
        else:
            for source, target in zip(self.live(), self.spare(start + count)):
                _copy(target[:, :, :, :start], source[:, :, :, :start])
                _copy(target[:, :, :, start:], source[:, :, :, source_indices])
        self.swap(start + count)

    def release(self) -> None:
        """Its memory goes with the object (the TensorRT engine allocates per sequence)."""

    def fork(self) -> "SlotKVCache":
        twin = SlotKVCache(*self.dims, self._capacity, self._gather_graph, self._slots.device, self._slots.dtype)
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
