"""The `Engine` protocol over TensorRT engines (GPU), built by `scripts/build_engines.py`.

Written against the documented TensorRT Python API, 10.8 to 11.x (`IExecutionContext`
with named tensors: `set_input_shape`, `set_tensor_address`, `execute_async_v3`;
`IOutputAllocator` for the data-dependent outputs of BranchDraft). TensorRT is imported
only when an engine opens; without it the error says how to install it.

The KV cache is `kv_cache.SlotKVCache` on the GPU: two device slots, the live
cache a contiguous prefix view bound as the past input, present written straight into
the other slot. Commit (gather) and truncation copy between slots with torch on the
device; the engines themselves never see a host copy of the cache. Logits and branch
plans come back to the host (the decoding loops run there); verify returns two ints.

Streams: each graph runs on a stream of its own (TensorRT warns against enqueueing on
the default stream), but everything around it (inputs copied to the device, output
buffers zeroed, the cache truncated or gathered) runs on the caller's current stream.
`TensorRTGraph.run` orders the two: the engine's stream waits for the caller's before
the enqueue, the caller's waits for the engine's after it, and every bound tensor is
recorded on the engine's stream so the caching allocator cannot reuse it early.

Addresses: `setTensorAddress` needs 256-byte aligned pointers (the cache's views are,
see `kv_cache.VIEW_ALIGNMENT_BYTES`; a misaligned one fails naming the tensor) and a
non-null one for every input except empty ones, which torch gives a null pointer; an
empty tensor (K = 0 drafts, B = 0 branches) is bound to a small real allocation instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence, cast

import torch

from saguaro.plugins.branch_draft.onnx_function import PLAN_OUTPUTS
from saguaro.plugins.branch_draft.reference import BranchPlan
from saguaro.plugins.tensorrt_plugins import register_plugins
from saguaro.plugins.tensorrt_registry import import_tensorrt
from saguaro.runtime.core.contracts import EngineInfo, OneSequenceForms, Step, VerifyResult, VerifyStep, causal_mask
from saguaro.runtime.engines.manifest import engine_info
from saguaro.runtime.core.logprobs import verify_result
from saguaro.runtime.engines.kv_cache import VIEW_ALIGNMENT_BYTES, SlotKVCache, aligned_length


def torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.int8: torch.int8, trt.bool: torch.bool}
    return table[dtype]


def binding_address(name: str, tensor: torch.Tensor, empty: torch.Tensor) -> int:
    """Where to bind `tensor`: its data, 256-byte aligned, or for an empty tensor (whose
    torch pointer is null) the `empty` allocation."""
    if tensor.numel() == 0:
        return empty.data_ptr()
    address = tensor.data_ptr()
    if address % VIEW_ALIGNMENT_BYTES:
        raise ValueError(f"tensor {name!r} starts at {address:#x}, not {VIEW_ALIGNMENT_BYTES}-byte aligned "
                         "as TensorRT's setTensorAddress requires")
    return address


class TensorRTGraph:
    """One deserialized engine with its execution context, its stream and the allocation
    that empty tensors are bound to."""

    def __init__(self, trt, engine, stream, empty: torch.Tensor):
        self.trt, self.engine, self.stream, self.empty = trt, engine, stream, empty
        self.context = engine.create_execution_context()
        self.names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]

    @classmethod
    def load(cls, trt, runtime, plan: Path) -> "TensorRTGraph":
        engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {plan} (built by another TensorRT version?)")
        empty = torch.empty(VIEW_ALIGNMENT_BYTES, dtype=torch.uint8, device="cuda")
        return cls(trt, engine, torch.cuda.Stream(), empty)

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self.trt, self.engine.get_tensor_dtype(name))

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, binding_address(name, tensor, self.empty)):
            raise RuntimeError(f"TensorRT refused the address of tensor {name!r} (see its log)")

    def run(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
            allocators: dict | None = None) -> None:
        """Enqueue on the graph's stream, after the caller's stream's work and before its next."""
        for name, tensor in inputs.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self._bind(name, tensor)
        for name, tensor in outputs.items():
            self._bind(name, tensor)
        for name, allocator in (allocators or {}).items():
            self.context.set_output_allocator(name, allocator)
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)  # inputs, zeroed outputs and cache copies are queued there
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed (see its log)")
        for tensor in (*inputs.values(), *outputs.values()):
            tensor.record_stream(self.stream)
        caller.wait_stream(self.stream)  # reading outputs or the cache comes after the engine
        if allocators:
            self.stream.synchronize()  # data-dependent output shapes are known once it has run

    def output_shape(self, name: str) -> tuple[int, ...]:
        """After the inputs' shapes are set: an output's shape (-1 where data-dependent)."""
        return tuple(self.context.get_tensor_shape(name))


