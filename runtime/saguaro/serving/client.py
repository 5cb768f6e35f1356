"""Ask the served SSD ensemble for a completion over gRPC, streamed or in one piece.

    python scripts/client.py --url 127.0.0.1:8001 --prompt "The with statement" --max-tokens 48 --stream
    python scripts/client.py --url 127.0.0.1:8001 --prompt "x" --max-tokens 16 --decoding-mode speculative --json

The ensemble is decoupled (streaming), so both modes use gRPC's bidirectional stream:
with `stream` true the server answers once per decoding round and the text prints as it
arrives; with it false one response carries the whole completion. Either way the final
response carries the request's stats (accepted-length histogram, cache hits, tokens/s).
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from saguaro.runtime.arguments import flag_type
from saguaro.runtime.core.options import MODES, parse_fanout

MODEL = "ensemble"
# Optional ensemble inputs: name -> numpy dtype (the values' shape is [1, n]). Beyond
# these, the ensemble takes tensorrtllm_backend's other inputs (saguaro/serving/interface.py).
OPTIONAL_INPUTS = {"chat": bool, "temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.uint64,
                   "random_seed": np.uint64, "end_id": np.int32, "min_length": np.int32, "min_tokens": np.int32,
                   "exclude_input_in_output": bool, "stop_words": object, "bad_words": object,
                   "decoding_mode": object, "num_draft_tokens": np.int32, "fanout": np.int32, "budget": np.int32,
                   "saguaro_factor": np.float32}


class CompletionError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


@dataclass
class Completion:
    text: str = ""
    pieces: list[str] = field(default_factory=list)  # text_output of each response, in order
    finish_reason: str | None = None
    accepted_histogram: list[int] = field(default_factory=list)
    cache_hits: int | None = None
    cache_misses: int | None = None
    tokens_per_s: float | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    seed: int | None = None             # the sampling seed the server used (replayable)
    started_s: float = 0.0              # time.monotonic() when the request was sent
    response_times_s: list[float] = field(default_factory=list)  # since started_s

    def as_dict(self) -> dict:
        return asdict(self)


def infer_input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    """A gRPC input from an array (strings as an object array of bytes)."""
    infer_input = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object
                                        else np_to_triton_dtype(array.dtype))
    infer_input.set_data_from_numpy(array)
    return infer_input


def infer_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    return [infer_input(name, array) for name, array in arrays.items()]


def tensor(name: str, values, dtype) -> grpcclient.InferInput:
    """One `[1, n]` input: the batch dimension of one request, then the values."""
    return infer_input(name, np.array([[v.encode() if isinstance(v, str) else v for v in values]], dtype=dtype))


def ensemble_inputs(prompt: str, max_tokens: int, stream: bool, **optional) -> list[grpcclient.InferInput]:
    """The ensemble's inputs; optional ones left out (None) take the server's defaults."""
    inputs = [tensor("text_input", [prompt], object), tensor("max_tokens", [max_tokens], np.int32),
              tensor("stream", [stream], bool)]
    for name, value in optional.items():
        if value is None:
            continue
        if name not in OPTIONAL_INPUTS:
            raise TypeError(f"unknown ensemble input {name!r}")
        values = value if isinstance(value, (list, tuple)) else [value]
        inputs.append(tensor(name, values, OPTIONAL_INPUTS[name]))
    return inputs


def first(result, name: str):
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else value.item()


def absorb(completion: Completion, result) -> bool:
    """Add one response to the completion; True when it was the final one."""
    completion.response_times_s.append(time.monotonic() - completion.started_s)
    piece = first(result, "text_output")
    if piece is not None:
        completion.pieces.append(piece)
        completion.text += piece
    if first(result, "finish_reason") is not None:
        completion.finish_reason = first(result, "finish_reason")
        histogram = result.as_numpy("accepted_histogram")  # None when not asked for
        completion.accepted_histogram = [] if histogram is None else histogram.reshape(-1).tolist()
        completion.cache_hits = first(result, "cache_hits")
        completion.cache_misses = first(result, "cache_misses")
        completion.tokens_per_s = first(result, "tokens_per_s")
        completion.num_input_tokens = first(result, "num_input_tokens")
        completion.num_output_tokens = first(result, "num_output_tokens")
        completion.seed = first(result, "sampling_seed")
    return final_flag(result)


def final_flag(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def stream_responses(client: grpcclient.InferenceServerClient, model: str, inputs,
                     timeout_s: float = 120.0, outputs: tuple[str, ...] | None = None) -> Iterator:
    """Send one request on a fresh stream and yield its responses up to the final one;
    CompletionError if the server answers with an error or falls silent for `timeout_s`."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        try:
            requested = None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]
            client.async_stream_infer(model, inputs, outputs=requested, enable_empty_final_response=True)
        except InferenceServerException as broke:  # the stream broke at once (nothing listening): say why
            raise CompletionError(str(responses.get_nowait()[1] if not responses.empty() else broke)) from None
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise CompletionError(f"no response from '{model}' in {timeout_s:.0f} s") from None
            if error is not None:
                raise CompletionError(str(error))
            yield result
            if final_flag(result):
                return
    finally:
        client.stop_stream()


