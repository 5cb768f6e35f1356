"""The TensorRT engine's contracts with TensorRT and CUDA, checked on CPU with stand-ins.

`TensorRTGraph.run` must order the engine's private stream after the caller's stream
(which copied the inputs, zeroed the outputs, truncated or gathered the cache) and the
caller's after the engine's; bind only 256-byte aligned addresses; and never bind a null
pointer (torch gives empty tensors one; K = 0 drafts and B = 0 branches make them).
Here the context and the streams are recorders and the tensors plain descriptions; and
the verify engine's arguments (the request's sampling, the draft's q) are checked against
a CPU stand-in graph that runs the reference op on what it is bound.
"""
from unittest import mock

import pytest
import torch
from fake_tensorrt import fake_tensorrt

from saguaro.plugins.fused_verify.reference import fused_verify
from saguaro.runtime.core.contracts import EngineInfo, EngineLimits, Step
from saguaro.runtime.core.sampling import SamplingParams, pick_tokens, verification_uniforms
from saguaro.runtime.engines import tensorrt_engine
from saguaro.runtime.engines.kv_cache import VIEW_ALIGNMENT_BYTES, SlotKVCache
from saguaro.runtime.engines.tensorrt_engine import TensorRTEngine, TensorRTGraph, binding_address


class Log(list):
    def note(self, *event):
        self.append(event)


class FakeStream:
    def __init__(self, name: str, log: Log):
        self.name, self.log, self.cuda_stream = name, log, hash(name) & 0xFFFF

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.note("wait", self.name, other.name)

    def synchronize(self) -> None:
        self.log.note("synchronize", self.name)


class FakeTensor:
    """What `run` reads of a tensor: shape, element count, address, `record_stream`."""

    def __init__(self, name: str, shape: tuple, address: int, log: Log):
        self.name, self.shape, self.address, self.log = name, shape, address, log

    def numel(self) -> int:
        return int(torch.tensor(self.shape).prod()) if self.shape else 1

    def data_ptr(self) -> int:
        return 0 if self.numel() == 0 else self.address  # torch: an empty tensor has no storage

    def record_stream(self, stream: FakeStream) -> None:
        self.log.note("record", self.name, stream.name)


class FakeContext:
    def __init__(self, log: Log):
        self.log = log

    def set_input_shape(self, name, shape):
        self.log.note("shape", name, shape)
        return True

    def set_tensor_address(self, name, address):
        self.log.note("address", name, address)
        return True

    def set_output_allocator(self, name, allocator):
        self.log.note("allocator", name)
        return True

    def execute_async_v3(self, stream_handle):
        self.log.note("execute", stream_handle)
        return True


class FakeEngine:
    num_io_tensors = 0

    def __init__(self, log: Log):
        self.log = log

    def create_execution_context(self):
        return FakeContext(self.log)


@pytest.fixture
def graph_and_log():
    log = Log()
    engine_stream, empty = FakeStream("engine", log), FakeTensor("empty", (256,), 0x7F0000, log)
    graph = TensorRTGraph(mock.MagicMock(name="tensorrt"), FakeEngine(log), engine_stream, empty)
    caller = FakeStream("caller", log)
    with mock.patch.object(torch.cuda, "current_stream", return_value=caller):
        yield graph, log, engine_stream


def test_the_engine_stream_runs_between_the_callers_work_before_and_after(graph_and_log):
    graph, log, engine_stream = graph_and_log
    inputs = {"input_ids": FakeTensor("input_ids", (1, 5), 0x10000, log),
              "past_keys": FakeTensor("past_keys", (1, 1, 3, 7, 16), 0x20000, log)}
    outputs = {"present_keys": FakeTensor("present_keys", (1, 1, 3, 12, 16), 0x30000, log)}
    graph.run(inputs, outputs)
    kinds = [event[0] for event in log]
    execute = kinds.index("execute")
    assert log[execute] == ("execute", engine_stream.cuda_stream)
    assert ("wait", "engine", "caller") in log[:execute]  # inputs, cache copies, zeroing first
    assert kinds.index("address") < execute and kinds.index("shape") < execute
    after = log[execute + 1:]
    assert after[-1] == ("wait", "caller", "engine")  # whatever the caller does next waits
    recorded = {event[1] for event in after if event[0] == "record"}
    assert recorded == {"input_ids", "past_keys", "present_keys"}
    assert all(event[2] == "engine" for event in after if event[0] == "record")
    assert "synchronize" not in kinds  # no host sync without data-dependent outputs


