"""The server under load: many concurrent streams against a real Triton server, modes side
by side in one run (`scripts/bench_serving.py`).

    python scripts/bench_serving.py --engines engines/bench
    python scripts/bench_serving.py --engines engines/tiny --concurrency 1,4 --max-tokens 32

Two servers over the same engines, one after the other: the iteration-level scheduler
(batched autoregressive, batched speculative with K fixed, batched SSD with the load
policy), then the baseline it replaces, every request decoded alone in a thread of its
own (`--batching per-request`). At each concurrency C, C clients each keep one streaming
request in flight until the level's requests are done; a server's modes take turns level
by level, so that a ratio compares figures measured minutes apart at most; with `--repeats
N` each level runs N times per mode, the order turned each time, and each mode's runs
count as one (their tokens over their seconds: on a shared 2-core machine one run's
figure moves by a tenth, more than the differences the load policy's targets ask
about). Each concurrency starts with a level of `--warmup-per-stream` requests per stream
for every mode, not counted: the first level at a new concurrency ran slower than the
ones after it (bench pair, 16 streams: 279-389 tok/s against 420-445), whichever mode ran
it. Per mode and C: total output
tokens/s, per-request inter-token latency and time to first token (p50/p99), and, from
the server's metrics, the mean batch size, mean K per round and the share of rounds in
which the clock overruled the load policy's choice to draft, and the share the target
verified alone (on its wide session, nothing of the draft's beside it). A sampled check
(temperature 0.8, C = 1; `--sampled-top-p` adds top-p) follows. Figures are printed (and
written as JSON and a PNG plot), never asserted: the targets of the load policy are
printed as met or not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from saguaro.benchmarks.cpu_profile import server_processes, snapshot, spent
from saguaro.benchmarks.figures import pyplot, save
from saguaro.benchmarks.ratios import spread
from saguaro.runtime.arguments import DECODE_DEFAULTS, add_draft_method_argument
from saguaro.runtime.control.round_report import UNDRAFTED_REASONS
from saguaro.runtime.core.options import DRAFT_METHODS
from saguaro.runtime.models.prompts import PROMPTS
from saguaro.serving.client import complete, ensemble_inputs, tensor
from saguaro.serving.launch import parse_args as serve_args
from saguaro.serving.launch import serve
from saguaro.serving.model_repo import values_from_args
from saguaro.serving.served_metrics import growth_ratio, histogram_mean, settled_scrape
from saguaro.serving.triton_server import Ports

CONCURRENCY = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Mode:
    key: str                # its --modes name
    name: str
    batching: str           # the server it runs on
    inputs: dict            # what each request sends besides prompt and length


MODES = [
    Mode("ar", "batched AR", "iteration", {"decoding_mode": "autoregressive"}),
    Mode("sd", "batched SD K=4", "iteration", {"decoding_mode": "speculative", "num_draft_tokens": 4}),
    Mode("ssd", "batched SSD policy", "iteration", {"decoding_mode": "ssd"}),
    Mode("per-request", "per-request SSD K=4", "per-request", {"decoding_mode": "ssd", "num_draft_tokens": 4}),
]


@dataclass
class Level:
    """One mode at one concurrency."""

    mode: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    itl_ms_p50: float
    itl_ms_p99: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    mean_batch: float
    mean_k: float
    cpu_ms_per_token: dict  # CPU time of each process (the server's, the client) per output token
    runs: int = 1
    itl_ms: list[float] = field(default_factory=list)   # each request's
    ttft_ms: list[float] = field(default_factory=list)  # each request's
    undrafted: dict = field(default_factory=dict)        # share of the rounds that drafted nothing, by why
    alone: float = 0.0                                   # share of the rounds the target verified alone
    # tokens/s over batched AR's on the same path, repeat by repeat (`paired_ratios`)
    over_ar: list[float] = field(default_factory=list)


def merged(runs: list[Level]) -> Level:
    """Runs of one mode at one concurrency as one: tokens over seconds, percentiles over
    every request, the server's means and CPU weighted by each run's share."""
    tokens, seconds = sum(run.tokens for run in runs), sum(run.seconds for run in runs)
    itl = [value for run in runs for value in run.itl_ms]
    ttft = [value for run in runs for value in run.ttft_ms]
    by_time = [run.seconds / seconds for run in runs]
    by_tokens = [run.tokens / max(tokens, 1) for run in runs]
    cpu = {name: round(sum(share * run.cpu_ms_per_token.get(name, 0.0) for share, run in zip(by_tokens, runs)), 4)
           for name in dict.fromkeys(name for run in runs for name in run.cpu_ms_per_token)}
    undrafted = {reason: sum(share * run.undrafted.get(reason, 0.0) for share, run in zip(by_time, runs))
                 for reason in dict.fromkeys(reason for run in runs for reason in run.undrafted)}
    first = runs[0]
    return Level(first.mode, first.concurrency, sum(run.requests for run in runs), tokens, seconds, tokens / seconds,
                 percentile(itl, 0.5), percentile(itl, 0.99), percentile(ttft, 0.5), percentile(ttft, 0.99),
                 sum(share * run.mean_batch for share, run in zip(by_time, runs)),
                 sum(share * run.mean_k for share, run in zip(by_time, runs)), cpu, len(runs), itl, ttft, undrafted,
                 sum(share * run.alone for share, run in zip(by_time, runs)))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))] if ordered else float("nan")


# Where a request goes: the ensemble (text through the pre/postprocessing models, as
# tensorrtllm_backend's clients send it), or the `ssd` model itself with text_input (it
# tokenizes and detokenizes itself, as the llmapi model does: one Python stub per round).
PATHS = ("ssd", "ensemble")
SSD_OUTPUTS = ("text_output", "num_output_tokens", "finish_reason")


def request_inputs(path: str, prompt: str, max_tokens: int, inputs: dict) -> list:
    if path == "ensemble":
        return ensemble_inputs(prompt, max_tokens, True, end_id=-1, **inputs)
    arrays = {"text_input": [prompt], "max_tokens": [max_tokens], "stream": [True], "end_id": [-1], **inputs}
    dtypes = {"text_input": object, "max_tokens": np.int32, "stream": bool, "end_id": np.int32,
              "decoding_mode": object, "num_draft_tokens": np.int32, "temperature": np.float32, "top_p": np.float32}
    return [tensor(name, values if isinstance(values, list) else [values], dtypes[name])
            for name, values in arrays.items()]


def one_request(client, path: str, prompt: str, max_tokens: int, inputs: dict):
    """(output tokens, time to first token s, inter-token latency s) of one streamed request,
    on the client's connection (kept open, as load generators do)."""
    if path == "ensemble":
        completion = complete(client, request_inputs(path, prompt, max_tokens, inputs))
    else:
        completion = complete(client, request_inputs(path, prompt, max_tokens, inputs), model="ssd",
                              outputs=SSD_OUTPUTS)
    tokens, times = completion.num_output_tokens or 0, completion.response_times_s
    first = times[0]
    itl = (times[-1] - first) / (tokens - 1) if tokens > 1 else 0.0
    return tokens, first, itl


