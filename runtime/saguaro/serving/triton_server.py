"""A real Triton Inference Server in a process of its own: the `tritonserver` bundled in the
nvidia-pytriton wheel, with its Python backend, started on a filled model repository with
the library path its Python stub needs, watched until ready, drained and stopped.

How it stops: the SSD model is asked to drain first (Triton itself would strand every
in-flight ensemble request, see saguaro/serving/lifecycle.py), then Triton is told to
stop, and its process group is killed if it has not exited a few seconds later (Triton
2.51 waits forever for gRPC streams that clients keep open). `launch.py` is the command
line around it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import tritonclient.grpc as grpcclient

from saguaro.serving.client import CompletionError, infer_inputs, stream_responses
from saguaro.serving.lifecycle import CONTROL_TOKEN_ENV, STOP_GRACE_S, DrainReport, drain_inputs

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
READY_TIMEOUT_S = 180.0  # loading torch in three stubs on a busy 2-core machine
DRAIN_TIMEOUT_S = 10.0   # how long in-flight requests may run on once a stop is asked for
# Triton's own bound, once told to stop, on waiting for in-flight requests and then for
# its models to unload. After a drain no request is left, so this is mostly unloading the
# three Python stubs (1-4 s, more on a busy machine); without a drain (SIGINT sent to
# tritonserver directly) the ensemble requests in flight cannot complete anyway (their
# next step is refused), so a longer wait would only delay the exit.
TRITON_EXIT_TIMEOUT_S = 15
EXIT_GRACE_S = 3.0       # beyond Triton's exit timeout, before the process group is killed
# Once Triton has unloaded every model that runs code (the Python models, whose finalize
# is the last of the generations), nothing is left to wait for, yet Triton 2.51 may never
# exit by itself: a gRPC stream that has carried an ensemble request keeps the ensemble
# model alive until the client closes it, and gRPC is shut down without a deadline.
UNLOADED = re.compile(r"successfully unloaded '([^']+)'")
UNLOADED_EXIT_S = 0.5    # time to exit by itself after that, before it is killed
SIGNALED = re.compile(r"Signal \((\d+)\) received")


@dataclass(frozen=True)
class TritonInstall:
    """The server and Python backend bundled in the nvidia-pytriton wheel."""

    server: Path
    python_backend: Path  # libtriton_python.so, triton_python_backend_utils.py
    stub: Path            # the stub built for this interpreter's Python version
    libraries: Path       # shared libraries the server and the stub link against


def find_bundled_triton() -> TritonInstall:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed in this environment (pip install -e .)")
    package = Path(list(spec.submodule_search_locations)[0])
    root = package / "tritonserver"
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(server=root / "bin" / "tritonserver", python_backend=root / "backends" / "python",
                            stub=root / "python_backend_stubs" / python_version / "triton_python_backend_stub",
                            libraries=package.parent / "nvidia_pytriton.libs")
    for path in (install.server, install.python_backend, install.stub, install.libraries):
        if not path.exists():
            raise RuntimeError(f"the nvidia-pytriton install lacks {path} (Python {python_version} needs its stub)")
    return install


def prepare_backends(install: TritonInstall, run_dir: Path) -> Path:
    """A backend folder whose Python backend uses the stub matching this interpreter."""
    python = run_dir / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(install.python_backend / name, python / name)
    shutil.copy2(install.stub, python / install.stub.name)
    return run_dir / "backends"


def server_environment(install: TritonInstall) -> dict[str, str]:
    """The stub links libpython (this interpreter's LIBDIR first, so the versions match)
    and the wheel's bundled libraries; it finds packages through `python3` on PATH."""
    env = dict(os.environ)
    libraries = [sysconfig.get_config_var("LIBDIR") or "", str(install.libraries), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(path for path in libraries if path)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


LOCALHOST = "127.0.0.1"
WILDCARDS = {"0.0.0.0", "::", ""}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        return probe.getsockname()[1]


def answers(url: str) -> bool:
    """An HTTP GET of `url` returns 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def local_address(host: str) -> str:
    """Where this machine reaches a server bound to `host`: a wildcard bind (every
    interface) answers on the loopback; any other address is itself."""
    return LOCALHOST if host in WILDCARDS else host


def check_host(host: str) -> str:
    """The bind address, checked before anything starts (ValueError names it)."""
    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"--host {host!r} is not an address or host name this machine resolves: {error}") from None
    return host


@dataclass(frozen=True)
class Ports:
    grpc: int = 8001
    http: int = 8000
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        return cls(free_port(), free_port(), free_port())


class Interrupted(Exception):
    """A stop was asked for while the server was starting."""


def pending_signals(pid: int) -> set[int]:
    """Signals pending for a process (Linux /proc): a SIGTERM sent to the server, which
    runs with SIGTERM blocked (saguaro/serving/guarded_exec.py), shows up here."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return set()
    pending = 0
    for match in re.finditer(r"^(?:ShdPnd|SigPnd):\s*([0-9a-f]+)$", status, re.MULTILINE):
        pending |= int(match.group(1), 16)
    return {signum for signum in range(1, 65) if pending & (1 << (signum - 1))}


@dataclass(frozen=True)
class StopReport:
    drain: DrainReport | None  # None: there was nothing to drain, or the drain request failed
    exit_code: int | None
    killed: bool               # the process group had to be killed
    unloaded: bool             # every model that runs code had unloaded by then
    seconds: float

    @property
    def drained(self) -> bool:
        """Every request in flight finished on its own."""
        return self.drain is not None and self.drain.complete


@dataclass
class TritonServer:
    """One tritonserver process over a prepared model repository; a context manager."""

    model_repo: Path
    run_dir: Path
    ports: Ports = field(default_factory=Ports)
    host: str = LOCALHOST  # the bind address of all three endpoints
    shm_prefix: str = field(default_factory=lambda: f"{SHM_PREFIX}saguaro_{uuid.uuid4().hex[:8]}_")
    control_token: str = field(default_factory=lambda: secrets.token_hex(16))
    process: subprocess.Popen | None = None
    # What happened to the process, for telling a clean stop from a crash.
    signals_sent: set[int] = field(default_factory=set, init=False)
    signals_logged: set[int] = field(default_factory=set, init=False)
    log_size_checked: int = field(default=-1, init=False)
    killed_after_unload: bool = field(default=False, init=False)

    @property
    def log_path(self) -> Path:
        return self.run_dir / "tritonserver.log"

    @property
    def address(self) -> str:
        """Where the launcher (and local clients) reach the server."""
        return local_address(self.host)

    def command(self, install: TritonInstall, backends: Path) -> list[str]:
        address = self.host
        guarded = [sys.executable, "-m", "saguaro.serving.guarded_exec", str(os.getpid())]
        return guarded + [
            str(install.server), f"--model-repository={self.model_repo}", f"--backend-directory={backends}",
            f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}",
            f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}", "--allow-gpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={TRITON_EXIT_TIMEOUT_S}"]

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S,
              interrupted: Callable[[], bool] = lambda: False) -> "TritonServer":
        install = find_bundled_triton()
        backends = prepare_backends(install, self.run_dir)
        env = {**server_environment(install), CONTROL_TOKEN_ENV: self.control_token}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(install, backends), stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        try:
            self.wait_ready(ready_timeout_s, interrupted)
        except BaseException:
            self.stop(drain_timeout_s=None)
            raise
        return self

    def is_ready(self) -> bool:
        """Ready on all three endpoints: Triton reports its models ready over HTTP before its
        metrics endpoint listens (a load benchmark's first scrape right after HTTP said ready
        was refused once), and clients use gRPC."""
        return (answers(f"http://{self.address}:{self.ports.http}/v2/health/ready")
                and answers(f"http://{self.address}:{self.ports.metrics}/metrics")
                and accepts_connections(self.address, self.ports.grpc))

    def wait_ready(self, timeout_s: float, interrupted: Callable[[], bool] = lambda: False) -> None:
        assert self.process is not None  # start made it
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            if interrupted():
                raise Interrupted()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None, "tritonserver was not started"
        return self.process.pid

    def asked_to_stop(self) -> bool:
        """Someone sent the server SIGTERM (blocked, so pending: ours to handle)."""
        return self.running and signal.SIGTERM in pending_signals(self.pid)

    def stopping_by_itself(self) -> bool:
        """Triton began its own undrained stop (a signal it handles reached it from elsewhere)
        or crashed (it logs the signal either way). Rereads the log only when it grew."""
        size = self.log_path.stat().st_size if self.log_path.exists() else 0
        if size != self.log_size_checked:
            self.log_size_checked = size
            self.signals_logged = {int(number) for number in SIGNALED.findall(self.log_text())}
        return bool(self.signals_logged - self.signals_sent)

    def drain(self, timeout_s: float) -> DrainReport:
        """Ask the SSD model to drain (lifecycle.py); CompletionError if it cannot."""
        with grpcclient.InferenceServerClient(f"{self.address}:{self.ports.grpc}") as client:
            inputs = infer_inputs(drain_inputs(self.control_token, timeout_s))
            for result in stream_responses(client, "ssd", inputs, timeout_s=timeout_s + STOP_GRACE_S + 10):
                report = result.as_numpy("drain_report")
        return DrainReport.from_json(report.reshape(-1)[0].decode())

    def stop(self, drain_timeout_s: float | None = DRAIN_TIMEOUT_S,
             before_stop: Callable[[], object] = lambda: None) -> StopReport:
        """Drain (unless `drain_timeout_s` is None), run `before_stop` (the HTTP front end
        lets its drained requests finish), tell Triton to stop (SIGINT: SIGTERM is blocked
        in it), kill it if it lingers; then remove its shared-memory regions."""
        started, drained, killed = time.monotonic(), None, False
        if self.running and drain_timeout_s is not None:
            try:
                drained = self.drain(drain_timeout_s)
            except CompletionError as error:
                print(f"serve: the drain request failed, stopping without it: {error}", file=sys.stderr)
        before_stop()
        if self.running:
            assert self.process is not None  # running
            self.signals_sent.add(int(signal.SIGINT))
            self.process.send_signal(signal.SIGINT)
            killed = self.wait_for_exit(TRITON_EXIT_TIMEOUT_S + EXIT_GRACE_S)
        for region in self.shm_regions():
            region.unlink(missing_ok=True)
        return StopReport(drained, None if self.process is None else self.process.returncode, killed,
                          self.killed_after_unload or not killed, round(time.monotonic() - started, 2))

    def backend_models(self) -> set[str]:
        """The models that run code: every model but the ensembles."""
        return {config.parent.name for config in self.model_repo.glob("*/config.pbtxt")
                if not re.search(r'^platform:\s*"ensemble"', config.read_text(), re.MULTILINE)}

    def backend_models_unloaded(self) -> bool:
        return self.backend_models() <= set(UNLOADED.findall(self.log_text()))

    def wait_for_exit(self, timeout_s: float) -> bool:
        """Wait for the process to exit; kill its group (the stubs too) at the timeout, or
        shortly after Triton has unloaded every model that runs code. True if killed."""
        assert self.process is not None  # stop calls it on a running server
        deadline, unloaded_at = time.monotonic() + timeout_s, None
        while self.process.poll() is None:
            now = time.monotonic()
            if unloaded_at is None and self.backend_models_unloaded():
                unloaded_at = now
            if now > deadline or (unloaded_at is not None and now - unloaded_at > UNLOADED_EXIT_S):
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                self.killed_after_unload = unloaded_at is not None
                return True
            time.sleep(0.05)
        return False

    @property
    def stopped_cleanly(self) -> bool:
        """Exited 0 (or was killed only once every model that runs code had unloaded),
        without a crash and without abandoning requests still in flight."""
        log = self.log_text()
        crashed = re.search(r"Signal \((?!(?:2|15)\))", log)  # 2 and 15 ask for a stop; 11, 6 are crashes
        exited = self.process is not None and (self.process.returncode == 0 or self.killed_after_unload)
        return exited and "Exit timeout expired" not in log and not crashed

    def shm_regions(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info) -> None:
        self.stop()
