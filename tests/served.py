"""Helpers for the tests against a real Triton server (test_server*.py): the runtime's own
output to compare with, raw gRPC inputs, and the server's metrics."""
from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.serving.served_metrics import metric, scrape

__all__ = ["metric", "metrics", "one", "raw", "reference"]


def reference(pipeline, prompt: str, max_tokens: int, mode: str = "ssd", end_id: int | None = None,
              sampling: SamplingParams = SamplingParams(), **options):
    """The runtime's generation for a request, and its rounds' tokens."""
    chunks = []
    options = DecodeOptions(mode=mode, max_tokens=max_tokens, eos_token_id=end_id, **options)
    generation = pipeline.generate(pipeline.encode(prompt), options, sampling, on_tokens=chunks.append)
    return generation, chunks


def raw(*named_arrays) -> list[grpcclient.InferInput]:
    """gRPC inputs exactly as given: (name, array, Triton datatype) each."""
    inputs = []
    for name, array, datatype in named_arrays:
        infer_input = grpcclient.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def one(name: str, value, datatype: str):
    """A raw `[1, 1]` input."""
    dtype = {"BYTES": object, "BOOL": bool, "FP16": np.float16, "FP32": np.float32, "INT32": np.int32,
             "UINT64": np.uint64}[datatype]
    return name, np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype), datatype


def metrics(port: int) -> str:
    return scrape(port)