def run_level(url: str, metrics_port: int, mode: Mode, concurrency: int, requests: int, max_tokens: int,
              extra: dict, path: str = PATHS[0], processes: dict[str, int] | None = None) -> Level:
    """`concurrency` clients, each keeping one request in flight, `requests` in all."""
    results, lock, next_index = [], threading.Lock(), iter(range(requests))
    errors: list[Exception] = []

    def client_loop():
        with grpcclient.InferenceServerClient(url) as client:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None or errors:
                    return
                try:
                    outcome = one_request(client, path, PROMPTS[index % len(PROMPTS)], max_tokens,
                                          {**mode.inputs, **extra})
                except Exception as error:  # noqa: BLE001 - reported after the level
                    errors.append(error)
                    return
                with lock:
                    results.append(outcome)

    processes = {**(processes or {}), "client (this process)": os.getpid()}
    before, cpu_before = settled_scrape(metrics_port), snapshot(processes)
    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{mode.name} at concurrency {concurrency}: {errors[0]}")
    cpu = spent(cpu_before, snapshot(processes))
    after = settled_scrape(metrics_port)  # the level's last requests counted, not credited to the next
    tokens = sum(t for t, _, _ in results)
    ttft = [1000 * f for _, f, _ in results]
    itl = [1000 * i for _, _, i in results]
    return Level(level_name(mode, path), concurrency, len(results), tokens, seconds, tokens / seconds,
                 percentile(itl, 0.5), percentile(itl, 0.99), percentile(ttft, 0.5), percentile(ttft, 0.99),
                 histogram_mean(before, after, "ssd_batch_size"),
                 growth_ratio(before, after, "ssd_verified_draft_tokens_total", "ssd_rounds_total"),
                 {name: round(1000 * seconds / max(tokens, 1), 4) for name, seconds in cpu.items()},
                 itl_ms=itl, ttft_ms=ttft, undrafted=undrafted_shares(before, after),
                 alone=growth_ratio(before, after, "ssd_target_alone_rounds_total", "ssd_batch_size_count"))


