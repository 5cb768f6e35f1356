"""The `ssd` model called directly over gRPC streaming (asyncio), one stream per request.

The HTTP front end's way to the engines: it sends token ids (it renders and tokenizes the
prompt itself) and reads each decoding round's ids, their log-probabilities and the
request's running SSD figures, skipping the pre/postprocessing models. Leaving the
`async for` early (a stop string, a client that went away) cancels the gRPC call, which
Triton reports to the model as a cancelled request: the generation stops at its next
round and frees its KV slot.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncGenerator

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import np_to_triton_dtype

from saguaro.serving.lifecycle import ServerDraining
from saguaro.serving.openai_protocol import ApiError, GenerationParams

MODEL = "ssd"
OUTPUTS = ("output_ids", "finish_reason", "output_log_probs", "accepted_histogram", "cache_hits", "cache_misses",
           "tokens_per_s", "sampling_seed", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
# How the ssd model words refusals that mean "not now" rather than "not this request".
UNAVAILABLE = (str(ServerDraining()), "requests waiting already")


@dataclass
class Round:
    """One response of the model: a round's tokens, or the final figures."""

    ids: list[int]
    logprobs: list[float]
    figures: dict = field(default_factory=dict)  # running SSD figures (every response)
    finish_reason: str | None = None            # set on the final response only


def ssd_inputs(params: GenerationParams) -> dict[str, np.ndarray]:
    """The model's inputs for a checked request, always streamed (rounds as they commit)."""
    arrays = {"input_ids": np.array([params.prompt_ids], np.int32),
              "max_tokens": np.array([[params.max_tokens]], np.int32),
              "stream": np.array([[True]]),
              "temperature": np.array([[params.temperature]], np.float32),
              "top_p": np.array([[params.top_p]], np.float32),
              "top_k": np.array([[params.top_k]], np.int32),
              "return_perf_metrics": np.array([[True]]),
              "return_log_probs": np.array([[params.logprobs]])}
    if params.seed is not None:
        arrays["seed"] = np.array([[params.seed]], np.uint64)
    if params.ignore_eos:
        arrays["end_id"] = np.array([[-1]], np.int32)
    if "decoding_mode" in params.knobs:
        arrays["decoding_mode"] = np.array([[params.knobs["decoding_mode"].encode()]], object)
    if "num_draft_tokens" in params.knobs:
        arrays["num_draft_tokens"] = np.array([[params.knobs["num_draft_tokens"]]], np.int32)
    return arrays


def infer_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        infer_input = grpcclient.InferInput(name, list(array.shape),
                                            "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype))
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def values(result, name: str) -> list:
    array = result.as_numpy(name)
    return [] if array is None else array.reshape(-1).tolist()


def first_value(result, name: str):
    found = values(result, name)
    if not found:
        return None
    return found[0].decode() if isinstance(found[0], bytes) else found[0]


def read_round(result) -> Round:
    figures = {name: first_value(result, name) for name in (
        "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "cache_hits", "cache_misses",
        "tokens_per_s", "sampling_seed")}
    figures["accepted_histogram"] = values(result, "accepted_histogram")
    return Round(values(result, "output_ids"), values(result, "output_log_probs"),
                 {name: value for name, value in figures.items() if value not in (None, [])},
                 first_value(result, "finish_reason"))


def api_error(message: str) -> ApiError:
    """A refusal from the model as the HTTP status a client expects."""
    if any(marker in message for marker in UNAVAILABLE):
        return ApiError(503, message, kind="server_error", code="service_unavailable")
    if "generation failed" in message:
        return ApiError(500, message, kind="server_error")
    return ApiError(400, message)


class SsdStream:
    """One gRPC channel to the server, made in the event loop that uses it."""

    def __init__(self, url: str):
        self.url = url
        self._client: grpcaio.InferenceServerClient | None = None

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def rounds(self, params: GenerationParams) -> AsyncGenerator[Round, None]:
        """The request's responses up to its final one; ApiError if the model refuses it."""
        done = asyncio.Event()
        request = {"model_name": MODEL, "inputs": infer_inputs(ssd_inputs(params)),
                   "outputs": [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]}

        async def requests():
            yield request
            await done.wait()  # keep our side of the stream open until the final response

        call = self.client.stream_infer(requests())
        ended = False  # the final response came: the call is closed from both ends, not cancelled
        try:
            async for result, error in call:
                if error is not None:
                    raise api_error(str(error))
                answer = read_round(result)
                if answer.finish_reason is not None:
                    ended = True
                    break
                yield answer
        finally:
            done.set()  # our side of the stream closes
            if not ended:
                call.cancel()  # left early: Triton cancels the generation
        if ended:
            # The call ends once Triton has seen our side close. Cancelled instead just after
            # the final response, Triton sometimes kept the call's state, and with it the
            # model, which then never unloaded at shutdown (15 s, then "Exit timeout expired").
            async for _ in call:
                pass
            yield answer
