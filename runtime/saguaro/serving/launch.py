"""Serve SSD with a real Triton Inference Server (and an OpenAI-compatible API) until interrupted.

    python scripts/serve.py --engines engines/tiny
    python scripts/serve.py --engines engines/tiny --host 0.0.0.0 --openai-port 9000
    python scripts/serve.py --target models/tiny/target --draft models/tiny/draft --grpc-port 9001

Installs nothing. The server is the `tritonserver` (2.51) bundled in the nvidia-pytriton
wheel, with its Python backend. This script prepares a run
folder (filled model repository, backend folder, log), starts the server with the
library path its Python stub needs, waits until it is ready and prints one line.

On Ctrl-C or SIGTERM (to this script or to the `tritonserver` it runs) it drains: the
SSD model takes no new requests, the running ones may finish until `--drain-timeout`,
the rest end with finish reason "shutdown"; only then is Triton told to stop (Triton
itself would strand every in-flight ensemble request, see saguaro/serving/lifecycle.py),
and the process is killed if it has not exited a few seconds later (Triton 2.51 waits
forever for gRPC streams that clients keep open). Exit code 0: every request in flight
finished and the server stopped cleanly; 3: the deadline cut requests short, or the
drain failed; 1: the server failed or stopped on its own; 2: bad arguments.
"""
from __future__ import annotations

import argparse
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
from saguaro.serving.model_repo import add_source_arguments, prepare_model_repo, values_from_args
from saguaro.serving.openai_server import FrontEnd, OpenAIServer, ServedModel
from saguaro.serving.ssd_stream import SsdStream

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
        try:
            with urllib.request.urlopen(f"http://{self.address}:{self.ports.http}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

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


def serve(values: dict[str, str], run_dir: Path, ports: Ports,
          interrupted: Callable[[], bool] = lambda: False, host: str = LOCALHOST) -> TritonServer:
    """Prepare `run_dir` (model repository, backends, log) and start a ready server."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model_repo = prepare_model_repo(run_dir / "model_repo", values)
    return TritonServer(model_repo, run_dir, ports, host).start(interrupted=interrupted)


def default_model_name(values: dict[str, str]) -> str:
    """What the OpenAI API calls the model unless --served-model-name says: the engine
    folder's name (or the target checkpoint's)."""
    return Path(values["engines_dir"] or values["target_dir"]).name


def start_openai(values: dict[str, str], server: TritonServer, host: str, port: int, name: str,
                 chat_template: str | None = None):
    """The OpenAI-compatible front end, talking to `server`'s gRPC endpoint."""
    model = ServedModel.load(name, Path(values["tokenizer_dir"]), int(values["max_context"]), chat_template)
    front = FrontEnd(model, SsdStream(f"{server.address}:{server.ports.grpc}"))
    return OpenAIServer(front, host, port).start()


@dataclass
class StopRequest:
    """The first Ctrl-C or SIGTERM this process gets; later ones change nothing (the
    drain is bounded by its deadline, and a second Ctrl-C must not cut clean-up short)."""

    signum: int | None = None

    def record(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum

    def requested(self) -> bool:
        return self.signum is not None


def wait_for_stop(server: TritonServer, stop: StopRequest) -> str:
    """Serve until a stop is asked for; what asked for it."""
    while True:
        if stop.requested():
            assert stop.signum is not None  # requested
            return f"{signal.Signals(stop.signum).name} to serve.py"
        if server.asked_to_stop():
            return "SIGTERM to tritonserver"
        if not server.running or server.stopping_by_itself():
            return "tritonserver stopped by itself"
        time.sleep(0.2)


def summary(cause: str, report: StopReport) -> str:
    drain = report.drain
    drained = (f"{drain.in_flight} in flight, {drain.finished} finished, {drain.stopped_at_deadline} stopped at "
               f"the deadline, {drain.still_running} still running" if drain else "no drain")
    if not report.killed:
        ending = f"tritonserver exited {report.exit_code}"
    elif report.unloaded:
        ending = "tritonserver killed once its models had unloaded (Triton 2.51 lingers on open gRPC streams)"
    else:
        ending = "tritonserver killed: it had not stopped in time"
    return f"stopped ({cause}) in {report.seconds:.1f} s: {drained}; {ending}"


def read_chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as error:
        raise ValueError(f"--chat-template {path}: {error.strerror}") from None


def ready_line(args: argparse.Namespace, server: TritonServer, openai) -> str:
    host = server.host
    line = (f"ready: model 'ensemble' on gRPC {host}:{args.grpc_port}, HTTP {host}:{args.http_port}, "
            f"metrics http://{host}:{args.metrics_port}/metrics")
    if openai is not None:
        line += f", OpenAI API http://{host}:{args.openai_port}/v1 (model '{openai.front.model.name}')"
    return line + f" (tritonserver pid {server.pid}, log {server.log_path})"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_arguments(parser)
    parser.add_argument("--host", default=LOCALHOST,
                        help="bind address of Triton's gRPC, HTTP and metrics endpoints and of the OpenAI API "
                             f"(default {LOCALHOST}; 0.0.0.0: every interface)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--openai-port", type=int, default=0,
                        help="port of the OpenAI-compatible HTTP API (/v1/chat/completions ...); 0: off (default)")
    parser.add_argument("--served-model-name",
                        help="the model's name in the OpenAI API (default: the engine folder's name)")
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help="a Jinja chat template for the OpenAI API's chat endpoint, instead of the model's own")
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                        help="on a stop, how long requests in flight may run on before they are cut short")
    parser.add_argument("--run-dir", type=Path, help="default: .triton/<grpc port> in the current directory")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
        if not 0 <= args.openai_port < 65536:
            raise ValueError(f"--openai-port must be a port number (0: off), got {args.openai_port}")
        check_host(args.host)
        chat_template = read_chat_template(args.chat_template)
        values = values_from_args(args)
    except ValueError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 2
    run_dir = (args.run_dir or Path(".triton") / str(args.grpc_port)).resolve()
    stop = StopRequest()
    for stop_signal in (signal.SIGINT, signal.SIGTERM):  # explicit: a background job ignores SIGINT
        signal.signal(stop_signal, stop.record)
    try:
        server = serve(values, run_dir, Ports(args.grpc_port, args.http_port, args.metrics_port), stop.requested,
                       args.host)
    except RuntimeError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 1
    except Interrupted:  # start() has stopped the server
        return 0
    try:
        openai = start_openai(values, server, args.host, args.openai_port,
                              args.served_model_name or default_model_name(values),
                              chat_template) if args.openai_port else None
    except (RuntimeError, OSError) as error:
        print(f"serve: {error}", file=sys.stderr)
        server.stop(drain_timeout_s=None)
        return 1
    print(ready_line(args, server, openai), flush=True)
    cause = wait_for_stop(server, stop)
    if cause == "tritonserver stopped by itself":
        report = server.stop(drain_timeout_s=None)
        print(f"serve: {summary(cause, report)}\n{server.log_tail()}", file=sys.stderr)
        return 1
    print(f"stopping ({cause}): draining for up to {args.drain_timeout:g} s", flush=True)
    if openai is not None:
        openai.refuse_new()  # 503 from here on; the requests in flight drain with the model's
    report = server.stop(args.drain_timeout, before_stop=lambda: openai and openai.stop(STOP_GRACE_S))
    print(summary(cause, report), flush=True)
    if not server.stopped_cleanly:
        return 1
    return 0 if report.drained else 3


if __name__ == "__main__":
    sys.exit(main())
