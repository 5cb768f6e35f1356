"""Serve SSD with a real Triton Inference Server on 127.0.0.1 until interrupted.

    python scripts/serve.py --engines engines/tiny
    python scripts/serve.py --target models/tiny/target --draft models/tiny/draft --grpc-port 9001

Installs nothing. The server is the `tritonserver` (2.51) bundled in the nvidia-pytriton
wheel, with its Python backend (see shared/triton-on-cpu.md). This script prepares a run
folder (filled model repository, backend folder, log), starts the server with the
library path its Python stub needs, waits until it is ready, prints one line, and on
Ctrl-C or SIGTERM stops it and removes the shared-memory regions it leaves behind.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
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

from saguaro.serving.model_repo import add_source_arguments, prepare_model_repo, values_from_args

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
READY_TIMEOUT_S = 180.0  # loading torch in three stubs on a busy 2-core machine
STOP_TIMEOUT_S = 30.0


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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Ports:
    grpc: int = 8001
    http: int = 8000
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        return cls(free_port(), free_port(), free_port())


@dataclass
class TritonServer:
    """One tritonserver process over a prepared model repository; a context manager."""

    model_repo: Path
    run_dir: Path
    ports: Ports = field(default_factory=Ports)
    shm_prefix: str = field(default_factory=lambda: f"{SHM_PREFIX}saguaro_{uuid.uuid4().hex[:8]}_")
    process: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "tritonserver.log"

    def command(self, install: TritonInstall, backends: Path) -> list[str]:
        address = "127.0.0.1"
        return [str(install.server), f"--model-repository={self.model_repo}", f"--backend-directory={backends}",
                f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}",
                f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-port={self.ports.metrics}", "--allow-gpu-metrics=false",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                f"--exit-timeout-secs={int(STOP_TIMEOUT_S)}"]

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "TritonServer":
        install = find_bundled_triton()
        backends = prepare_backends(install, self.run_dir)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(install, backends), stdout=log, stderr=subprocess.STDOUT,
                                            env=server_environment(install), start_new_session=True)
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.http}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (Triton finishes in-flight requests), SIGKILL if it hangs; then remove
        this server's shared-memory regions, which a stopped server can leave behind."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S + 5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the stubs too
                self.process.wait()
        for region in self.shm_regions():
            region.unlink(missing_ok=True)

    @property
    def stopped_cleanly(self) -> bool:
        """Exited 0, without a crash and without abandoning requests still in flight."""
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        crashed = re.search(r"Signal \((?!15\))", log)  # 15 is our SIGTERM; 11, 6 are crashes
        return (self.process is not None and self.process.returncode == 0
                and "Exit timeout expired" not in log and not crashed)

    def shm_regions(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve(values: dict[str, str], run_dir: Path, ports: Ports) -> TritonServer:
    """Prepare `run_dir` (model repository, backends, log) and start a ready server."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model_repo = prepare_model_repo(run_dir / "model_repo", values)
    return TritonServer(model_repo, run_dir, ports).start()


class StopServing(Exception):
    """Ctrl-C or SIGTERM: stop the server and exit."""


def stop_serving(*_) -> None:
    raise StopServing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_arguments(parser)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--run-dir", type=Path, help="default: .triton/<grpc port> in the current directory")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        values = values_from_args(args)
    except ValueError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 2
    run_dir = (args.run_dir or Path(".triton") / str(args.grpc_port)).resolve()
    for stop_signal in (signal.SIGINT, signal.SIGTERM):  # explicit: a background job ignores SIGINT
        signal.signal(stop_signal, stop_serving)
    try:
        server = serve(values, run_dir, Ports(args.grpc_port, args.http_port, args.metrics_port))
    except RuntimeError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 1
    except StopServing:  # interrupted while starting: start() has stopped the server
        return 0
    try:
        print(f"ready: model 'ensemble' on gRPC 127.0.0.1:{args.grpc_port}, HTTP 127.0.0.1:{args.http_port}, "
              f"metrics http://127.0.0.1:{args.metrics_port}/metrics (log {server.log_path})", flush=True)
        return server.process.wait()
    except StopServing:
        return 0
    finally:
        for stop_signal in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut clean-up short
            signal.signal(stop_signal, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