def output_allocator(trt):
    """An `IOutputAllocator` that keeps each data-dependent output in a torch buffer, at
    least 256 bytes and 256-byte aligned, so that an empty output gets real memory too and
    the buffer views as any element type."""

    class Allocator(trt.IOutputAllocator):
        def __init__(self):
            trt.IOutputAllocator.__init__(self)
            self.buffers, self.shapes = {}, {}

        def reallocate_output(self, tensor_name, memory, size, alignment):
            nbytes = aligned_length(max(size, 1), 1, max(alignment, VIEW_ALIGNMENT_BYTES))
            self.buffers[tensor_name] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            return self.buffers[tensor_name].data_ptr()

        def reallocate_output_async(self, tensor_name, memory, size, alignment, stream):
            return self.reallocate_output(tensor_name, memory, size, alignment)  # TensorRT >= 10

        def notify_shape(self, tensor_name, shape):
            self.shapes[tensor_name] = tuple(shape)

        def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
            shape = self.shapes[name]
            count = int(torch.tensor(shape).prod()) if shape else 1
            return self.buffers[name].view(dtype)[:count].view(shape)

    return Allocator()


def _device(tensor, dtype, device: str = "cuda") -> torch.Tensor:
    return torch.as_tensor(tensor).to(device=device, dtype=dtype).contiguous()


