"""An SSD worker for NVIDIA Dynamo: one engine folder served behind Dynamo's frontend and router.

    python scripts/serve_dynamo.py --engines engines/smollm2 --discovery-backend etcd
    python scripts/serve_dynamo.py --engines engines/tiny --discovery-backend file \\
        --request-plane tcp --event-plane zmq --system-port 9090

Dynamo's Python worker contract (its `dynamo.runtime` / `dynamo.llm` API): a
`DistributedRuntime` joins the cluster's discovery (etcd, Kubernetes, or a shared folder),
`register_model` advertises the model with `ModelInput.Tokens`, so the frontend applies
the chat template and tokenizer itself, and `endpoint.serve_endpoint` runs one async
generator per request. Each request goes through the project's `Pipeline` and its
iteration-level scheduler, so every request on this worker is batched into the same
rounds; each round's tokens stream back as one response chunk, and the last chunk says
why it ended, with the token counts.

The model card the frontend reads (tokenizer, chat template, config, end tokens) is
written from the engine folder into a folder named by its content (`--card-cache`), so
every worker of a model registers the same card, as the frontend requires; Dynamo hands
it to the frontend (from the worker's own status server when `--system-port` is set, so
the machines need not share a filesystem). `--chat-template FILE` supplies a template for
models that have none; without one the model is registered for completions only.

Errors reach the client as Dynamo's typed errors: a request SSD cannot honour exactly is
`InvalidArgument` naming the field (HTTP 400, see `dynamo_requests`); a worker that is
shutting down or full answers `WorkerUnavailable`, and a generation cut at the drain
deadline ends with `EngineShutdown`: with `--migration-limit` on the frontend both move
the request to another worker, else the client sees the error, never a silent end.

SIGTERM or Ctrl-C drains, as `serve.py` does: the worker leaves discovery (the router
stops sending it requests), keeps serving for `--shutdown-grace` while the router hears
of it, then refuses new requests and lets the running ones finish until
`--drain-timeout`; the rest end with `EngineShutdown`. Exit code 0: every request in
flight finished; 3: the deadline cut some short; 1: the worker failed; 2: bad arguments.

SSD's figures (acceptance, cache hits, batch sizes, K per round) are added to the worker's
`/metrics` (`dynamo_metrics`).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from saguaro.runtime.engines.manifest import read_manifest
from saguaro.runtime.models.checkpoint import read_config
from saguaro.runtime.models.prompts import has_chat_template
from saguaro.runtime.pipeline import Pipeline, RequestError, freeze_loaded_heap
from saguaro.serving import lifecycle
from saguaro.serving.dynamo_requests import TokenRequest, parse_request
from saguaro.serving.model_repo import ModelSource, add_source_arguments, default_options, source_from_args
from saguaro.serving.requests import ModelLimits

try:  # the `dynamo` extra (docs/dynamo.md); the rest of the project never needs it
    import uvloop  # Dynamo's event loop (a dependency of its runtime)
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown, WorkerUnavailable
    from dynamo.runtime import DistributedRuntime
    from dynamo.runtime.logging import configure_dynamo_logging

    from saguaro.serving.dynamo_metrics import WorkerMetrics
    DYNAMO_MISSING = None
except ImportError as missing:
    DYNAMO_MISSING = (f"NVIDIA Dynamo is not installed in this environment ({missing}); install it with "
                      f"`bash scripts/install_dynamo.sh` (see docs/dynamo.md)")

log = logging.getLogger("saguaro.dynamo")

MAX_SYSTEM_PORT = 32767  # Dynamo 1.6 reads DYN_SYSTEM_PORT as a signed 16-bit number
DRAIN_TIMEOUT_S = 10.0   # how long requests in flight may run on once a stop is asked for
SHUTDOWN_GRACE_S = 1.0   # serving on after leaving discovery, while the router hears of it
# Dynamo's finish reasons for the pipeline's: an end token is "stop", a full context "length".
FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length", "cancelled": "cancelled"}
# Files of a tokenizer folder that a model card carries (never weights).
CARD_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


# --- the model card: what the frontend needs to pre-process requests ------------------

def target_config(source: ModelSource) -> dict:
    """The target's Hugging Face config, from the engine manifest or the checkpoint."""
    if source.engines_dir is not None:
        return read_manifest(source.engines_dir)["models"]["target"]["config"]
    assert source.target_dir is not None  # a source without engines has checkpoints
    return read_config(source.target_dir)


