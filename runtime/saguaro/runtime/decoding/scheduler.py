"""Iteration-level batching: one thread runs decoding rounds over every active request.

Requests join and leave between rounds (continuous batching, as TensorRT-LLM's in-flight
batcher and vLLM do): before each round the requests that finished or were cancelled
leave at once, and waiting requests join, as many as the KV slots allow, their prompts
prefilled together; then one round (`Decoder.decode_round`) verifies every active
request in one batched target forward while the draft worker pre-speculates for all of
them. Requests beyond the slots wait in order (`queued`). A request's tokens go to its
`on_tokens` as each round commits them; its `Generation` completes its future.

Nothing a request computes depends on the others in its batch: its own KV slot,
positions, mask and keyed randomness, and engines that compute each sequence's rows
without the others' (ONNX Runtime's graphs row by row, bit for bit; the torch engine one
sequence per forward; `tests/test_row_independence.py`). So greedy output is the same
whatever joins or leaves around it (`tests/test_batching.py`; 0 differing generations
of 1000 x 64 tokens in batches of 16, docs/exactness.md). A seeded sample is too, except
through the load policy: its pre-speculation (which the company sways) can change a
draft distribution in its last bits; docs/exactness.md counts how often that moved a
sample.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable

from saguaro.runtime.control.round_report import RoundReport
from saguaro.runtime.decoding.decoder import Decoder, Sequence
from saguaro.runtime.decoding.requests import Request

LOG = logging.getLogger(__name__)

OnRound = Callable[[list[Sequence], RoundReport], None]  # told of each round's batch and report, after it ran


class Scheduler:
    def __init__(self, decoder: Decoder, max_active: int, on_round: OnRound | None = None):
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        self.decoder, self.max_active, self.on_round = decoder, max_active, on_round
        self._waiting: deque[tuple[Request, Future]] = deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._active = 0

    @property
    def queued(self) -> int:
        """Requests waiting for a KV slot."""
        with self._condition:
            return len(self._waiting)

    @property
    def load(self) -> int:
        """Requests decoding or waiting."""
        with self._condition:
            return len(self._waiting) + self._active

    def submit(self, request: Request) -> Future:
        """Queue a request; the future's result is its `Generation` (or its error)."""
        future: Future = Future()
        with self._condition:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._waiting.append((request, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
                self._thread.start()
            self._condition.notify()
        return future

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        active: list[tuple[Sequence, Future]] = []
        while True:
            joining = self._take(self.max_active - len(active), wait=not active)
            if joining is None:
                return  # closed, and nothing left to run
            active = self._retire(active + self._start(joining))  # some end at their prefill
            with self._condition:
                self._active = len(active)
            if active:
                self._round(active)
                # those that finished leave now, so that the next take fills their slots
                # (taken before, a slot freed by a round stayed empty for one more round)
                active = self._retire(active)

    def _take(self, room: int, wait: bool) -> list[tuple[Request, Future]] | None:
        with self._condition:
            while wait and not self._waiting and not self._closed:
                self._condition.wait()
            if wait and not self._waiting:
                return None
            taken: list[tuple[Request, Future]] = []
            while self._waiting and len(taken) < room:
                taken.append(self._waiting.popleft())
            return taken

    def _start(self, joining: list[tuple[Request, Future]]) -> list[tuple[Sequence, Future]]:
        if not joining:
            return []
        try:
            sequences = self.decoder.start([request for request, _ in joining])
        except Exception as error:  # noqa: BLE001 - each caller hears of it, the others run on
            for _, future in joining:
                future.set_exception(error)
            return []
        return list(zip(sequences, (future for _, future in joining)))

    def _retire(self, active: list[tuple[Sequence, Future]]) -> list[tuple[Sequence, Future]]:
        """Cancelled requests stop, finished ones leave: their futures complete."""
        running = []
        for sequence, future in active:
            sequence.check_cancelled()
            if sequence.done:
                future.set_result(sequence.finish())
            else:
                running.append((sequence, future))
        return running

    def _round(self, active: list[tuple[Sequence, Future]]) -> None:
        batch = [sequence for sequence, _ in active]
        try:
            report = self.decoder.decode_round(batch)
        except Exception as error:  # noqa: BLE001 - a failed round fails its batch, not the server
            for sequence, future in active:
                sequence.finish()  # frees its KV slots
                future.set_exception(error)
            active.clear()
            return
        if self.on_round is not None:
            try:
                self.on_round(batch, report)
            except Exception:  # noqa: BLE001 - an observer that fails must not stop the decoding thread
                LOG.exception("the round observer failed; decoding goes on")
