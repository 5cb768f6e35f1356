"""Triton `postprocessing`: one response's token ids to the text they add.

Stateless by design (saguaro/runtime/models/detokenizer.py): each response brings the tokens before
its own, so a character split across rounds is held back and printed once, whole.

Every output of the ensemble leaves from here (the request's figures pass through), so
that each client response is exactly one response of this model. Decoupled, so that it
can also send none: a heartbeat (a non-final response with no tokens, which the SSD model
sends each round of a non-streamed request) gets no response at all.

This step is also the one that learns of a client's cancellation: Triton cancels the
ensemble steps it schedules after the cancel, not the SSD step in flight. So a cancelled
request here is relayed to the SSD model (a BLS request with the generation's id), which
stops that generation at its next round (and ends it with a normal final response).
Heartbeats make this work for non-streamed requests too.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from saguaro.runtime.models.detokenizer import text_delta
from saguaro.serving.requests import TextCodec, model_parameters

import json

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# The request's figures, from the SSD model to the client unchanged (input -> output).
PASSED_THROUGH = {name.upper(): name for name in (
    "finish_reason", "accepted_histogram", "cache_hits", "cache_misses", "tokens_per_s",
    "num_input_tokens", "num_output_tokens", "sampling_seed", "batch_index", "sequence_index",
    "cum_log_probs", "output_log_probs", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
    "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")}


def array_of(request, name: str) -> np.ndarray:
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


def ids_of(request, name: str) -> list[int]:
    return array_of(request, name).reshape(-1).tolist()


def is_heartbeat(request) -> bool:
    return not bool(array_of(request, "IS_FINAL").reshape(-1)[0]) and array_of(request, "TOKENS_BATCH").size == 0


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.codec = TextCodec(parameters["tokenizer_dir"])
        self.generation_model = parameters["generation_model"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        if not self.decoupled:  # one response per request, nothing to drop or relay
            return [pb_utils.InferenceResponse(output_tensors=self.outputs(request)) for request in requests]
        for request in requests:  # in order: one instance keeps a request's responses in order
            self.respond(request)
        return None

    def respond(self, request) -> None:
        sender = request.get_response_sender()
        if request.is_cancelled():
            # Relay, then answer as usual: an error here, while the SSD step still runs,
            # would leave the ensemble request in flight forever (Triton 2.51).
            self.relay_cancellation(request)
        if is_heartbeat(request):
            sender.send(flags=FINAL)
            return
        sender.send(pb_utils.InferenceResponse(output_tensors=self.outputs(request)), flags=FINAL)

    def outputs(self, request) -> list:
        final = bool(array_of(request, "IS_FINAL").reshape(-1)[0])
        text = text_delta(self.codec.decode, ids_of(request, "PREFIX_IDS"), ids_of(request, "TOKENS_BATCH"), final)
        # shape [1]: tensorrtllm_backend's clients read `text_output[0]` as the bytes of the text
        tensors = [pb_utils.Tensor("OUTPUT", np.array([text.encode("utf-8")], dtype=object))]
        passed = [(output, pb_utils.get_input_tensor_by_name(request, name)) for name, output in PASSED_THROUGH.items()]
        return tensors + [pb_utils.Tensor(output, given.as_numpy()) for output, given in passed if given is not None]

    def relay_cancellation(self, request) -> None:
        generation_id = array_of(request, "GENERATION_ID")
        relay = pb_utils.InferenceRequest(
            model_name=self.generation_model, requested_output_names=[],
            inputs=[pb_utils.Tensor("cancel_generation_id", generation_id.reshape(1, 1))])
        for response in relay.exec(decoupled=True):  # one empty final response
            if response.has_error():
                pb_utils.Logger.log_warn(f"cancelling generation failed: {response.error().message()}")