def undrafted_shares(before: str, after: str) -> dict[str, float]:
    """Of the rounds between two scrapes, the share that drafted nothing, by why (the
    load policy's reasons: `UNDRAFTED_REASONS`)."""
    return {reason: growth_ratio(before, after, "ssd_undrafted_rounds_total", "ssd_batch_size_count", reason=reason)
            for reason in UNDRAFTED_REASONS}


def level_name(mode: Mode, path: str) -> str:
    return mode.name if path == PATHS[0] else f"{mode.name} ({path})"


def serve_for(engines: Path, batching: str, run_dir: Path, max_concurrency: int | None,
              draft_method: str = DRAFT_METHODS[0]):
    """A server as `scripts/serve.py --engines ENGINES --batching BATCHING --draft-method
    METHOD` starts it."""
    flags = ["--engines", str(engines), "--batching", batching, "--draft-method", draft_method]
    if max_concurrency is not None:
        flags += ["--max-concurrency", str(max_concurrency)]
    return serve(values_from_args(serve_args(flags)), run_dir, Ports.free())


def print_level(level: Level) -> None:
    runs = f" ({level.runs} runs)" if level.runs > 1 else ""
    print(f"{level.mode:22s} {level.concurrency:4d} {level.tokens_per_s:9.1f} {level.itl_ms_p50:8.2f} "
          f"{level.itl_ms_p99:8.2f} {level.ttft_ms_p50:8.1f} {level.ttft_ms_p99:8.1f} "
          f"{level.mean_batch:6.2f} {level.mean_k:5.2f} {level.undrafted.get('clock', 0.0):6.1%} "
          f"{level.alone:6.1%}{runs}", flush=True)


HEADER = (f"{'mode':22s} {'C':>4s} {'tok/s':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'TTFT p50':>8s} "
          f"{'TTFT p99':>8s} {'batch':>6s} {'K':>5s} {'clock':>6s} {'alone':>6s}")


def run_modes(args, modes: list[Mode], extra: dict, concurrency: tuple[int, ...], label: str) -> list[Level]:
    """Every mode at every concurrency, the modes of one server interleaved level by level;
    the levels come back by mode, then concurrency."""
    levels: list[Level] = []
    names = [level_name(mode, path) for mode in modes for path in args.paths]
    for batching in dict.fromkeys(mode.batching for mode in modes):
        with tempfile.TemporaryDirectory(prefix="saguaro-load-") as run_dir:
            print(f"[{label}] starting a server (batching {batching}) ...", flush=True)
            with serve_for(args.engines, batching, Path(run_dir), args.max_concurrency, args.draft_method) as server:
                url = f"127.0.0.1:{server.ports.grpc}"
                processes = server_processes(server.process.pid)
                served = [(mode, path) for mode in modes if mode.batching == batching for path in args.paths]
                paths = {level_name(mode, path): path for mode, path in served}
                for mode, path in served:
                    run_level(url, server.ports.metrics, mode, 1, 2, args.max_tokens, extra, path)  # warm-up
                for index, c in enumerate(concurrency):
                    if args.warmup_per_stream:
                        warm_up(args, url, server.ports.metrics, interleaved(served, index), c, extra)
                    runs: dict[str, list[Level]] = {}
                    for repeat in range(args.repeats):
                        for mode, path in interleaved(served, index + repeat):
                            level = run_level(url, server.ports.metrics, mode, c, level_requests(args, c),
                                              args.max_tokens, extra, path, processes)
                            print_level(level)
                            runs.setdefault(level.mode, []).append(level)
                    for name, mode_runs in runs.items():
                        levels.append(merged(mode_runs))
                        levels[-1].over_ar = paired_ratios(mode_runs, runs.get(level_name(MODES[0], paths[name]), []))
                        if args.repeats > 1:
                            print_level(levels[-1])
    return sorted(levels, key=lambda level: (names.index(level.mode), level.concurrency))


def paired_ratios(runs: list[Level], baseline: list[Level]) -> list[float]:
    """Each repeat's tokens/s over the baseline's in the same repeat (the two ran back to
    back): the spread of these is the noise a merged ratio carries. Empty for the
    baseline itself, or without one."""
    if runs is baseline or len(runs) != len(baseline):
        return []
    return [round(run.tokens_per_s / base.tokens_per_s, 3) for run, base in zip(runs, baseline)]


