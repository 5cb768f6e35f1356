"""Triton `postprocessing`: one streamed response's token ids to the text they add.

Stateless by design (saguaro/runtime/detokenizer.py): each response brings the tokens before
its own, so a character split across rounds is held back and printed once, whole.

This step is also the one that learns of a client's cancellation: Triton cancels the
ensemble steps it schedules after the cancel, not the SSD step in flight. So a cancelled
request here is relayed to the SSD model (a BLS request with the generation's id), which
stops that generation at its next round (and ends it with a normal final response).
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from saguaro.runtime.detokenizer import text_delta
from saguaro.serving.requests import TextCodec, model_parameters


def ids_of(request, name: str) -> list[int]:
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1).tolist()


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.codec = TextCodec(parameters["tokenizer_dir"])
        self.generation_model = parameters["generation_model"]

    def execute(self, requests):
        return [self.respond(request) for request in requests]

    def respond(self, request):
        if request.is_cancelled():
            # Relay, then answer as usual: an error here, while the SSD step still runs,
            # would leave the ensemble request in flight forever (Triton 2.51).
            self.relay_cancellation(request)
        final = bool(pb_utils.get_input_tensor_by_name(request, "IS_FINAL").as_numpy().reshape(-1)[0])
        text = text_delta(self.codec.decode, ids_of(request, "PREFIX_IDS"),
                               ids_of(request, "TOKENS_BATCH"), final)
        output = np.array([[text.encode("utf-8")]], dtype=object)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)])

    def relay_cancellation(self, request) -> None:
        generation_id = pb_utils.get_input_tensor_by_name(request, "GENERATION_ID").as_numpy()
        relay = pb_utils.InferenceRequest(
            model_name=self.generation_model, requested_output_names=[],
            inputs=[pb_utils.Tensor("cancel_generation_id", generation_id.reshape(1, 1))])
        for response in relay.exec(decoupled=True):  # one empty final response
            if response.has_error():
                pb_utils.Logger.log_warn(f"cancelling generation failed: {response.error().message()}")
