"""One machine as a Dynamo cluster: Dynamo's frontend (OpenAI API and router) and several SSD
workers, all on 127.0.0.1, started, watched and stopped together.

    python scripts/dynamo_cluster.py --engines engines/smollm2               # serve until Ctrl-C
    python scripts/dynamo_cluster.py --engines engines/tiny --chat-template T.jinja --demo

Without etcd or NATS: discovery is a folder every process shares (`--discovery-backend
file`, `DYN_FILE_KV`), requests travel over TCP and events over ZMQ. Every listening
socket is bound to 127.0.0.1: the frontend's HTTP port, each worker's request-plane port
(OS-assigned) and its status server (health, `/metrics` and the model card), and the
frontend's response-stream port. The cluster is ready once the frontend lists the model
and reports every worker's instance on `/health`. Stopping sends each worker SIGTERM (it
drains, `dynamo_worker`), then stops the frontend; a process that lingers is killed.

`--demo` then streams a chat answer through the official `openai` client, sends a burst of
concurrent requests and prints each worker's counters, showing the router's spread.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from saguaro.runtime.models.prompts import PROMPTS
from saguaro.serving.dynamo_worker import MAX_SYSTEM_PORT
from saguaro.serving.guarded_exec import set_parent_death_signal
from saguaro.serving.served_metrics import metric

HOST = "127.0.0.1"
READY_TIMEOUT_S = 180.0   # two workers loading engines and torch on a busy 2-core machine
STOP_TIMEOUT_S = 30.0     # a worker's drain (its --drain-timeout) plus Dynamo's own teardown
# The frontend's HTTP drain on SIGTERM (Dynamo's default is 5 s); its clients are ours.
FRONTEND_DRAIN_S = "2"


def free_port(low: int = 20000, high: int = MAX_SYSTEM_PORT) -> int:
    """A port free on 127.0.0.1 within Dynamo's range for status servers (below 32768,
    where the kernel's ephemeral ports, which an OS-assigned probe would return, begin)."""
    for port in random.sample(range(low, high + 1), 200):
        with socket.socket() as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {HOST} in {low}..{high}")


def local_environment(discovery_dir: Path) -> dict[str, str]:
    """Dynamo's settings for a one-machine cluster without etcd or NATS."""
    return {**os.environ,
            "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(discovery_dir),
            "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": HOST, "DYN_TCP_RESPONSE_STREAM_HOST": HOST, "DYN_SYSTEM_HOST": HOST,
            "DYN_EVENT_PLANE_HOST": HOST, "DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT_SECS": FRONTEND_DRAIN_S}


def get_json(url: str, timeout_s: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read().decode())