def test_data_dependent_outputs_are_read_after_the_engine_stream_synchronizes(graph_and_log):
    graph, log, _ = graph_and_log
    graph.run({"fanout": FakeTensor("fanout", (5,), 0x10000, log)}, {}, {"depth": object()})
    kinds = [event[0] for event in log]
    assert kinds.index("allocator") < kinds.index("execute") < kinds.index("synchronize")
    assert log[kinds.index("synchronize")] == ("synchronize", "engine")


@pytest.mark.parametrize("name, shape", [("draft_tokens", (0,)), ("draft_probs", (0, 512)),
                                         ("fanout", (0,))])
def test_empty_tensors_are_bound_to_a_real_aligned_allocation(graph_and_log, name, shape):
    """K = 0 (or B = 0) gives torch tensors with a null pointer; TensorRT needs a real one."""
    graph, log, _ = graph_and_log
    graph.run({name: FakeTensor(name, shape, 0x10000, log)}, {"accepted": FakeTensor("accepted", (), 0x20000, log)})
    addresses = {event[1]: event[2] for event in log if event[0] == "address"}
    assert addresses[name] == 0x7F0000 and addresses[name] % VIEW_ALIGNMENT_BYTES == 0
    assert addresses["accepted"] == 0x20000
    assert 0 not in addresses.values()


def test_a_misaligned_tensor_is_refused_naming_it(graph_and_log):
    graph, log, _ = graph_and_log
    with pytest.raises(ValueError, match="'past_values'.*256-byte aligned"):
        graph.run({"past_values": FakeTensor("past_values", (1, 1, 3, 4, 16), 0x10000 + 192, log)}, {})
    assert not [event for event in log if event[0] == "execute"]


def test_a_refused_address_is_an_error(graph_and_log):
    graph, log, _ = graph_and_log
    graph.context.set_tensor_address = lambda name, address: False
    with pytest.raises(RuntimeError, match="refused the address of tensor 'logits'"):
        graph.run({}, {"logits": FakeTensor("logits", (1, 2, 3), 0x40000, log)})


def test_binding_address_of_real_tensors():
    empty = torch.empty(VIEW_ALIGNMENT_BYTES, dtype=torch.uint8)
    assert binding_address("x", torch.empty(0, dtype=torch.int64), empty) == empty.data_ptr()
    base = torch.zeros(1024)
    aligned = base[64:]  # 256 bytes in
    if base.data_ptr() % VIEW_ALIGNMENT_BYTES == 0:
        assert binding_address("x", aligned, empty) == aligned.data_ptr()
    with pytest.raises(ValueError, match="aligned"):
        binding_address("x", base[1:] if base.data_ptr() % VIEW_ALIGNMENT_BYTES == 0 else base, empty)


@pytest.mark.parametrize("dims, capacity", [((1, 3, 16), 265), ((2, 2, 8), 5), ((4, 8, 64), 1161), ((1, 1, 1), 1)])
def test_kv_cache_views_start_256_byte_aligned(dims, capacity):
    """The slot cache the TensorRT engine binds (the tiny draft's value cache used to start
    192 bytes off): every view of both slots, keys and values, after swaps and a fork."""
    cache = SlotKVCache(*dims, capacity)
    for twin in (cache, cache.fork()):
        base = twin._slots.data_ptr()
        for slot in (0, 1):
            for entries in (1, 2, capacity):  # an empty view binds to the engine's dummy allocation
                for view in twin.view(slot, entries):
                    assert (view.data_ptr() - base) % VIEW_ALIGNMENT_BYTES == 0
                    assert view.is_contiguous()


def test_output_allocator_gives_aligned_buffers_that_view_as_any_type():
    """Data-dependent outputs (the branch plan) may be empty (B = 0); the buffer must still
    be real, aligned, and viewable as int64."""
    trt = mock.MagicMock(name="tensorrt")
    trt.IOutputAllocator = type("IOutputAllocator", (), {"__init__": lambda self: None})
    allocator = tensorrt_engine.output_allocator(trt)
    with mock.patch.object(torch, "empty", wraps=lambda n, dtype, device: torch.zeros(n, dtype=dtype)):
        allocator.reallocate_output_async("depth", 0, 0, 8, 0)
        allocator.reallocate_output_async("positions", 0, 24, 8, 0)
    allocator.notify_shape("depth", (0,))
    allocator.notify_shape("positions", (3, 1))
    assert allocator.tensor("depth", torch.int64).shape == (0,)
    assert allocator.tensor("positions", torch.int64).shape == (3, 1)
    assert all(buffer.numel() % VIEW_ALIGNMENT_BYTES == 0 for buffer in allocator.buffers.values())