def warm_up(args, url: str, metrics_port: int, served: list, concurrency: int, extra: dict) -> None:
    """A level of every mode at this concurrency, not counted (`--warmup-per-stream`)."""
    requests = concurrency * args.warmup_per_stream
    print(f"warm-up at C={concurrency}: {requests} requests per mode, not counted", flush=True)
    for mode, path in served:
        run_level(url, metrics_port, mode, concurrency, requests, args.max_tokens, extra, path)


def level_requests(args, concurrency: int) -> int:
    """Requests in a level: `--requests-per-stream` for each of its streams. A level is
    timed from its first request to its last response, so its start (every stream's
    prompt at once) and its end (streams finishing one by one, their slots left idle)
    count too; at 2 requests per stream they had been half of a 16-stream level on the
    tiny engines (a mean batch of 11 of 16, runs from 3,200 to 5,100 tok/s)."""
    return max(args.min_requests, args.requests_per_stream * concurrency)


def interleaved(served: list, index: int) -> list:
    """The modes of one concurrency level, in turn, the order turned at every other level
    (and every other repeat):
    a busy spell of the shared machine then slows the modes a ratio compares alike, where
    running each mode's whole sweep in turn had autoregressive and SSD minutes apart."""
    return served if index % 2 == 0 else served[::-1]


def print_cpu(levels: list[Level]) -> None:
    """Where the CPU went: ms of CPU per output token, by process."""
    names = list(dict.fromkeys(name for level in levels for name in level.cpu_ms_per_token))
    print("\nCPU per output token (ms), by process:")
    print(f"{'mode':26s} {'C':>4s} " + " ".join(f"{name:>16s}" for name in names) + f" {'all':>8s} {'wall':>8s}")
    for level in levels:
        cpu = level.cpu_ms_per_token
        print(f"{level.mode:26s} {level.concurrency:4d} " + " ".join(f"{cpu.get(name, 0):16.3f}" for name in names)
              + f" {sum(cpu.values()):8.3f} {1000 / level.tokens_per_s:8.3f}")


def figure(levels: list[Level], mode: str, concurrency: int, field: str) -> float | None:
    for level in levels:
        if level.mode == mode and level.concurrency == concurrency:
            return getattr(level, field)
    return None


def ratio(numerator, denominator) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"


def print_targets(levels: list[Level], sampled: list[Level]) -> None:
    """The load policy's targets, as measured in this run (figures, not assertions)."""
    ar, sd, ssd, alone = (m.name for m in MODES)
    rows = [
        ("C=1: batched SSD / per-request SSD (>= 0.95)", figure(levels, ssd, 1, "tokens_per_s"),
         figure(levels, alone, 1, "tokens_per_s")),
        ("C=16: batched AR / its C=1 (>= 4)", figure(levels, ar, 16, "tokens_per_s"), figure(levels, ar, 1, "tokens_per_s")),
        ("C=16: SSD policy / its C=1 (>= 4)", figure(levels, ssd, 16, "tokens_per_s"),
         figure(levels, ssd, 1, "tokens_per_s")),
        ("C=16: SSD policy / batched AR (>= 0.95)", figure(levels, ssd, 16, "tokens_per_s"),
         figure(levels, ar, 16, "tokens_per_s")),
        ("C=2: SSD policy / batched SD (> 1)", figure(levels, ssd, 2, "tokens_per_s"), figure(levels, sd, 2, "tokens_per_s")),
        ("C=4: SSD policy / batched SD (> 1)", figure(levels, ssd, 4, "tokens_per_s"), figure(levels, sd, 4, "tokens_per_s")),
        ("sampled C=1: SSD policy / AR (>= 1)", figure(sampled, ssd, 1, "tokens_per_s"),
         figure(sampled, ar, 1, "tokens_per_s")),
        ("sampled C=1: SSD policy / SD (>= 1)", figure(sampled, ssd, 1, "tokens_per_s"),
         figure(sampled, sd, 1, "tokens_per_s")),
    ]
    print("\ntargets (measured ratios):")
    for name, numerator, denominator in rows:
        print(f"  {name:46s} {ratio(numerator, denominator)}")
    for level in levels:
        if level.mode == ssd and len(level.over_ar) > 1:
            print(f"  C={level.concurrency}: SSD policy / batched AR by repeat {spread(level.over_ar)}")
    for level in levels:
        if level.mode == ssd and level.mean_k > 0.05:
            itl_ar = figure(levels, ar, level.concurrency, "itl_ms_p50")
            print(f"  C={level.concurrency}: SSD keeps K={level.mean_k:.2f}; ITL p50 {level.itl_ms_p50:.2f} ms "
                  f"vs batched AR {itl_ar:.2f} ms")


