"""The `Engine` protocol over ONNX Runtime graphs built by `scripts/build_engines.py`.

A model is one fused graph (`saguaro.compiler.fused_export`) that serves every call:
prefill, decode, K+1 verification, tree-masked branch steps, and batches of sequences.
Its KV caches are slots of one `KVPool` bound through IOBinding as both past and present,
so a step writes its new entries in place and copies nothing. The plugin ops are small
weightless graphs of their own: `fused_verify` (target) reads the model's logits rows
and returns only `(accepted, bonus)`; `branch_draft` (draft) plans a round's branches.
A branch commit moves entries inside the draft's slot (`PooledCache.gather`).

With a feature draft (an EAGLE-3 head), the target's graph also returns its feature
layers' hidden states (`hidden_states`), which its rows carry (`Rows.hidden`, and a
round's committed positions in `VerifyResult.hidden`); the draft
(`OnnxRuntimeFeatureDraft`) is the head's graph, which reads a feature beside each token
(`Step.hidden`) and returns its own (`hidden_out`), and a `project` graph that turns the
target's features into the head's inputs.

`SessionSettings` and `session_options` say how every session runs (threads, pinning,
spinning); the build uses the same options when it lets ONNX Runtime check a graph. The
engines run one thread each so that the draft and the target compute at once, each on
its own core; for a round in which nothing of the draft's runs beside the target,
`run_alone` runs the model on a second session of the same graph with `ALONE_THREADS`
threads whose worker spins within a forward, opened at its first use, so that the idle
core joins in.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import onnxruntime as ort
import torch

from saguaro.plugins.branch_draft.reference import BranchPlan
from saguaro.runtime.core.contracts import (EngineInfo, OneSequenceForms, Rows, Step, VerifyResult, VerifyStep,
                                       draft_cache_capacity, target_cache_capacity)
from saguaro.runtime.engines.batching import PackedBatch, pack_steps
from saguaro.runtime.engines.manifest import engine_info, is_feature_draft
from saguaro.runtime.engines.kv_cache import KVPool, PooledCache
from saguaro.runtime.core.logprobs import verify_result
from saguaro.runtime.core.sampling import UNSCORED

ALONE_THREADS = 2  # intra-op threads of a model running with the other model idle: both cores


@dataclass(frozen=True)
class SessionSettings:
    """How a built engine runs: intra-op threads per engine, optional core pinning, spinning.

    Spinning is off by default: on a 2-core machine a spinning idle pool steals the core
    the other model (draft or target) is computing on. Where it is on, it lasts a forward:
    the workers stop spinning when the call returns (`session.force_spinning_stop`), since
    between forwards the other model or the server's threads may need the core.
    """

    threads: int = 1
    pin_cores: tuple[int, ...] | None = None  # cores for intra-op worker threads (threads > 1)
    spin: bool = False

    @classmethod
    def from_manifest(cls, manifest: dict, threads: int | None = None) -> "SessionSettings":
        session = manifest["build"]["session"]
        pins = session["pin_cores"]
        return cls(threads=threads or session["threads"], pin_cores=tuple(pins) if pins else None,
                   spin=session["spin"])


def session_options(settings: SessionSettings,
                    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                    optimized_path: Path | None = None) -> ort.SessionOptions:
    """Threads, pinning and spinning from the build config; sequential execution (one
    call's ops are a chain, and the other core belongs to the other model)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = level
    options.log_severity_level = 3
    spin = "1" if settings.spin else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    options.add_session_config_entry("session.force_spinning_stop", spin)
    if settings.pin_cores and settings.threads > 1:
        # ORT numbers logical processors from 1; worker threads exclude the caller's thread
        workers = [str(core + 1) for core in settings.pin_cores[:settings.threads - 1]]
        options.add_session_config_entry("session.intra_op_thread_affinities", ";".join(workers))
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return options


def open_session(path: Path, settings: SessionSettings) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), session_options(settings), providers=["CPUExecutionProvider"])


def alone_settings(settings: SessionSettings) -> SessionSettings | None:
    """The settings of a model running with the other model idle; None when the engine's
    own already use as many threads (nothing to gain from a second session). Its worker
    spins within a forward: the other core is idle by definition, and waking a sleeping
    worker at each of a forward's parallel ops had cost a fifth of a decode step (bench
    engines 3.2 -> 2.5 ms, SmolLM2 int8 9.9 -> 8.0 ms at one sequence; 10.4 -> 9.0 and
    34.6 -> 31.1 ms at 16)."""
    if settings.threads >= ALONE_THREADS:
        return None
    return replace(settings, threads=ALONE_THREADS, pin_cores=None, spin=True)


def bind_array(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False) -> None:
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