def get_text(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


@dataclass
class Service:
    """One process of the cluster, its output in a log file."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None
    stopped: bool = False  # killed or stopped on purpose

    def start(self) -> "Service":
        with open(self.log_path, "ab") as log:
            # In a session of its own (a Ctrl-C to the launcher is the launcher's to pass
            # on), and SIGTERM if the launcher dies, so that no process outlives it.
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True,
                                            preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM))
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def failed(self) -> bool:
        """Exited though nobody stopped it."""
        return not self.stopped and self.process is not None and self.process.poll() is not None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the cluster can tell."""
        self.stopped = True
        if self.running:
            assert self.process is not None  # running
            self.process.kill()
            self.process.wait()

    def terminate(self) -> None:
        """SIGTERM: a worker drains, the frontend stops taking requests."""
        self.stopped = True
        if self.running:
            assert self.process is not None  # running
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited in time; its exit code (None if killed)."""
        if self.running:
            self.terminate()
            assert self.process is not None  # it was running
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        self.stopped = True
        return None if self.process is None else self.process.returncode


@dataclass
class Worker:
    service: Service
    system_port: int  # health, /metrics, model card

    def metrics(self) -> str:
        return get_text(f"http://{HOST}:{self.system_port}/metrics")

    def counter(self, name: str, **labels) -> float:
        return metric(self.metrics(), name, **labels)

    def instance_id(self) -> int | None:
        """Its discovery instance (None until its status server answers)."""
        try:
            return int(get_json(f"http://{HOST}:{self.system_port}/engine/instance")["instance_id"])
        except (OSError, ValueError, KeyError):
            return None


@dataclass
class LocalCluster:
    """The frontend and `workers` SSD workers over one engine folder; a context manager."""

    engines: Path
    run_dir: Path
    workers: int = 2
    http_port: int = field(default_factory=free_port)
    router_mode: str = "round-robin"
    migration_limit: int = 3
    worker_flags: list[str] = field(default_factory=list)  # passed on to serve_dynamo.py
    model_name: str | None = None
    frontend: Service | None = None
    members: list[Worker] = field(default_factory=list)
    started_workers: int = 0

    def __post_init__(self):
        self.engines, self.run_dir = Path(self.engines).resolve(), Path(self.run_dir).resolve()
        self.model_name = self.model_name or self.engines.name
        self.env = local_environment(self.run_dir / "discovery")

    @property
    def url(self) -> str:
        """The OpenAI API's base URL."""
        return f"http://{HOST}:{self.http_port}/v1"

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "LocalCluster":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.frontend = Service("frontend", [
                sys.executable, "-m", "dynamo.frontend", "--http-host", HOST, "--http-port", str(self.http_port),
                "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                "--router-mode", self.router_mode, "--migration-limit", str(self.migration_limit)],
                self.env, self.run_dir / "frontend.log").start()
            for _ in range(self.workers):
                self.start_worker()
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self) -> Worker:
        """One more worker (also a restarted one): it joins through discovery."""
        assert self.model_name is not None  # __post_init__ sets it
        index, port = self.started_workers, free_port()
        self.started_workers += 1
        command = [sys.executable, "-m", "saguaro.serving.dynamo_worker", "--engines", str(self.engines),
                   "--model-name", self.model_name, "--discovery-backend", "file", "--request-plane", "tcp",
                   "--event-plane", "zmq", "--system-port", str(port),
                   "--card-cache", str(self.run_dir / "model-cards"), *self.worker_flags]
        worker = Worker(Service(f"worker-{index}", command, self.env, self.run_dir / f"worker-{index}.log").start(),
                        port)
        self.members.append(worker)
        return worker

    def frontend_counter(self, name: str) -> float:
        """A counter of the frontend's `/metrics`, summed over its label sets (0 if none)."""
        text = get_text(f"http://{HOST}:{self.http_port}/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))

    def live_workers(self) -> list[Worker]:
        return [worker for worker in self.members if worker.service.running]

    def instances(self) -> set[int]:
        """The worker instances the frontend knows of (none while it is not up); a killed
        worker stays among them until its discovery lease lapses (about 10 s)."""
        try:
            health = get_json(f"http://{HOST}:{self.http_port}/health")
        except (OSError, ValueError):
            return set()
        return {int(instance["instance_id"]) for instance in health.get("instances", [])}

    def serves_model(self) -> bool:
        try:
            models = get_json(f"{self.url}/models")
        except (OSError, ValueError):
            return False
        return any(entry.get("id") == self.model_name for entry in models.get("data", []))

    def ready(self) -> bool:
        """The frontend lists the model and knows every live worker's instance."""
        ids = [worker.instance_id() for worker in self.live_workers()]
        return None not in ids and set(ids) <= self.instances() and self.serves_model()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        assert self.frontend is not None  # start made it
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            for service in [self.frontend] + [worker.service for worker in self.members]:
                if service.failed:
                    assert service.process is not None  # failed: it ran and exited
                    raise RuntimeError(f"{service.name} exited with code {service.process.returncode}:\n"
                                       f"{service.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ready after {timeout_s:.0f} s:\n{self.frontend.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> dict[str, int | None]:
        """Drain and stop every worker, then the frontend; each one's exit code."""
        codes = {worker.service.name: worker.service.stop() for worker in self.members if worker.service.running}
        if self.frontend is not None:
            codes["frontend"] = self.frontend.stop()
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start() if self.frontend is None else self

    def __exit__(self, *exc_info) -> None:
        self.stop()


# --- the demo --------------------------------------------------------------------------

def stream_chat(client, model: str, question: str, max_tokens: int) -> str:
    """A chat answer streamed through the official client, printed as it arrives."""
    text = []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return "".join(text)


def burst(client, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Completions sent all at once, one thread each."""
    def complete(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
                                         ).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def print_counters(cluster: LocalCluster) -> None:
    for worker in cluster.live_workers():
        print(f"  {worker.service.name} (pid {worker.service.pid}): "
              f"{worker.counter('dynamo_component_requests_total'):.0f} requests, "
              f"{worker.counter('ssd_generated_tokens_total'):.0f} tokens generated, "
              f"{worker.counter('ssd_rounds_total'):.0f} rounds, "
              f"{worker.counter('ssd_accepted_draft_tokens_total'):.0f} of "
              f"{worker.counter('ssd_verified_draft_tokens_total'):.0f} drafts accepted")


def demo(cluster: LocalCluster, question: str, max_tokens: int, requests: int) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster.url, api_key="not-needed")
    assert cluster.model_name is not None  # LocalCluster.__post_init__ sets it
    print(f"chat: {question}")
    stream_chat(client, cluster.model_name, question, max_tokens)
    print(f"{requests} concurrent completions ...")
    burst(client, cluster.model_name, [PROMPTS[i % len(PROMPTS)] for i in range(requests)], max_tokens)
    print("each worker's counters:")
    print_counters(cluster)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynamo_cluster.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True, help="a folder made by scripts/build_engines.py")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--http-port", type=int, default=8000, help="the OpenAI API's port on 127.0.0.1")
    parser.add_argument("--router-mode", default="round-robin",
                        choices=("round-robin", "random", "power-of-two", "least-loaded"),
                        help="how the frontend picks a worker (kv needs KV events, which SSD workers do not publish)")
    parser.add_argument("--migration-limit", type=int, default=3,
                        help="times a request may move to another worker when its worker fails (0: never)")
    parser.add_argument("--chat-template", type=Path, metavar="FILE", help="for models whose tokenizer has none")
    parser.add_argument("--run-dir", type=Path, default=Path(".dynamo"), help="logs and the discovery folder")
    parser.add_argument("--demo", action="store_true", help="stream a chat answer, send a burst, show the spread, stop")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=8, help="the demo's concurrent completions")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for flag, value in (("--workers", args.workers), ("--max-tokens", args.max_tokens), ("--requests", args.requests)):
        if value < 1:
            print(f"dynamo_cluster: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    flags = ["--chat-template", str(args.chat_template.resolve())] if args.chat_template else []
    cluster = LocalCluster(args.engines, args.run_dir, args.workers, args.http_port, args.router_mode,
                           args.migration_limit, flags)
    stop = []
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda signum, _frame: stop.append(signum))
    try:
        cluster.start()
    except RuntimeError as error:
        print(f"dynamo_cluster: {error}", file=sys.stderr)
        return 1
    print(f"ready: OpenAI API at {cluster.url} (model '{cluster.model_name}'), {args.workers} SSD workers, "
          f"logs in {cluster.run_dir}", flush=True)
    try:
        if args.demo:
            demo(cluster, args.question, args.max_tokens, args.requests)
        else:
            assert cluster.frontend is not None  # start made it
            while not stop and cluster.frontend.running:
                time.sleep(0.2)
    finally:
        codes = cluster.stop()
        print(f"stopped: {', '.join(f'{name} exited {code}' for name, code in codes.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