def complete(client: grpcclient.InferenceServerClient, inputs, on_text: Callable[[str], None] | None = None,
             timeout_s: float = 120.0, model: str = MODEL, outputs: tuple[str, ...] | None = None) -> Completion:
    """Send one request on a fresh stream and gather its responses until the final one
    (`outputs`: only these, e.g. from the `ssd` model called directly)."""
    completion = Completion(started_s=time.monotonic())
    for result in stream_responses(client, model, inputs, timeout_s, outputs):
        pieces_before = len(completion.pieces)
        absorb(completion, result)
        if on_text and len(completion.pieces) > pieces_before:
            on_text(completion.pieces[-1])
    return completion


def wait_until_ready(client: grpcclient.InferenceServerClient, timeout_s: float) -> None:
    """For scripts that start the server and the client together."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.is_server_ready() and client.is_model_ready(MODEL):
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if time.monotonic() > deadline:
            raise CompletionError(f"no ready server (waited {timeout_s:.0f} s): is scripts/serve.py running?")
        time.sleep(0.5)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="client.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC address")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--stream", action="store_true", help="print the text as each round arrives")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message, rendered with the model's chat template")
    parser.add_argument("--temperature", type=float, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--end-id", type=int, help="-1: never stop at an end token")
    parser.add_argument("--stop-words", nargs="+", help="stop after any of these texts")
    parser.add_argument("--decoding-mode", choices=MODES)
    parser.add_argument("--num-draft-tokens", type=int, help="K")
    parser.add_argument("--fanout", type=flag_type(parse_fanout), help="3 or 3,3,2,1,1")
    parser.add_argument("--budget", type=int, help="B branches placed online")
    parser.add_argument("--saguaro-factor", type=float)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.add_argument("--wait", type=float, default=0, metavar="S", help="wait up to S seconds for the server")
    return parser.parse_args(argv)


def print_summary(completion: Completion) -> None:
    histogram = completion.accepted_histogram
    rounds = sum(histogram)
    print(f"\n[finish: {completion.finish_reason}; {rounds} rounds; accepted-length histogram {histogram}; "
          f"cache hits {completion.cache_hits}, misses {completion.cache_misses}; "
          f"{completion.tokens_per_s or 0:.1f} tokens/s]", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    inputs = ensemble_inputs(args.prompt, args.max_tokens, args.stream, chat=args.chat or None,
                             temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, end_id=args.end_id,
                             stop_words=args.stop_words, decoding_mode=args.decoding_mode,
                             num_draft_tokens=args.num_draft_tokens, fanout=args.fanout, budget=args.budget,
                             saguaro_factor=args.saguaro_factor)
    show = None if args.json else (lambda text: print(text, end="", flush=True))
    try:
        with grpcclient.InferenceServerClient(args.url) as client:
            wait_until_ready(client, args.wait)
            if show:
                print(f"{args.prompt}\n" if args.chat else args.prompt, end="", flush=True)
            completion = complete(client, inputs, on_text=show)
    except CompletionError as error:
        print(f"\nerror: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"prompt": args.prompt, **completion.as_dict()}))
    else:
        print_summary(completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
