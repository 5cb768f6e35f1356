"""A stand-in for Triton's `triton_python_backend_utils`, and a loader for the models in
`model_repo/`, so the models' own logic is tested without a server (as tensorrtllm_backend's
unit tests do). It records what a model sends; it implements no Triton behaviour beyond
what the models call.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np

MODEL_REPO = Path(__file__).resolve().parents[1] / "model_repo"


class Tensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED = "INVALID_ARG", "INTERNAL", "UNAVAILABLE", "CANCELLED"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None):
        self.output_tensors, self.error_value = list(output_tensors or []), error

    def has_error(self) -> bool:
        return self.error_value is not None

    def error(self) -> TritonError | None:
        return self.error_value

    def outputs(self) -> dict[str, np.ndarray]:
        return {tensor.name(): tensor.as_numpy() for tensor in self.output_tensors}


class ResponseSender:
    """Records (response, flags) pairs; refuses anything after the final flag."""

    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.done = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            raise RuntimeError("a response was sent after the final one")
        self.sent.append((response, flags))
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()

    def responses(self) -> list[InferenceResponse]:
        return [response for response, _ in self.sent if response is not None]


class Request:
    """An inference request with named inputs, a sender, and a cancellation flag."""

    def __init__(self, inputs: dict[str, np.ndarray], cancelled: bool = False, requested: list[str] = ()):
        self.inputs = {name: Tensor(name, value) for name, value in inputs.items()}
        self.sender = ResponseSender()
        self.cancelled = cancelled
        self.requested = list(requested)  # as a direct client names them; empty: every output

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return self.requested

    def is_cancelled(self) -> bool:
        return self.cancelled


def get_input_tensor_by_name(request: Request, name: str) -> Tensor | None:
    return request.inputs.get(name)


class InferenceRequest:
    """A BLS request: `exec` hands it to the handler the test installed (`bls_handler`)."""

    def __init__(self, model_name: str, inputs: list[Tensor], requested_output_names: list[str]):
        self.model_name, self.inputs = model_name, {tensor.name(): tensor for tensor in inputs}
        self.requested_output_names = requested_output_names

    def exec(self, decoupled: bool = False):
        return module.bls_handler(self, decoupled)


class Logger:
    messages: list[tuple[str, str]] = []

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.messages.append(("error", message))

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.messages.append(("warn", message))

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.messages.append(("info", message))


class Metric:
    """Records values, and notices two threads inside one update at once (the stub does
    not serialise metric messages; Triton 2.51 crashed on concurrent updates)."""

    overlaps = 0  # class-wide: any two updates of any metric at the same time
    _busy = threading.Lock()
    update_seconds = 0.0  # widen each update so that unserialised calls overlap

    def __init__(self, labels: dict, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []
        self.updates = 0  # messages to the server

    def _update(self, change) -> None:
        self.updates += 1
        if not Metric._busy.acquire(blocking=False):
            Metric.overlaps += 1
            Metric._busy.acquire()
        try:
            time.sleep(Metric.update_seconds)
            change()
        finally:
            Metric._busy.release()

    def increment(self, value) -> None:
        self._update(lambda: setattr(self, "value", self.value + value))

    def observe(self, value) -> None:
        self._update(lambda: self.observed.append(value))

    def set(self, value) -> None:
        self._update(lambda: setattr(self, "value", value))


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []

    def Metric(self, labels: dict, buckets=None) -> Metric:  # noqa: N802 - Triton's spelling
        self.metrics.append(Metric(labels, buckets))
        return self.metrics[-1]


TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return model_config.get("model_transaction_policy", {}).get("decoupled", True)


def default_bls_handler(request: InferenceRequest, decoupled: bool):
    return iter([InferenceResponse()])


module = types.ModuleType("triton_python_backend_utils")
for _name, _value in dict(globals()).items():
    if not _name.startswith("_") and _name not in ("module", "annotations"):
        setattr(module, _name, _value)
module.bls_handler = default_bls_handler


def load_model(name: str) -> types.ModuleType:
    """`model_repo/<name>/1/model.py` imported against the stand-in."""
    sys.modules["triton_python_backend_utils"] = module
    spec = importlib.util.spec_from_file_location(f"triton_model_{name}", MODEL_REPO / name / "1" / "model.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def model_args(name: str, parameters: dict[str, str], decoupled: bool = True) -> dict:
    """The `args` Triton gives `initialize`, with `config.pbtxt` parameters."""
    config = {"name": name, "parameters": {key: {"string_value": value} for key, value in parameters.items()},
              "model_transaction_policy": {"decoupled": decoupled}}
    return {"model_config": json.dumps(config), "model_name": name, "model_version": "1"}
