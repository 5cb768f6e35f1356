"""The engine-level latency suite: what each forward of a built pair costs on this machine,
and how close a decode step comes to what the memory bus allows.

Per engine (target, draft), precision and thread count: a prefill, and at several context
lengths a decode step (1 token), a verify (K+1 tokens), and tree steps of B branches (B
tokens). Then the premise of speculative decoding, verify(K+1) / decode(1) (close to 1
when a step is bound by reading the weights), and the bandwidth limit: the bytes of
weights a decode step reads divided by a measured single-thread read bandwidth, so that
"decode at X% of the bandwidth limit" says how much faster a step could possibly get.
The largest branch budget that hides under one verify is computed from the same figures
by the calibration's rule (`control.calibration`; the build stores its own measurement
in the manifest).
Memory: resident memory (VmRSS, split into private and file-mapped pages) before and
after loading the pair and after running it, next to the weights on disk.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import cast

import numpy as np
import onnx
import torch

from saguaro.runtime.control.calibration import Calibration, machine_name
from saguaro.runtime.control.costs import forward_cost
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.manifest import read_manifest, validate_engine_dir

PREFILL_TOKENS = 128
CONTEXTS = (64, 256, 768)
TREE_BRANCHES = (4, 8, 16)
BANDWIDTH_BUFFER_BYTES = 1 << 29  # 512 MiB: far beyond any cache
MB = 1e6


@dataclass(frozen=True)
class ContextCosts:
    """Median ms of one engine's forwards with `context` tokens cached."""

    context: int
    decode_ms: float
    verify_ms: float
    tree_step_ms: dict[int, float]

    @property
    def premise(self) -> float:
        """verify(K+1) / decode(1): what K+1 tokens cost in units of one."""
        return self.verify_ms / self.decode_ms


@dataclass(frozen=True)
class EngineCosts:
    role: str
    precision: str
    threads: int
    prefill_tokens: int
    prefill_ms: float
    contexts: list[ContextCosts]
    file_bytes: int | None = None  # the role's files on disk (weights and graphs); None: no engine folder
    read_bytes: int | None = None  # weights one decode step reads

    def bandwidth_limit_ms(self, bandwidth_gbs: float) -> float | None:
        """The fastest a decode step can be: its weights read once at the measured bandwidth."""
        return None if self.read_bytes is None else self.read_bytes / (bandwidth_gbs * 1e9) * 1000


@dataclass(frozen=True)
class Resident:
    """Resident memory (/proc/self/status): private pages, and pages of mapped files (ONNX
    Runtime maps external weight files; such pages are clean and shared with the page cache)."""

    anon_bytes: int
    file_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.anon_bytes + self.file_bytes


@dataclass(frozen=True)
class MemoryFigures:
    """This process's resident memory around loading one pair."""

    before: Resident
    loaded: Resident   # after opening both engines
    after: Resident    # after the suite ran (arenas, touched KV slots)
    target_file_bytes: int
    draft_file_bytes: int

    @property
    def private_load_bytes(self) -> int:
        return self.loaded.anon_bytes - self.before.anon_bytes

    @property
    def copies_of_weights(self) -> float:
        """Private memory loading added, in units of the weights on disk: about 1 when each
        model's weights are held once (the plugin graphs are weightless; the mapped file
        pages ONNX Runtime read them from are not a private copy)."""
        return self.private_load_bytes / (self.target_file_bytes + self.draft_file_bytes)


