"""Which generations are live, why one must stop, and draining them all at shutdown.

Triton gives a Python model no word of a coming shutdown: on SIGTERM it stops every
model's scheduler at once, so an ensemble request whose next step (postprocessing) is
refused never completes, and the model itself hears of it only in `finalize`, after
the server has given up waiting. A graceful stop must therefore happen before Triton
is told to stop: the launcher sends the generation model a drain request (`drain`
below), the model refuses new generations, lets the running ones finish until the
deadline, stops the rest with a final response that says why, and answers with a
`DrainReport`; only then does the launcher stop the server.

Independent of how generations are scheduled (a thread each today, a batching
scheduler later): a scheduler registers each request with `Generations.start`, asks
its `Live.reason` once per round, and calls `Generations.end` after the final response.
A direct request's cancellation reaches its `Live` through `CancelWatch`.
"""
from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from saguaro.runtime.pipeline import RequestError

CANCELLED = "cancelled"  # the client cancelled or went away
SHUTDOWN = "shutdown"    # the drain deadline passed, or the server is unloading the model
# The launcher puts a fresh secret here in the server's environment; a drain request
# must carry it, so no client can take the server out of service.
CONTROL_TOKEN_ENV = "SAGUARO_CONTROL_TOKEN"
# After the deadline, how long stopped generations get to send their final response:
# they stop at their next round, and a round takes milliseconds.
STOP_GRACE_S = 5.0
# Asking Triton whether a direct request is cancelled is a round trip to the server
# process (0.5-1 ms, measured): one thread (`CancelWatch`) asks about every open request
# every 50 ms, off the scheduler's thread, where asking every 10 ms per request had taken
# a sixth of the rounds' time at 16 streams. (Requests through the ensemble hear of it
# through the postprocessing relay instead.)
CANCEL_POLL_S = 0.05


class ServerDraining(Exception):
    """A new generation arrived while the server drains for shutdown."""

    def __str__(self) -> str:
        return "the server is shutting down and takes no new requests; retry on another server"


@dataclass
class Live:
    """One registered generation; `reason` says why it must stop (None: it need not)."""

    generation_id: int
    reason: str | None = None

    def stop(self, reason: str) -> None:
        if self.reason is None:  # the first reason is the one the client hears
            self.reason = reason


@dataclass(frozen=True)
class DrainReport:
    in_flight: int             # generations live when the drain began
    finished: int              # of those, ended on their own before the deadline
    stopped_at_deadline: int   # stopped with finish reason "shutdown"
    still_running: int         # had not ended STOP_GRACE_S after being stopped
    waited_s: float

    @property
    def complete(self) -> bool:
        """Every generation in flight ended on its own."""
        return self.stopped_at_deadline == 0 and self.still_running == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DrainReport":
        return cls(**json.loads(text))


@dataclass
class Generations:
    """Live generations by id. Ids are unguessable: the cancellation relay carries one
    back from the postprocessing model, and one client must not stop another's."""

    live: dict[int, Live] = field(default_factory=dict)
    draining: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)

    def refuse_new(self) -> None:
        with self.changed:
            self.draining = True

    def start(self) -> Live:
        """Register a generation; ServerDraining once a drain has begun."""
        with self.changed:
            if self.draining:
                raise ServerDraining()
            generation = Live(secrets.randbits(63))
            self.live[generation.generation_id] = generation
            return generation

    def end(self, generation_id: int) -> None:
        with self.changed:
            self.live.pop(generation_id, None)
            self.changed.notify_all()

    def cancel(self, generation_id: int, reason: str = CANCELLED) -> None:
        with self.changed:
            generation = self.live.get(generation_id)
            if generation is not None:
                generation.stop(reason)

    def stop_all(self, reason: str) -> int:
        """Ask every live generation to stop; how many there were."""
        with self.changed:
            for generation in self.live.values():
                generation.stop(reason)
            return len(self.live)

    def wait_until_none(self, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: not self.live, timeout=max(timeout_s, 0.0))

    def drain(self, timeout_s: float, stop_grace_s: float = STOP_GRACE_S) -> DrainReport:
        """Refuse new generations, wait up to `timeout_s` for the live ones, then stop
        the rest (finish reason "shutdown") and give them `stop_grace_s` to end."""
        started = time.monotonic()
        with self.changed:
            self.draining = True
            in_flight = len(self.live)
        stopped = 0 if self.wait_until_none(timeout_s) else self.stop_all(SHUTDOWN)
        if stopped:
            self.wait_until_none(stop_grace_s)
        with self.changed:
            still_running = len(self.live)
        return DrainReport(in_flight=in_flight, finished=in_flight - stopped, stopped_at_deadline=stopped,
                           still_running=still_running, waited_s=round(time.monotonic() - started, 3))


# --- the drain request: what the launcher sends the generation model -----------------

@dataclass(frozen=True)
class DrainRequest:
    timeout_s: float


def drain_inputs(token: str, timeout_s: float) -> dict[str, np.ndarray]:
    """The inputs of a drain request, as `[1, 1]` arrays (the batch dimension first)."""
    return {"control": np.array([[b"drain"]], dtype=object),
            "control_token": np.array([[token.encode()]], dtype=object),
            "drain_timeout_s": np.array([[timeout_s]], dtype=np.float32)}


def text_of(array) -> str:
    value = np.asarray(array).reshape(-1)
    if value.size != 1:
        raise RequestError(f"a control input must hold one value, got {value.size}")
    return value[0].decode("utf-8", "replace") if isinstance(value[0], bytes) else str(value[0])


def parse_drain_request(get, expected_token: str | None) -> DrainRequest:
    """Check a control request (RequestError naming the input at fault)."""
    command = text_of(get("control"))
    if command != "drain":
        raise RequestError(f"input 'control': the only command is 'drain', got {command!r}")
    token = get("control_token")
    if not expected_token:
        raise RequestError("control requests are disabled: the server was not started with a control token")
    if token is None or not hmac.compare_digest(text_of(token).encode(), expected_token.encode()):
        raise RequestError("input 'control_token' does not match the server's control token")
    timeout = get("drain_timeout_s")
    timeout_s = float(np.asarray(timeout).reshape(-1)[0]) if timeout is not None else 10.0
    if not (timeout_s >= 0):
        raise RequestError(f"input 'drain_timeout_s' must be >= 0, got {timeout_s}")
    return DrainRequest(timeout_s)


class CancelWatch:
    """One thread that asks Triton, every `CANCEL_POLL_S`, whether each open request was
    cancelled, and stops its generations. A request is asked only while it is open: its
    closing response takes it off (`forget`, under the same lock as the asking), since
    asking about a request Triton has released would touch freed memory."""

    def __init__(self):
        self.open: dict[int, tuple] = {}  # id(replies) -> (request, lives)
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self.run, name="ssd-cancel-watch", daemon=True)
        self.thread.start()

    def watch(self, replies, request, lives) -> None:
        with self.lock:
            self.open[id(replies)] = (request, lives)

    def forget(self, replies) -> None:
        with self.lock:
            self.open.pop(id(replies), None)

    def run(self) -> None:
        while not self.stopped.wait(CANCEL_POLL_S):
            with self.lock:
                keys = list(self.open)
            for key in keys:  # one at a time: a closing response waits for one question at most
                with self.lock:
                    request, lives = self.open.get(key, (None, ()))
                    if request is not None and request.is_cancelled():
                        for live in lives:
                            live.stop(CANCELLED)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