def plot(levels: list[Level], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(level.mode for level in levels):
        mine = [level for level in levels if level.mode == mode]
        xs = [level.concurrency for level in mine]
        throughput.plot(xs, [level.tokens_per_s for level in mine], marker="o", label=mode)
        latency.plot(xs, [level.itl_ms_p50 for level in mine], marker="o", label=mode)
    for axis, name in ((throughput, "total output tokens/s"), (latency, "inter-token latency p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    throughput.legend()
    save(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True, help="a folder made by scripts/build_engines.py")
    add_draft_method_argument(parser)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="concurrent streams per level (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (end token ignored)")
    parser.add_argument("--requests-per-stream", type=int, default=8,
                        help="requests per level: this many per stream (C x this) ...")
    parser.add_argument("--min-requests", type=int, default=4, help="... or this many, if more")
    parser.add_argument("--warmup-per-stream", type=int, default=1,
                        help="requests per stream run at each concurrency before its measured levels, not "
                             "counted (0: none)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mode at each level, the order turned each time, counted as one")
    parser.add_argument("--max-concurrency", type=int, help="the servers' KV slots used (default: all)")
    parser.add_argument("--modes", default=",".join(m.key for m in MODES),
                        help="which modes, of " + ", ".join(m.key for m in MODES) + " (default all)")
    parser.add_argument("--paths", default=PATHS[0],
                        help="where requests go, of " + ", ".join(PATHS) + " (default %(default)s): the ssd model "
                             "with text_input, or the ensemble (text through the pre/postprocessing models)")
    parser.add_argument("--no-sampled", action="store_true", help="skip the temperature 0.8 check at C=1")
    parser.add_argument("--sampled-top-p", type=float, default=1.0,
                        help="top-p of the sampled check (chat clients often send 0.9-0.95; default off)")
    parser.add_argument("--out", type=Path, default=Path(".triton/bench_serving"), help="JSON and PNG go here")
    args = parser.parse_args(argv)
    try:
        args.concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        parser.error(f"--concurrency takes integers like 1,2,4; got {args.concurrency!r}")
    known = {m.key: m for m in MODES}
    unknown = [key for key in args.modes.split(",") if key not in known]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    args.modes = [known[key] for key in args.modes.split(",")]
    args.paths = args.paths.split(",")
    if set(args.paths) - set(PATHS):
        parser.error(f"--paths: choose from {', '.join(PATHS)}; got {','.join(args.paths)}")
    if min(args.concurrency) < 1 or args.max_tokens < 2 or min(args.repeats, args.requests_per_stream) < 1:
        parser.error("--concurrency, --repeats and --requests-per-stream values must be >= 1 and --max-tokens >= 2")
    if not 0 < args.sampled_top_p <= 1:
        parser.error(f"--sampled-top-p must be in (0, 1]; got {args.sampled_top_p}")
    if not (args.engines / "manifest.json").is_file():
        parser.error(f"--engines {args.engines}: no manifest.json (build engines with scripts/build_engines.py)")
    return args


SAMPLED_TEMPERATURE = 0.8


def sampled_inputs(top_p: float) -> dict:
    """The sampled check's request inputs: top-p only when it filters (1 is the server's default)."""
    return {"temperature": SAMPLED_TEMPERATURE, **({"top_p": top_p} if top_p < 1 else {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"engines {args.engines}, {args.max_tokens} tokens per request, K up to "
          f"{DECODE_DEFAULTS.num_draft_tokens}, concurrency {','.join(map(str, args.concurrency))}")
    print(HEADER)
    levels = run_modes(args, args.modes, {}, args.concurrency, "greedy")
    batched = [mode for mode in args.modes if mode.batching == "iteration"]
    sampled = [] if args.no_sampled else run_modes(args, batched, sampled_inputs(args.sampled_top_p), (1,),
                                                   f"temperature {SAMPLED_TEMPERATURE}, top-p {args.sampled_top_p}")
    print_cpu(levels)
    print_targets(levels, sampled)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps({"greedy": [asdict(level) for level in levels],
                                                    "sampled": [asdict(level) for level in sampled]}, indent=1))
    plot(levels, args.out / "load.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
