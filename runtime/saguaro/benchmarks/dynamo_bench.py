"""Per-worker throughput behind Dynamo's frontend, measured at several stream counts, and
what N workers would serve (`scripts/bench_dynamo.py`; the table in docs/dynamo.md).

    python scripts/bench_dynamo.py --engines engines/tiny --streams 1,2,4,8,16
    python scripts/bench_dynamo.py --engines engines/smollm2 --streams 1,4,16 --workers 1,2 --json out.json

For each worker count W (`--workers`) a one-machine cluster is started (`dynamo_cluster`),
and at each stream count C, C clients each keep one streamed completion in flight through
the OpenAI API (official `openai` client) until the level's requests are done; every
request generates exactly `--max-tokens` tokens (`ignore_eos`). Per level: output tokens/s
of the whole cluster and per worker, time to first token and time per output token (p50),
and from each worker's own counters the requests it served and its acceptance. Figures
are printed and written as JSON, never asserted.

The projection to N workers multiplies the one-worker figure at C streams per worker by N.
It assumes what a deployment of one worker per machine (or GPU) gives and one machine here
does not: each worker has its own cores, memory bandwidth and accelerator; the router
spreads streams evenly (round-robin does, for equal requests); the frontend and the
network are not the bottleneck (one frontend tokenizes and detokenizes for all workers;
add frontends behind a load balancer when they are). The W = 2 row on this machine shows
what sharing one machine's cores costs instead.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from saguaro.benchmarks.bench import int_list
from saguaro.benchmarks.load_bench import percentile
from saguaro.runtime.models.prompts import PROMPTS
from saguaro.serving.dynamo_cluster import LocalCluster

STREAMS = (1, 2, 4, 8, 16)


@dataclass
class Level:
    workers: int
    streams: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float             # the whole cluster
    tokens_per_s_per_worker: float
    ttft_ms_p50: float
    tpot_ms_p50: float              # time per output token after the first, per request
    requests_per_worker: list[int]  # from each worker's own counters
    acceptance: float               # accepted / verified drafts, over all workers


@dataclass
class Timed:
    tokens: int
    ttft_s: float
    tpot_s: float  # (last text - first text) / (tokens - 1)


async def one_request(client, model: str, prompt: str, max_tokens: int) -> Timed:
    started = time.perf_counter()
    arrivals, tokens = [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if not arrivals or tokens != max_tokens:
        raise RuntimeError(f"a request generated {tokens} tokens, not {max_tokens}")
    return Timed(tokens, arrivals[0] - started, (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1))


async def run_streams(url: str, model: str, streams: int, requests: int, max_tokens: int) -> tuple[list[Timed], float]:
    """`streams` clients, each sending its next request when the last one ends."""
    import openai

    queue = list(range(requests))
    done: list[Timed] = []

    async def client_loop(client):
        while queue:
            index = queue.pop()
            done.append(await one_request(client, model, PROMPTS[index % len(PROMPTS)], max_tokens))

    async with openai.AsyncOpenAI(base_url=url, api_key="not-needed", max_retries=0) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
        return done, time.perf_counter() - started


def worker_totals(cluster: LocalCluster) -> list[dict[str, float]]:
    return [{"requests": worker.counter("dynamo_component_requests_total"),
             "accepted": worker.counter("ssd_accepted_draft_tokens_total"),
             "verified": worker.counter("ssd_verified_draft_tokens_total")} for worker in cluster.live_workers()]


def measure(cluster: LocalCluster, workers: int, streams: int, requests: int, max_tokens: int) -> Level:
    assert cluster.model_name is not None  # LocalCluster.__post_init__ sets it
    before = worker_totals(cluster)
    timed, seconds = asyncio.run(run_streams(cluster.url, cluster.model_name, streams, requests, max_tokens))
    after = worker_totals(cluster)
    delta = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]
    tokens = sum(request.tokens for request in timed)
    verified = sum(d["verified"] for d in delta)
    return Level(workers, streams, len(timed), tokens, round(seconds, 3), round(tokens / seconds, 1),
                 round(tokens / seconds / workers, 1),
                 round(1000 * percentile([request.ttft_s for request in timed], 0.5), 1),
                 round(1000 * percentile([request.tpot_s for request in timed], 0.5), 2),
                 [int(d["requests"]) for d in delta],
                 round(sum(d["accepted"] for d in delta) / verified, 3) if verified else 0.0)


def print_level(level: Level) -> None:
    print(f"  W={level.workers} C={level.streams:>2}: {level.tokens_per_s:8.1f} tok/s "
          f"({level.tokens_per_s_per_worker:7.1f} per worker), TTFT p50 {level.ttft_ms_p50:7.1f} ms, "
          f"TPOT p50 {level.tpot_ms_p50:6.2f} ms, requests per worker {level.requests_per_worker}, "
          f"acceptance {level.acceptance:.2f}", flush=True)


def projection(levels: list[Level], workers: tuple[int, ...]) -> list[dict]:
    """N workers at C streams each, from the one-worker figure (see the module's assumptions)."""
    single = {level.streams: level.tokens_per_s for level in levels if level.workers == 1}
    return [{"streams_per_worker": streams, **{f"{n}_workers": round(n * rate, 1) for n in workers}}
            for streams, rate in sorted(single.items())]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_dynamo.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--streams", type=int_list, default=STREAMS, help="concurrent streams, e.g. 1,2,4,8,16")
    parser.add_argument("--workers", type=int_list, default=(1,), help="cluster sizes to measure, e.g. 1,2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-requests", type=int, default=8, help="requests per level: max(this, 2 x streams)")
    parser.add_argument("--project", type=int_list, default=(1, 2, 4, 8, 16), help="N of the projection")
    parser.add_argument("--chat-template", type=Path, metavar="FILE")
    parser.add_argument("--worker-flag", action="append", default=[], metavar="FLAG",
                        help="passed on to every serve_dynamo.py (repeat it), e.g. --worker-flag=--fixed-k")
    parser.add_argument("--json", type=Path, help="write every figure here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.max_tokens < 1 or args.min_requests < 1:
        print("bench_dynamo: --max-tokens and --min-requests must be >= 1", file=sys.stderr)
        return 2
    flags = args.worker_flag + (["--chat-template", str(args.chat_template.resolve())] if args.chat_template else [])
    levels: list[Level] = []
    for workers in args.workers:
        with tempfile.TemporaryDirectory(prefix="saguaro-bench-dynamo-") as run_dir:
            with LocalCluster(args.engines, Path(run_dir), workers, worker_flags=flags) as cluster:
                print(f"{workers} worker(s) on {cluster.url}, {args.max_tokens} tokens per request", flush=True)
                measure(cluster, workers, 1, 2, args.max_tokens)  # warm-up: first requests pay for loading
                for streams in args.streams:
                    levels.append(measure(cluster, workers, streams, max(args.min_requests, 2 * streams),
                                          args.max_tokens))
                    print_level(levels[-1])
    projected = projection(levels, args.project)
    if projected:
        print("projection, N workers x the one-worker figure (tok/s):")
        for row in projected:
            print(f"  C={row['streams_per_worker']:>2} per worker: " +
                  ", ".join(f"N={n}: {row[f'{n}_workers']}" for n in args.project))
    if args.json:
        args.json.write_text(json.dumps({"levels": [asdict(level) for level in levels], "projection": projected,
                                         "max_tokens": args.max_tokens, "engines": str(args.engines)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