def model_card_files(source: ModelSource, eos_token_ids: list[int], bos_token_id: int | None,
                     chat_template: str | None = None) -> dict[str, bytes]:
    """A Hugging Face-style folder without weights, by file name: the target's config, the
    tokenizer, a generation config naming every end-of-generation token, and the chat
    template (`chat_template` replaces the tokenizer's own)."""
    files = {name: (source.tokenizer_dir / name).read_bytes() for name in CARD_FILES
             if (source.tokenizer_dir / name).is_file()}
    files["config.json"] = json.dumps(target_config(source), indent=1, sort_keys=True).encode()
    if "generation_config.json" not in files:
        generation: dict[str, int | list[int]] = {"eos_token_id": list(eos_token_ids)}
        if bos_token_id is not None:
            generation["bos_token_id"] = bos_token_id
        files["generation_config.json"] = json.dumps(generation, indent=1).encode()
    if chat_template is not None:
        tokenizer_config = json.loads(files.get("tokenizer_config.json", b"{}"))
        tokenizer_config["chat_template"] = chat_template
        files["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=1).encode()
        files["chat_template.jinja"] = chat_template.encode()
    return files


def write_model_card(files: dict[str, bytes], cache_dir: Path, model_name: str) -> Path:
    """The card's folder, named by its content: every worker of a model registers the same
    path, as the frontend requires of one model's workers (their cards' checksums must
    agree). Written once, atomically; a folder that exists already is the same card."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    card = cache_dir / f"{model_name}-{digest.hexdigest()[:16]}"
    if card.is_dir():
        return card
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{card.name}-", dir=cache_dir))
    for name, content in files.items():
        (staging / name).write_bytes(content)
    try:
        staging.rename(card)
    except OSError:  # another worker wrote the same card meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return card


def default_card_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "saguaro" / "dynamo-model-cards"


# --- one request: the pipeline's scheduler thread to Dynamo's async generator ----------

@dataclass
class Admitted:
    """A request accepted for generation."""

    parsed: TokenRequest
    live: lifecycle.Live


class SsdHandler:
    """`generate(request, context)` is the endpoint's handler, called on Dynamo's event loop
    for every request; the pipeline decodes in its own scheduler thread, and each round's
    tokens cross back to the loop through a queue."""

    def __init__(self, pipeline: Pipeline, defaults, limits: ModelLimits, metrics, max_queue: int):
        self.pipeline, self.defaults, self.limits = pipeline, defaults, limits
        self.metrics, self.max_queue = metrics, max_queue
        self.generations = lifecycle.Generations()
        pipeline.observe_rounds(lambda batch, report: metrics.observe_round(batch, report, pipeline.queued))

    def admit(self, request: dict) -> Admitted:
        """Check the request whole and register it; Dynamo's typed error otherwise."""
        try:
            parsed = parse_request(request, self.defaults, self.limits)
            self.pipeline.check_request(parsed.prompt_ids, parsed.options)
        except ValueError as error:  # RequestError, or a value the options reject
            self.metrics.refused("rejected")
            raise InvalidArgument(str(error)) from None
        if self.pipeline.queued >= self.max_queue:
            self.metrics.refused("refused_queue_full")
            raise WorkerUnavailable(f"this worker has {self.max_queue} requests waiting already; "
                                    f"retry on another worker")
        try:
            return Admitted(parsed, self.generations.start())
        except lifecycle.ServerDraining as error:
            self.metrics.refused("refused_shutting_down")
            raise WorkerUnavailable(str(error)) from None

    async def generate(self, request: dict, context):
        admitted = self.admit(request)
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        send = lambda item: loop.call_soon_threadsafe(chunks.put_nowait, item)  # noqa: E731 - from the scheduler
        live = admitted.live
        generation = self.submit(admitted, context, on_tokens=send)
        generation.add_done_callback(lambda done: self.ended(live, done))
        generation.add_done_callback(send)
        try:
            while not isinstance(item := await chunks.get(), Future):
                yield {"token_ids": item}
            yield self.final_chunk(live, item)
        finally:
            if not generation.done():  # the frontend went away (client disconnect, stop string)
                live.stop(lifecycle.CANCELLED)

    def submit(self, admitted: Admitted, context, on_tokens) -> Future:
        parsed, live = admitted.parsed, admitted.live
        try:
            request = self.pipeline.request(parsed.prompt_ids, parsed.options, parsed.sampling, on_tokens=on_tokens,
                                            cancelled=lambda: live.reason is not None or context.is_stopped())
            future = self.pipeline.submit(replace(request, eos_token_ids=parsed.end_tokens))
        except RequestError as error:
            self.generations.end(live.generation_id)
            self.metrics.refused("rejected")
            raise InvalidArgument(str(error)) from None
        except BaseException:  # e.g. the scheduler closed: still take it off the registry
            self.generations.end(live.generation_id)
            raise
        self.metrics.started()
        return future

    def ended(self, live: lifecycle.Live, done: Future) -> None:
        """In the scheduler's thread: the figures, then the registry (the drain waits on it)."""
        if done.exception() is not None:
            self.metrics.failed()
        else:
            result = done.result()
            self.metrics.finished(self.finish_reason(live, result), len(result.output_ids), result.stats.as_dict())
        self.generations.end(live.generation_id)

    @staticmethod
    def finish_reason(live: lifecycle.Live, generation) -> str:
        if generation.finish_reason == "cancelled" and live.reason == lifecycle.SHUTDOWN:
            return lifecycle.SHUTDOWN
        return FINISH_REASONS[generation.finish_reason]

    def final_chunk(self, live: lifecycle.Live, done: Future) -> dict:
        error = done.exception()
        if error is not None:
            raise Unknown(f"generation failed: {type(error).__name__}: {error}")
        generation = done.result()
        reason = self.finish_reason(live, generation)
        if reason == lifecycle.SHUTDOWN:
            raise EngineShutdown(f"this worker is shutting down and stopped the generation at its drain deadline "
                                 f"after {len(generation.output_ids)} tokens; the frontend migrates it to another "
                                 f"worker when --migration-limit allows")
        prompt, completion = len(generation.prompt_ids), len(generation.output_ids)
        return {"token_ids": [], "finish_reason": reason,
                "completion_usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


# --- shutdown: leave discovery, serve on while the router hears of it, drain -----------

@dataclass
class Shutdown:
    runtime: Any   # Dynamo's DistributedRuntime
    endpoint: Any  # and its endpoint
    generations: lifecycle.Generations
    drain_timeout_s: float
    grace_s: float
    report: lifecycle.DrainReport | None = None
    task: asyncio.Task | None = None

    def request(self, signum: int) -> None:
        """The signal handler: start the drain once (later signals change nothing)."""
        if self.task is None:
            log.info("stopping (%s): draining for up to %g s", signal.Signals(signum).name, self.drain_timeout_s)
            self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        try:
            await self.endpoint.unregister_endpoint_instance()
        except Exception as error:  # noqa: BLE001 - drain anyway; the router also sees the instance go
            log.warning("could not leave discovery before draining: %s", error)
        await asyncio.sleep(self.grace_s)
        self.report = await asyncio.to_thread(self.generations.drain, self.drain_timeout_s)
        log.info("drained: %s", self.report.to_json())
        self.runtime.shutdown()

    @property
    def exit_code(self) -> int:
        return 0 if self.report is None or self.report.complete else 3


# --- the worker process --------------------------------------------------------------

def runtime_config(pipeline: Pipeline) -> "ModelRuntimeConfig":
    """What the router and planner read about this worker's capacity."""
    config = ModelRuntimeConfig()
    config.context_length = pipeline.max_context
    config.max_num_seqs = pipeline.max_active
    return config


def instance_route(endpoint, model_name: str):
    """`GET /engine/instance` on the status server: which discovery instance this process
    is, so that a launcher can tell when the frontend knows this very worker."""
    async def describe(_body: dict) -> dict:
        return {"instance_id": endpoint.connection_id(), "model": model_name}
    return describe


def model_types(pipeline: Pipeline, chat_template: Path | None):
    if chat_template is not None or has_chat_template(pipeline.tokenizer):
        return ModelType.Chat | ModelType.Completions
    log.warning("the model has no chat template: registered for completions only (give --chat-template FILE)")
    return ModelType.Completions


async def serve(args: argparse.Namespace, source: ModelSource, defaults, pipeline: Pipeline, card: Path) -> int:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane)
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")
    info = cast(Any, pipeline.target).info  # an Engine's (Pipeline types it object)
    metrics = WorkerMetrics(args.model_name)
    endpoint.metrics.register_prometheus_expfmt_callback(metrics.exposition)
    handler = SsdHandler(pipeline, defaults, ModelLimits(pipeline.max_context, info.vocab_size, info.eos_token_id),
                         metrics, args.max_queue)
    await register_model(ModelInput.Tokens, model_types(pipeline, args.chat_template), endpoint, str(card),
                         args.model_name, worker_type=WorkerType.Aggregated, runtime_config=runtime_config(pipeline))
    runtime.register_engine_route("instance", instance_route(endpoint, args.model_name))
    shutdown = Shutdown(runtime, endpoint, handler.generations, args.drain_timeout, args.shutdown_grace)
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(stop_signal, shutdown.request, stop_signal)
    print(f"ready: model '{args.model_name}' on {args.namespace}.{args.component}.{args.endpoint} "
          f"(instance {endpoint.connection_id()}, {pipeline.max_active} requests at once, "
          f"discovery {args.discovery_backend})", flush=True)
    await endpoint.serve_endpoint(handler.generate, graceful_shutdown=True,
                                  metrics_labels=[("model", args.model_name)])
    if shutdown.task is not None:
        await shutdown.task
    return shutdown.exit_code


def env_default(name: str, fallback: str | None) -> str | None:
    return os.environ.get(name) or fallback


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve_dynamo.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_arguments(parser)
    parser.add_argument("--model-name", help="the name clients ask for (default: the engine folder's name)")
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help="a Jinja chat template, for a model whose tokenizer carries none")
    parser.add_argument("--card-cache", type=Path, default=default_card_cache(), metavar="DIR",
                        help="where model cards are written, one folder per card (default %(default)s)")
    where = parser.add_argument_group("where the worker sits in the Dynamo cluster")
    where.add_argument("--namespace", default="saguaro")
    where.add_argument("--component", default="ssd")
    where.add_argument("--endpoint", default="generate")
    where.add_argument("--discovery-backend", choices=("etcd", "kubernetes", "file", "mem"),
                       default=env_default("DYN_DISCOVERY_BACKEND", "etcd"),
                       help="file: a folder shared by every process (DYN_FILE_KV); default etcd (ETCD_ENDPOINTS)")
    where.add_argument("--request-plane", choices=("tcp", "nats"), default=env_default("DYN_REQUEST_PLANE", "tcp"))
    where.add_argument("--event-plane", choices=("zmq", "nats"), default=env_default("DYN_EVENT_PLANE", None))
    where.add_argument("--system-port", type=int,
                       help="the worker's health, metrics and model-card server (DYN_SYSTEM_PORT; "
                            "bound to DYN_SYSTEM_HOST, default 0.0.0.0)")
    stopping = parser.add_argument_group("stopping (SIGTERM or Ctrl-C)")
    stopping.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                          help="how long requests in flight may run on before they end with EngineShutdown")
    stopping.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="S",
                          help="serving on after leaving discovery, while the router hears of it")
    return parser.parse_args(argv)