class ReferenceVerifyGraph:
    """The verify engine as TensorRT runs it, on the CPU: the model's logits (a fixed
    table looked up by input token), then FusedVerify (the reference op) on exactly the
    tensors bound to it. Keeps what it was bound."""

    def __init__(self, table: torch.Tensor):
        self.table, self.bound = table, []

    def run(self, inputs, outputs, allocators=None):
        self.bound.append({name: tensor.clone() for name, tensor in inputs.items() if not name.startswith("past")})
        accepted, bonus = fused_verify(self.table[inputs["input_ids"][0]], inputs["draft_tokens"],
                                       inputs["draft_probs"], inputs["uniforms"], float(inputs["temperature"]),
                                       int(inputs["top_k"]), float(inputs["top_p"]))
        outputs["accepted"].fill_(accepted)
        outputs["bonus"].fill_(bonus)


class Float32ForwardGraph:
    """The forward engine's tensor types as a float32 build reports them (the engine reads
    its cache and logits types off `forward`); this check runs only the verify engine."""

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32


class TableForwardGraph(Float32ForwardGraph):
    """The forward engine on the CPU: each input token's row of a fixed logits table."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def run(self, inputs, outputs, allocators=None):
        outputs["logits"][0] = self.table[inputs["input_ids"][0]]


def cpu_tensorrt_engine(vocab: int, graph, forward=None) -> TensorRTEngine:
    limits = EngineLimits(max_draft_tokens=8, max_branches=16, max_context=64, max_batch=1)
    info = EngineInfo(backend="tensorrt", path="stand-in", vocab_size=vocab, max_context=64, eos_token_ids=(),
                      bos_token_id=None, tokenizer_fingerprint="", limits=limits)
    shape = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "vocab_size": vocab}
    graphs = {"forward": forward or Float32ForwardGraph(), "verify": graph}
    return TensorRTEngine(fake_tensorrt(), graphs, info, None, shape, device="cpu")


def test_a_prefill_brings_only_its_last_row_of_logits_to_the_host():
    """A `last_only` step (a prefill: its first token is all it reads) returns the last
    row alone; any other step every row it fed."""
    vocab, table = 12, torch.randn(12, 12, generator=torch.Generator().manual_seed(3))
    engine = cpu_tensorrt_engine(vocab, ReferenceVerifyGraph(table), TableForwardGraph(table))
    tokens = torch.tensor([3, 7, 1, 5])
    prefill = engine.forward_rows([Step(engine.new_cache(32), tokens, torch.arange(4), last_only=True)])[0]
    assert torch.equal(prefill.logits, table[tokens[-1:]])
    every = engine.forward_rows([Step(engine.new_cache(32), tokens, torch.arange(4))])[0]
    assert torch.equal(every.logits, table[tokens])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=5, top_p=0.8, seed=1),
                                    SamplingParams(temperature=1.3, top_p=0.6, seed=2), SamplingParams()],
                         ids=["top-k and top-p", "top-p", "greedy"])
def test_the_verify_engine_is_bound_the_requests_sampling_and_the_drafts_q(params):
    """What the draft sampled from (filtered q, the request's T, top-k, top-p, its keyed
    uniforms) is what the TensorRT verify engine gets, and its outcome is the reference
    op's under those parameters (a verify bound top-k 0 / top-p 1 would judge a filtered
    q against an unfiltered p)."""
    vocab, k = 12, 4
    generator = torch.Generator().manual_seed(0)
    graph = ReferenceVerifyGraph(torch.randn(vocab, vocab, generator=generator) * 2)
    engine = cpu_tensorrt_engine(vocab, graph)
    for trial in range(20):
        draft_logits = torch.randn(k, vocab, generator=generator) * 2
        positions = torch.arange(10, 10 + k)
        drafts, q = pick_tokens(draft_logits, params.with_seed(), None, positions + trial)
        tokens = torch.cat((torch.tensor([trial % vocab]), drafts))
        uniforms = verification_uniforms(params.with_seed(), positions + trial, first_new=10 + trial)
        cache = engine.new_cache(32)
        cache.length = 9
        outcome = engine.verify(cache, tokens, torch.arange(9, 9 + k + 1), drafts, q, uniforms, params)
        bound = graph.bound[-1]
        assert float(bound["temperature"]) == float(torch.tensor(params.temperature, dtype=torch.float32))
        assert int(bound["top_k"]) == params.top_k
        assert float(bound["top_p"]) == float(torch.tensor(params.top_p, dtype=torch.float32))
        assert torch.equal(bound["draft_tokens"], drafts) and torch.equal(bound["uniforms"], uniforms)
        assert torch.equal(bound["draft_probs"], torch.zeros(k, vocab) if q is None else q)
        expected = fused_verify(graph.table[tokens], drafts, q, uniforms, params.temperature, params.top_k,
                                params.top_p)
        assert (outcome.accepted, outcome.bonus) == tuple(int(x) for x in expected)
        assert cache.length == 9 + k + 1