@dataclass
class SuiteReport:
    engines_dir: str
    machine: str
    date: str
    k: int
    bandwidth_gbs: float
    engines: list[EngineCosts] = field(default_factory=list)
    hidden_branches: dict[int, dict[int, int]] = field(default_factory=dict)  # threads -> context -> B
    stored_hidden_branches: int | None = None  # the build's calibration, at this K
    memory: MemoryFigures | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def resident() -> Resident:
    """This process's RssAnon and RssFile (+ RssShmem) from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                fields[name] = int(value.split()[0]) * 1024
    if "RssAnon" not in fields:
        raise RuntimeError("/proc/self/status has no RssAnon line")
    return Resident(fields["RssAnon"], fields.get("RssFile", 0) + fields.get("RssShmem", 0))


def read_bandwidth_gbs(repeats: int = 5, size: int = BANDWIDTH_BUFFER_BYTES) -> float:
    """GB/s of one thread summing a buffer far larger than the caches (the best of
    `repeats`: the rate the bus sustains, not what a neighbour leaves of it)."""
    buffer = torch.ones(size // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one engine thread reads the weights of a decode step
    try:
        best = math.inf
        for _ in range(repeats + 1):  # the first pass also faults the pages in
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return size / best / 1e9


def role_file_bytes(engine_dir: Path, role: str) -> int:
    """Every file of a role's folder: its graphs and the weight files they refer to."""
    return sum(path.stat().st_size for path in (engine_dir / role).iterdir() if path.is_file())


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """An initializer's size from its type and shape (its data may live in another file)."""
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def decode_read_bytes(model_path: Path) -> int:
    """Weights a one-token forward reads: every initializer but those only `Gather`ed (the
    embedding table, of which a step reads one row; a table the lm_head shares counts)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    gathered_only = {tensor.name for tensor in graph.initializer}
    for node in graph.node:
        for position, name in enumerate(node.input):
            if not (node.op_type == "Gather" and position == 0):
                gathered_only.discard(name)
    return sum(tensor_bytes(tensor) for tensor in graph.initializer if tensor.name not in gathered_only)


def context_costs(engine, context: int, k: int, branches: tuple[int, ...], repeats: int) -> ContextCosts:
    def cost(count: int) -> float:
        return forward_cost(engine, context, count, repeats)

    return ContextCosts(context, cost(1), cost(k + 1), {b: cost(b) for b in branches})


def engine_costs(engine, role: str, precision: str, threads: int, k: int, contexts: tuple[int, ...],
                 branches: tuple[int, ...], prefill: int, repeats: int) -> EngineCosts:
    return EngineCosts(role, precision, threads, prefill, forward_cost(engine, 0, prefill, repeats),
                       [context_costs(engine, c, k, branches, repeats) for c in contexts])


def with_files(costs: EngineCosts, engine_dir: Path, manifest: dict) -> EngineCosts:
    """`costs` with the role's bytes on disk and read per decode step (built engines)."""
    model_file = engine_dir / manifest["models"][costs.role]["graphs"]["model"]["engine"]
    return replace(costs, file_bytes=role_file_bytes(engine_dir, costs.role), read_bytes=decode_read_bytes(model_file))


def hidden_by_context(target: list[ContextCosts], draft: list[ContextCosts], k: int) -> dict[int, int]:
    """The largest measured B whose pre-speculation hides under the target's verify, at each
    context (the rule of the build's calibration, on these figures)."""
    return {t.context: Calibration.from_milliseconds(t.context, {k: t.verify_ms}, d.decode_ms, d.tree_step_ms)
            .hidden_branches(k, most=max(d.tree_step_ms))
            for t, d in zip(target, draft)}


def fitting_contexts(max_context: int, wanted: tuple[int, ...], longest_step: int) -> tuple[int, ...]:
    """The wanted contexts that leave room for the longest step (else the longest that does)."""
    fitting = tuple(c for c in wanted if c + longest_step <= max_context)
    return fitting or (max(1, max_context - longest_step),)


def measure_pair(report: SuiteReport, target, draft, precision: str, threads: int, contexts: tuple[int, ...],
                 branches: tuple[int, ...], prefill: int, repeats: int,
                 engine_dir: Path | None = None) -> list[EngineCosts]:
    """Both engines' costs (with their files' bytes when they come from `engine_dir`),
    added to `report` with the budget that hides at each context."""
    fitting = fitting_contexts(target.info.max_context, contexts, max(report.k + 1, *branches))
    engines = (("target", target), ("draft", draft))
    # a draft of host Python (the n-gram draft) has no precision and no files in the folder
    measured = [engine_costs(engine, role, engine.info.backend if engine.info.on_host else precision, threads,
                             report.k, fitting, branches, prefill, repeats) for role, engine in engines]
    if engine_dir is not None:
        manifest = read_manifest(engine_dir)
        measured = [costs if engine.info.on_host else with_files(costs, engine_dir, manifest)
                    for costs, (_, engine) in zip(measured, engines)]
    report.engines += measured
    report.hidden_branches[threads] = hidden_by_context(measured[0].contexts, measured[1].contexts, report.k)
    return measured


def new_report(where: str, k: int) -> SuiteReport:
    return SuiteReport(where, machine_name(), time.strftime("%Y-%m-%d"), k, read_bandwidth_gbs())


def run_suite(engine_dir: str | Path, thread_counts: tuple[int | None, ...] = (None,), k: int = 4,
              contexts: tuple[int, ...] = CONTEXTS, branches: tuple[int, ...] = TREE_BRANCHES,
              prefill: int = PREFILL_TOKENS, repeats: int = 20) -> SuiteReport:
    """The whole suite on one engine folder, once per thread count (None: the build's);
    memory is measured around the first load, before any engine was loaded."""
    engine_dir = Path(engine_dir)
    manifest = validate_engine_dir(engine_dir)
    report = new_report(str(engine_dir), k)
    before = resident()
    for index, threads in enumerate(thread_counts):
        threads = threads or manifest["build"]["session"]["threads"]
        target, draft = load_engine_pair(engine_dir, threads, threads)
        loaded = resident()
        measure_pair(report, target, draft, manifest["precision"], threads, contexts, branches, prefill, repeats,
                     engine_dir)
        if index == 0:
            report.stored_hidden_branches = target.info.hidden_budget(k)
            # measure_pair had the engine folder: with_files gave every engine its file_bytes
            file_bytes = cast("list[int]", [e.file_bytes for e in report.engines])
            report.memory = MemoryFigures(before, loaded, resident(), *file_bytes)
        del target, draft
    return report


