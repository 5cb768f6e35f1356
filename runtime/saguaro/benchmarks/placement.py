"""Where the target and the draft run: thread placements measured side by side by the
speed of SSD generation on one engine folder (`scripts/bench.py --placement`).

The options a 2-core machine has: one intra-op thread per engine (each model owns a
core), the target on two threads (it has the machine while the draft idles, and shares a
core with the draft while the draft pre-speculates), ONNX Runtime's spinning on or off,
and threads pinned to cores. ONNX Runtime pins only its own worker threads
(`session.intra_op_thread_affinities`, the build config's `session.pin_cores`), never
the thread that calls it, which with one thread is the whole engine; so a placement can
also pin the callers: the target's (the decoding loop) to core 0, the draft's (its worker
thread) to core 1.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from saguaro.runtime.engines import load_engine_tokenizer
from saguaro.runtime.engines.manifest import validate_engine_dir
from saguaro.runtime.engines.onnxruntime_engine import SessionSettings, open_engine
from saguaro.runtime.pipeline import Pipeline

TARGET_CORE, DRAFT_CORE = 0, 1


@dataclass(frozen=True)
class Placement:
    name: str
    target: SessionSettings
    draft: SessionSettings
    pin_callers: bool = False  # the target's calling thread on TARGET_CORE, the draft's on DRAFT_CORE


PLACEMENTS = (
    Placement("1+1 threads, no spin (build default)", SessionSettings(1), SessionSettings(1)),
    Placement("1+1 threads, spinning", SessionSettings(1, spin=True), SessionSettings(1, spin=True)),
    Placement("1+1 threads, callers pinned 0/1", SessionSettings(1), SessionSettings(1), pin_callers=True),
    Placement("target 2 threads, draft 1", SessionSettings(2), SessionSettings(1)),
    Placement("target 2 threads, spinning", SessionSettings(2, spin=True), SessionSettings(1)),
    Placement("target 2 pinned 0+1, draft pinned 1", SessionSettings(2, pin_cores=(DRAFT_CORE,)),
              SessionSettings(1), pin_callers=True),
)


class PinnedEngine:
    """An engine whose calls run on `cores`: each thread that calls it is pinned there at
    its first call. Everything else is the engine's own."""

    def __init__(self, engine, cores: set[int]):
        self._engine, self._cores = engine, cores
        self._pinned: set[int] = set()  # the threads (native ids) already pinned

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _pin_caller(self) -> None:
        caller = threading.get_native_id()
        if caller not in self._pinned:
            os.sched_setaffinity(0, self._cores)  # 0: the calling thread (Linux)
            self._pinned.add(caller)

    def forward_batch(self, steps):
        self._pin_caller()
        return self._engine.forward_batch(steps)

    def forward_rows(self, steps):
        self._pin_caller()
        return self._engine.forward_rows(steps)

    def verify_batch(self, steps):
        self._pin_caller()
        return self._engine.verify_batch(steps)

    def plan_branches(self, *args, **kwargs):
        self._pin_caller()
        return self._engine.plan_branches(*args, **kwargs)


def open_pair(engine_dir: Path, placement: Placement):
    """The folder's ONNX Runtime engines opened with the placement's session settings
    instead of the build's."""
    manifest = validate_engine_dir(engine_dir)
    if manifest["backend"] != "onnxruntime":
        raise ValueError(f"{engine_dir}: thread placement is measured on ONNX Runtime engines, "
                         f"not {manifest['backend']}")
    tokenizer = load_engine_tokenizer(engine_dir, manifest)
    target = open_engine(engine_dir, "target", manifest, tokenizer, settings=placement.target)
    draft = open_engine(engine_dir, "draft", manifest, tokenizer, settings=placement.draft)
    if placement.pin_callers:
        target, draft = PinnedEngine(target, {TARGET_CORE}), PinnedEngine(draft, {DRAFT_CORE})
    return target, draft


def placement_pipeline(engine_dir: Path, placement: Placement) -> Pipeline:
    if placement.pin_callers and cast(int, os.cpu_count()) < 2:
        raise ValueError("pinning the target and the draft to cores 0 and 1 needs two cores")
    return Pipeline(*open_pair(engine_dir, placement))


def unpin_this_thread() -> None:
    """Back on every core (a pinned placement pinned the caller)."""
    os.sched_setaffinity(0, range(cast(int, os.cpu_count())))
