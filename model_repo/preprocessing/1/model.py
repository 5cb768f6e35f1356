"""Triton `preprocessing`: the prompt text to token ids, stop words to a word list.

Encodes exactly as the runtime does (`saguaro.serving.requests.TextCodec`), so the ids the SSD
model receives are the ones `Pipeline.encode` would give for the same text; with `chat`
true the text is one user turn rendered with the model's chat template, as
`Pipeline.encode_chat` renders it. It is the ensemble's front door, so it checks what
only the text side can name: the required inputs (Triton 2.51 counts inputs rather than
naming them) and a prompt too long for the context, reported as `text_input`, which is
what the client sent.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from saguaro.serving import requests as serving

# This model's input -> the ensemble input it comes from (what an error must name).
REQUIRED = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens"}


def strings_of(request, name: str) -> list[str]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [value.decode("utf-8") if isinstance(value, bytes) else str(value)
            for value in tensor.as_numpy().reshape(-1)]


class TritonPythonModel:
    def initialize(self, args):
        parameters = serving.model_parameters(args)
        self.codec = serving.TextCodec(parameters["tokenizer_dir"])
        self.max_context = int(parameters["max_context"])

    def execute(self, requests):
        return [self.respond(request) for request in requests]

    def respond(self, request):
        try:
            return pb_utils.InferenceResponse(output_tensors=self.preprocess(request))
        except UnicodeDecodeError as error:
            return error_response(f"input 'text_input' (or a word list) is not valid UTF-8: {error}")
        except serving.RequestError as error:
            return error_response(str(error))

    def preprocess(self, request) -> list:
        serving.require_inputs(serving.input_getter(pb_utils.get_input_tensor_by_name, request), REQUIRED)
        queries = strings_of(request, "QUERY")
        if len(queries) != 1:
            raise serving.RequestError(f"input 'text_input' must hold one string, got {len(queries)}")
        if serving.split_words(strings_of(request, "BAD_WORDS_DICT")):
            # Banning words means masking logits inside the lossless verification, which
            # the engines do not do; refusing beats silently ignoring them.
            raise serving.RequestError("input 'bad_words' is not supported by the SSD model; "
                                       "send it empty or leave it out")
        stop_words = serving.split_words(strings_of(request, "STOP_WORDS_DICT"))
        chat = pb_utils.get_input_tensor_by_name(request, "CHAT")
        input_ids = self.codec.encode(queries[0], chat=chat is not None and bool(chat.as_numpy().reshape(-1)[0]))
        serving.check_prompt_fits(len(input_ids), self.max_context, "text_input")
        word_list = serving.word_list(self.codec.encode_word, stop_words)
        return [pb_utils.Tensor("INPUT_ID", np.array([input_ids], dtype=np.int32)),
                pb_utils.Tensor("STOP_WORDS_IDS", word_list[np.newaxis])]


def error_response(message: str):
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