def checked(args: argparse.Namespace):
    """The models and default knobs; ValueError names the flag at fault."""
    for flag, value in (("--drain-timeout", args.drain_timeout), ("--shutdown-grace", args.shutdown_grace)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.chat_template is not None and not args.chat_template.is_file():
        raise ValueError(f"--chat-template {args.chat_template}: no such file")
    if args.system_port is not None and not 0 < args.system_port <= MAX_SYSTEM_PORT:
        raise ValueError(f"--system-port must be in 1..{MAX_SYSTEM_PORT} (Dynamo's limit), got {args.system_port}")
    source = source_from_args(args)
    defaults = default_options(source, args.mode, args.num_draft_tokens, args.fanout, args.budget,
                               adapt_k=not args.fixed_k)
    args.model_name = args.model_name or cast(Path, source.engines_dir or source.target_dir).name  # one is given
    return source, defaults


def main(argv=None) -> int:
    args = parse_args(argv)
    if DYNAMO_MISSING:
        print(f"serve_dynamo: {DYNAMO_MISSING}", file=sys.stderr)
        return 2
    try:
        source, defaults = checked(args)
    except ValueError as error:  # ManifestError and CheckpointError are ValueErrors too
        print(f"serve_dynamo: {error}", file=sys.stderr)
        return 2
    if args.system_port is not None:
        os.environ["DYN_SYSTEM_PORT"] = str(args.system_port)  # read by the runtime when it starts
    # `/health` is ready once the endpoint serves (else it stays "notready" for good)
    os.environ.setdefault("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", json.dumps([args.endpoint]))
    configure_dynamo_logging()
    pipeline = Pipeline.load(engines=source.engines_dir, target=source.target_dir, draft=source.draft_dir,
                             draft_method=source.draft_method, batching=args.batching,
                             max_concurrency=args.max_concurrency)
    info = cast(Any, pipeline.target).info  # an Engine's (Pipeline types it object)
    freeze_loaded_heap()  # the worker serves until it stops
    try:
        template = args.chat_template.read_text() if args.chat_template else None
        files = model_card_files(source, list(info.eos_token_ids), info.bos_token_id, template)
        card = write_model_card(files, args.card_cache, args.model_name)
        return uvloop.run(serve(args, source, defaults, pipeline, card))
    except Exception as error:  # noqa: BLE001 - a failed start or serve is reported, not raised
        log.exception("the worker failed")
        print(f"serve_dynamo: the worker failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        pipeline.close()


if __name__ == "__main__":
    sys.exit(main())
