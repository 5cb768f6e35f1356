"""The TensorRT engine's contracts with TensorRT and CUDA, checked on CPU with stand-ins.

`TensorRTGraph.run` must order the engine's private stream after the caller's stream
(which copied the inputs, zeroed the outputs, truncated or gathered the cache) and the
caller's after the engine's; bind only 256-byte aligned addresses; and never bind a null
pointer (torch gives empty tensors one; K = 0 drafts and B = 0 branches make them).
Here the context and the streams are recorders and the tensors plain descriptions.
"""
from unittest import mock

import pytest
import torch

from saguaro.runtime.engines import tensorrt_engine
from saguaro.runtime.engines.tensorrt_engine import TensorRTGraph, binding_address
from saguaro.runtime.kv_cache import VIEW_ALIGNMENT_BYTES, SlotKVCache


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