class TensorRTEngine(OneSequenceForms):
    """One model's TensorRT engines (`forward`, and `verify` or `branch_draft`). They run
    one sequence per call (batch 1): a batch of steps runs one after another. `device` is
    where its tensors live: the GPU, or the CPU for a check with stand-in graphs."""

    def __init__(self, trt, graphs: dict[str, TensorRTGraph], info: EngineInfo, tokenizer, shape: dict,
                 device: str = "cuda"):
        assert info.limits is not None  # a compiled engine's, from its manifest's build
        self.trt, self.graphs, self.info, self.tokenizer, self.limits = trt, graphs, info, tokenizer, info.limits
        self.device = device
        self.kv_dims = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"])
        self.vocab_size = shape["vocab_size"]
        # the engines' own types: the cache is in the precision built, logits are float32
        forward = graphs["forward"]
        self.cache_dtype, self.logits_dtype = forward.dtype("past_keys"), forward.dtype("logits")

    def new_cache(self, capacity: int) -> SlotKVCache:
        """Commits gather with torch on the device (no GatherKV engine: see the plugin's notes)."""
        if capacity > self.limits.max_cache_entries:
            raise ValueError(f"cache capacity {capacity} exceeds the engines' {self.limits.max_cache_entries} entries")
        return SlotKVCache(*self.kv_dims, capacity, device=self.device, dtype=self.cache_dtype)

    def _step_io(self, cache, tokens, positions, mask):
        past, count = cache.length, len(tokens)
        if past + count > cache.capacity:
            raise ValueError(f"KV cache overflow: {past} + {count} entries > capacity {cache.capacity}")
        mask = causal_mask(past, count) if mask is None else mask
        inputs = {"input_ids": _device(tokens, torch.int64, self.device)[None],
                  "position_ids": _device(positions, torch.int64, self.device)[None],
                  "attention_mask": _device(mask, torch.bool, self.device)[None]}
        inputs.update(zip(("past_keys", "past_values"), cache.live()))
        outputs = dict(zip(("present_keys", "present_values"), cache.spare(past + count)))
        outputs["logits"] = torch.empty(1, count, self.vocab_size, device=self.device, dtype=self.logits_dtype)
        return inputs, outputs, past + count

    def forward_batch(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        return [self._forward_one(step) for step in steps]

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        return [self._verify_one(item) for item in steps]

    def _forward_one(self, step: Step) -> torch.Tensor:
        """The step's logits on the host: of its last row only for a `last_only` step (a
        prefill, whose first token is all it reads: a long prompt's rows over a large
        vocabulary would be hundreds of megabytes through the bus)."""
        cache = cast(SlotKVCache, step.cache)  # one of this engine's (`new_cache`)
        inputs, outputs, length = self._step_io(cache, step.tokens, step.positions, step.mask)
        self.graphs["forward"].run(inputs, outputs)
        cache.swap(length)
        logits = outputs["logits"][0]
        return (logits[-1:] if step.last_only else logits).float().cpu()

    def _verify_one(self, item: VerifyStep) -> VerifyResult:
        cache, tokens, positions = cast(SlotKVCache, item.step.cache), item.step.tokens, item.step.positions
        draft_tokens, draft_probs, uniforms, sampling = item.draft_tokens, item.draft_probs, item.uniforms, item.sampling
        k = len(draft_tokens)
        if k > self.limits.max_draft_tokens:
            raise ValueError(f"K={k} draft tokens exceeds the engines' max_draft_tokens {self.limits.max_draft_tokens}")
        inputs, outputs, length = self._step_io(cache, tokens, positions, None)
        probs = torch.zeros(k, self.vocab_size) if draft_probs is None else draft_probs
        on_device = dict(draft_tokens=(draft_tokens, torch.int64), draft_probs=(probs, torch.float32),
                         uniforms=(uniforms, torch.float32), temperature=(sampling.temperature, torch.float32),
                         top_k=(sampling.top_k, torch.int64), top_p=(sampling.top_p, torch.float32))
        inputs.update({name: _device(value, dtype, self.device) for name, (value, dtype) in on_device.items()})
        outputs.update(accepted=torch.zeros((), dtype=torch.int64, device=self.device),
                       bonus=torch.zeros((), dtype=torch.int64, device=self.device))
        self.graphs["verify"].run(inputs, outputs)  # `logits` stays on the device (debug output)
        cache.swap(length)
        return verify_result(int(outputs["accepted"]), int(outputs["bonus"]), outputs["logits"][0], item)

    def plan_branches(self, scores, draft_tokens, fanout, context_length: int) -> BranchPlan:
        branches = int(torch.as_tensor(fanout).sum())
        if branches > self.limits.max_branches:
            raise ValueError(f"fan-out of {branches} branches exceeds the engines' "
                             f"max_branches {self.limits.max_branches}")
        graph = self.graphs["branch_draft"]
        on_device = dict(scores=(scores, torch.float32), draft_tokens=(draft_tokens, torch.int64),
                         fanout=(fanout, torch.int64), context_length=(context_length, torch.int64))
        inputs = {name: _device(value, dtype, self.device) for name, (value, dtype) in on_device.items()}
        allocator = output_allocator(self.trt)
        graph.run(inputs, {}, {name: allocator for name in PLAN_OUTPUTS})
        return BranchPlan(*(allocator.tensor(name, graph.dtype(name)).cpu() for name in PLAN_OUTPUTS))


def open_engine(engine_dir: Path, role: str, manifest: dict, tokenizer, threads: int | None = None):
    """The `role` engine of a validated engine directory (`threads` is for CPU backends)."""
    trt = import_tensorrt()
    if not torch.cuda.is_available():
        raise RuntimeError("the tensorrt backend needs a CUDA GPU; none is visible to torch")
    register_plugins()  # the parser mapped plugin nodes to these; deserialization needs them
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    model = manifest["models"][role]
    graphs = {kind: TensorRTGraph.load(trt, runtime, engine_dir / files["engine"])
              for kind, files in model["graphs"].items() if files.get("engine")}
    return TensorRTEngine(trt, graphs, engine_info("tensorrt", engine_dir, role, manifest), tokenizer,
                          model["shape"])
