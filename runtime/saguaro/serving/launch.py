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
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from saguaro.serving.lifecycle import STOP_GRACE_S
from saguaro.serving.model_repo import add_source_arguments, prepare_model_repo, values_from_args
from saguaro.serving.openai_server import FrontEnd, OpenAIServer, ServedModel
from saguaro.serving.ssd_stream import SsdStream
from saguaro.serving.triton_server import DRAIN_TIMEOUT_S, LOCALHOST, Interrupted, Ports, StopReport, TritonServer, check_host


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