# -- the printed tables --------------------------------------------------------------------

def engine_table(report: SuiteReport) -> list[str]:
    lines = [f"{'engine':7s} {'precision':9s} {'threads':>7s} {'prefill ms':>10s} {'tokens':>6s} "
             f"{'files MB':>8s} {'read MB':>8s} {'bw-limit ms':>11s}"]
    for e in report.engines:
        lines.append(f"{e.role:7s} {e.precision:9s} {e.threads:7d} {e.prefill_ms:10.2f} {e.prefill_tokens:6d} "
                     f"{figure(e.file_bytes, MB, 8, 2)} {figure(e.read_bytes, MB, 8, 2)} "
                     f"{figure(e.bandwidth_limit_ms(report.bandwidth_gbs), 1, 11, 3)}")
    return lines


def figure(value: float | None, unit: float, width: int, digits: int) -> str:
    """`value / unit` in a column, or "-" where it is not known (no engine folder)."""
    return f"{'-':>{width}s}" if value is None else f"{value / unit:{width}.{digits}f}"


def context_table(report: SuiteReport) -> list[str]:
    branches = sorted({b for e in report.engines for c in e.contexts for b in c.tree_step_ms})
    k = report.k
    lines = [f"{'engine':7s} {'precision':9s} {'threads':>7s} {'context':>7s} {'decode(1)':>9s} "
             f"{f'verify({k + 1})':>9s} {'verify/decode':>13s} "
             + " ".join(f"{f'tree({b})':>8s}" for b in branches) + f" {'decode % of bw limit':>20s}"]
    for e in report.engines:
        limit = e.bandwidth_limit_ms(report.bandwidth_gbs)
        for c in e.contexts:
            lines.append(f"{e.role:7s} {e.precision:9s} {e.threads:7d} {c.context:7d} {c.decode_ms:9.3f} "
                         f"{c.verify_ms:9.3f} {c.premise:13.2f} "
                         + " ".join(f"{c.tree_step_ms[b]:8.3f}" for b in branches)
                         + (f" {100 * limit / c.decode_ms:19.1f}%" if limit is not None else f" {'-':>20s}"))
    return lines


def hidden_table(report: SuiteReport) -> list[str]:
    contexts = sorted({c for by_context in report.hidden_branches.values() for c in by_context})
    lines = [f"{'threads':>7s} " + " ".join(f"{f'B at {c}':>9s}" for c in contexts)]
    for threads, by_context in report.hidden_branches.items():
        lines.append(f"{threads:7d} " + " ".join(f"{by_context[c]:9d}" for c in contexts))
    return lines


def memory_table(report: SuiteReport) -> list[str]:
    m = report.memory
    assert m is not None  # format_report asks only when the report has memory figures

    def added(stage: Resident, kind: str) -> float:
        return (getattr(stage, kind) - getattr(m.before, kind)) / MB

    return [f"{'precision':9s} {'target files MB':>15s} {'draft files MB':>14s} {'RSS before MB':>13s} "
            f"{'loaded: private +MB':>19s} {'mapped +MB':>10s} {'after run: private +MB':>22s} {'mapped +MB':>10s} "
            f"{'copies':>6s}",
            f"{report.engines[0].precision:9s} {m.target_file_bytes / MB:15.2f} {m.draft_file_bytes / MB:14.2f} "
            f"{m.before.total_bytes / MB:13.1f} {added(m.loaded, 'anon_bytes'):19.1f} "
            f"{added(m.loaded, 'file_bytes'):10.1f} {added(m.after, 'anon_bytes'):22.1f} "
            f"{added(m.after, 'file_bytes'):10.1f} {m.copies_of_weights:6.2f}"]


def format_report(report: SuiteReport) -> str:
    k = report.k
    parts = [f"engine-level latency suite: {report.engines_dir} on {report.machine}, {report.date}; "
             f"read bandwidth {report.bandwidth_gbs:.1f} GB/s (one thread); median ms per forward",
             *engine_table(report), "", *context_table(report), "",
             f"largest branch budget B whose pre-speculation (glue + {k} tree steps) hides under verify({k + 1}):",
             *hidden_table(report)]
    if report.stored_hidden_branches is not None:
        parts.append(f"stored at build time (manifest calibration): hidden_branches(K={k}) = "
                     f"{report.stored_hidden_branches}")
    if report.memory is not None:
        parts += ["", "resident memory of the loaded pair (VmRSS) next to its files:", *memory_table(report)]
    return "\n".join(parts)