# A model graph that scores part of the vocabulary (a draft's `output_vocab`) names, in its
# metadata, the token each of its logits rows scores: comma-separated ids, row by row.
SCORED_TOKENS_KEY = "saguaro.scored_tokens"
SCORED_INPUT = "scored_positions"  # [B, P] int64: the query positions whose logits each row returns


def scored_tokens(session: ort.InferenceSession) -> torch.Tensor | None:
    """The token of each logits row of a graph that scores part of the vocabulary; None
    for a graph that scores all of it."""
    listed = session.get_modelmeta().custom_metadata_map.get(SCORED_TOKENS_KEY)
    return None if listed is None else torch.tensor([int(token) for token in listed.split(",")])


def takes_the_argmax(item: VerifyStep) -> bool:
    """A round with nothing to verify and nothing to return but its greedy token."""
    return not len(item.draft_tokens) and item.sampling.greedy and not item.logprobs


def output_width(session: ort.InferenceSession, name: str) -> int:
    """The last dimension of the graph's output `name`; 0 when the graph has no such output."""
    return next((output.shape[-1] for output in session.get_outputs() if output.name == name), 0)


class OnnxRuntimeEngine(OneSequenceForms):
    """One model's sessions (`model`, plus `fused_verify` for a target or `branch_draft`
    for a draft) over a pool of KV slots; see `saguaro.runtime.core.contracts.Engine`. A target
    whose graph returns `hidden_states` (built for a feature draft) gives them with its rows."""

    hidden_output = "hidden_states"  # the model graph's output that rows carry as `Rows.hidden`, if it has it

    def __init__(self, sessions: dict[str, ort.InferenceSession], info: EngineInfo, tokenizer, shape: dict,
                 slot_capacity: int, open_alone: Callable[[], ort.InferenceSession] | None = None):
        assert info.limits is not None  # a compiled engine's, from its manifest's build
        self.sessions, self.info, self.tokenizer, self.limits = sessions, info, tokenizer, info.limits
        # the wide session, opened at first use (a decoder that may run alone opens it when made)
        self._open_alone, self._alone_session = open_alone, None
        self._running = threading.local()  # .alone: this thread's forwards use the wide session; .bindings
        self.layers, self.vocab_size = shape["num_layers"], shape["vocab_size"]
        self.pool = KVPool(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                           self.limits.max_batch, slot_capacity)
        self.hidden_width = output_width(sessions["model"], self.hidden_output)
        self.scored_tokens = scored_tokens(sessions["model"])
        self.logits_width = self.vocab_size if self.scored_tokens is None else len(self.scored_tokens)
        self._no_draft_probs = np.zeros((self.limits.max_draft_tokens, self.vocab_size), np.float32)

    def new_cache(self, capacity: int) -> PooledCache:
        return self.pool.allocate(capacity)

    @contextmanager
    def run_alone(self) -> Iterator[None]:
        """The block's forwards (in this thread) run on the model's wide session: the
        caller promises that nothing of the other model's runs meanwhile. The same graph
        and weights, so the same logits (`tests/test_load_policy.py` checks the tokens);
        a no-op when the engine has no wide session."""
        if self._open_alone is None:
            yield
            return
        if self._alone_session is None:
            self._alone_session = self._open_alone()
        before, self._running.alone = getattr(self._running, "alone", False), True
        try:
            yield
        finally:
            self._running.alone = before

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        return [rows.logits for rows in self.forward_rows(steps)]

    def forward_rows(self, steps: Sequence[Step]) -> list[Rows]:
        return self._rows(*self._forward(steps))

    def _forward(self, steps: Sequence[Step]) -> tuple[PackedBatch, np.ndarray, np.ndarray | None]:
        """The batched forward, each step's cache grown by its tokens: the scores and hidden
        states as the graph returns them, batch row by batch row."""
        packed = pack_steps(steps)
        scores, hidden = self._run_model(packed, self.extra_inputs(steps, packed))
        for step, count in zip(steps, packed.counts):
            step.cache.length += count
        return packed, scores, hidden

    def _rows(self, packed: PackedBatch, scores: np.ndarray, hidden: np.ndarray | None) -> list[Rows]:
        logits = self.spread(torch.from_numpy(scores))
        return [self._row(packed, index, logits, hidden) for index in range(len(packed.rows))]

    @staticmethod
    def _row(packed: PackedBatch, index: int, logits: torch.Tensor, hidden: np.ndarray | None) -> Rows:
        """The `index`-th sequence's scored rows of the batch's logits, and its features."""
        row, count = packed.rows[index], packed.counts[index]
        return Rows(logits[row, :packed.scored[index]], None if hidden is None else torch.from_numpy(hidden[row, :count]))

    def spread(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores over the whole vocabulary: a graph that scores part of it gets `UNSCORED`
        (probability 0) for every other token."""
        if self.scored_tokens is None:
            return scores
        logits = torch.full((*scores.shape[:-1], self.vocab_size), UNSCORED)
        return logits.index_copy_(-1, self.scored_tokens, scores)

    def extra_inputs(self, steps: Sequence[Step], packed: PackedBatch) -> dict[str, np.ndarray]:
        """Model inputs beyond the packed batch's (a feature draft's features)."""
        return {}

    def _run_model(self, packed: PackedBatch, extra: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        # the wide session is open whenever `alone` is set (`run_alone` opens it first)
        session: ort.InferenceSession = self._alone_session if getattr(self._running, "alone", False) else self.sessions["model"]
        binding = self._binding(session, packed.first_slot, packed.batch)
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                  "seqlens_k": packed.seqlens_k, "query_seqlens": packed.query_seqlens,
                  "total_sequence_length": np.array(packed.total_sequence_length, np.int32),
                  "attention_mask": packed.attention_mask, SCORED_INPUT: packed.scored_positions, **extra}
        for name, array in inputs.items():
            bind_array(binding, name, array)
        logits = np.empty((*packed.scored_positions.shape, self.logits_width), np.float32)
        bind_array(binding, "logits", logits, output=True)
        hidden = None
        if self.hidden_width:
            hidden = np.empty((packed.batch, packed.input_ids.shape[1], self.hidden_width), np.float32)
            bind_array(binding, self.hidden_output, hidden, output=True)
        session.run_with_iobinding(binding)
        return logits, hidden

    def _binding(self, session: ort.InferenceSession, first_slot: int, batch: int) -> ort.IOBinding:
        """The session's binding for these KV slots, its caches bound once: past and present
        are the same rows of the pool, whatever the step, so only the step's inputs and
        outputs are bound per forward (binding 4 per layer every forward had cost a fifth
        of the forward's host time on the tiny pair, 120 bindings a step on a 30-layer
        model). One set per thread, as a binding is not for two forwards at once."""
        bindings = getattr(self._running, "bindings", None)
        if bindings is None:
            bindings = self._running.bindings = {}
        key = (id(session), first_slot, batch)
        if key not in bindings:
            bindings[key] = binding = session.io_binding()
            rows = slice(first_slot, first_slot + batch)
            for layer in range(self.layers):
                for index, kind in enumerate(("key", "value")):
                    view = self.pool.buffer[layer, index, rows]  # past and present: one memory
                    bind_array(binding, f"past_{kind}.{layer}", view)
                    bind_array(binding, f"present_{kind}.{layer}", view, output=True)
        return bindings[key]

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        """One batched forward over every round's `[last, d_1..d_K]`, then the FusedVerify
        graph on each round's logits rows: only the outcomes leave the engine."""
        if "fused_verify" not in self.sessions:
            raise ValueError(f"{self.info.path}: this is a draft engine; it has no fused_verify graph")
        for item in steps:
            k = len(item.draft_tokens)
            if k > self.limits.max_draft_tokens:
                raise ValueError(f"K={k} draft tokens exceeds the engines' max_draft_tokens "
                                 f"{self.limits.max_draft_tokens}; rebuild with a larger --max-draft-tokens")
            if len(item.step.tokens) != k + 1 or len(item.uniforms) != k + 1:
                raise ValueError(f"verify takes K+1 = {k + 1} tokens ([last, d_1..d_K]) and uniforms, "
                                 f"got {len(item.step.tokens)} and {len(item.uniforms)}")
        packed, scores, hidden = self._forward([item.step for item in steps])
        logits = None  # the scores as a tensor, made once a round needs the FusedVerify graph
        results = []
        for index, item in enumerate(steps):
            row = packed.rows[index]
            if self.scored_tokens is None and takes_the_argmax(item):
                # one greedy autoregressive step: its token is the row's argmax (the first
                # maximum, as the graph's greedy branch takes it) and its features the row's,
                # read from the graph's arrays themselves. Each torch call releases the GIL
                # and waits to take it back: in the server, beside the threads that send
                # responses, the per-row tensors had cost the scheduler more than the forward.
                results.append(VerifyResult(0, int(scores[row, 0].argmax()),
                                            hidden=None if hidden is None else hidden[row, :1]))
                continue
            logits = self.spread(torch.from_numpy(scores)) if logits is None else logits
            rows = self._row(packed, index, logits, hidden)
            results.append(self._fused_verify(rows.logits, rows.hidden, item))
        return results

    def _fused_verify(self, logits: torch.Tensor, hidden: torch.Tensor | None, item: VerifyStep) -> VerifyResult:
        k, sampling = len(item.draft_tokens), item.sampling
        if k == 0 and sampling.greedy:
            # Nothing to verify: the token is the argmax, without a session run per sequence
            # (at 16 streams of autoregressive decoding those had cost a sixth of the round).
            return verify_result(0, int(np.argmax(logits[0].numpy())), logits, item, hidden)
        probs = self._no_draft_probs[:k] if item.draft_probs is None else item.draft_probs.float().numpy()
        feeds = {"target_logits": logits.numpy(), "draft_tokens": item.draft_tokens.numpy().astype(np.int64),
                 "draft_probs": np.ascontiguousarray(probs), "uniforms": item.uniforms.float().numpy(),
                 "temperature": np.array(sampling.temperature, np.float32),
                 "top_k": np.array(sampling.top_k, np.int64), "top_p": np.array(sampling.top_p, np.float32)}
        accepted, bonus = self.sessions["fused_verify"].run(None, feeds)
        return verify_result(int(accepted), int(bonus), logits, item, hidden)

    def plan_branches(self, scores, draft_tokens, fanout, context_length: int) -> BranchPlan:
        if "branch_draft" not in self.sessions:
            raise ValueError(f"{self.info.path}: this is a target engine; it has no branch_draft graph")
        branches = int(torch.as_tensor(fanout).sum())
        if branches > self.limits.max_branches:
            raise ValueError(f"fan-out of {branches} branches exceeds the engines' max_branches "
                             f"{self.limits.max_branches}; rebuild with a larger --max-branches")
        feeds = {"scores": scores.float().numpy(), "draft_tokens": np.asarray(draft_tokens, dtype=np.int64),
                 "fanout": np.asarray(fanout, dtype=np.int64), "context_length": np.array(context_length, np.int64)}
        depth, token, rank, positions, window_mask = self.sessions["branch_draft"].run(None, feeds)
        return BranchPlan(*(torch.from_numpy(a) for a in (depth, token, rank, positions, window_mask)))


class OnnxRuntimeFeatureDraft(OnnxRuntimeEngine):
    """A feature draft (an EAGLE-3 head, `compiler.feature_export`): the head's one-layer
    model graph, fed beside each token the feature of the position before it (`Step.hidden`;
    zeros when a step brings none, as calibration forwards do), its rows carrying its own
    predicted features; `project` turns the target's features into such inputs."""

    hidden_output = "hidden_out"

    def __init__(self, sessions: dict[str, ort.InferenceSession], info: EngineInfo, tokenizer, shape: dict,
                 slot_capacity: int):
        super().__init__(sessions, info, tokenizer, {**shape, "num_layers": 1}, slot_capacity)
        self.hidden_size = shape["hidden_size"]  # of the features it reads

    def extra_inputs(self, steps: Sequence[Step], packed: PackedBatch) -> dict[str, np.ndarray]:
        hidden = np.zeros((packed.batch, packed.input_ids.shape[1], self.hidden_size), np.float32)
        for step, row, count in zip(steps, packed.rows, packed.counts):
            if step.hidden is not None:
                hidden[row, :count] = step.hidden.float().numpy()
        return {"hidden": hidden}

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features `[n, feature_width]` as the head reads them `[n, hidden]`."""
        (projected,) = self.sessions["project"].run(None, {"features": np.ascontiguousarray(features.float().numpy())})
        return torch.from_numpy(projected)

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        raise TypeError("a feature draft drafts for its target; it does not verify")


def slot_capacity(role: str, manifest: dict) -> int:
    build = manifest["build"]
    if role == "draft":
        return draft_cache_capacity(build["max_context"], build["max_branches"], build["max_draft_tokens"])
    return target_cache_capacity(build["max_context"], build["max_draft_tokens"])


def open_engine(engine_dir: Path, role: str, manifest: dict, tokenizer, threads: int | None = None,
                settings: SessionSettings | None = None):
    """The `role` ("target" or "draft") engine of a validated engine directory, with the
    build's session settings (`threads` overrides their thread count) or with `settings`."""
    model = manifest["models"][role]
    settings = settings or SessionSettings.from_manifest(manifest, threads)
    sessions = {kind: open_session(engine_dir / files["engine"], settings)
                for kind, files in model["graphs"].items()}
    wide = alone_settings(settings)
    model_path = engine_dir / model["graphs"]["model"]["engine"]
    open_alone = None if wide is None else (lambda: open_session(model_path, wide))
    info = replace(engine_info("onnxruntime", engine_dir, role, manifest), pads_rows=True)  # `pack_steps`
    if is_feature_draft(model):
        return OnnxRuntimeFeatureDraft(sessions, info, tokenizer, model["shape"], slot_capacity(role, manifest))
    return OnnxRuntimeEngine(sessions, info, tokenizer, model["shape"], slot_capacity(role, manifest), open_alone)
