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
    return [] if tensor is None else texts(tensor.as_numpy())


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
        """One row per prompt of the request (tensorrtllm_backend's batched requests): ids
        padded to the longest prompt (INPUT_LENGTHS says each one's length), word lists
        padded to the widest."""
        get = serving.input_getter(pb_utils.get_input_tensor_by_name, request)
        serving.require_inputs(get, REQUIRED)
        queries = strings_of(request, "QUERY")
        size = len(queries)
        rows = [self.encode_row(serving.batch_item(get, index, size), index, size) for index in range(size)]
        width = max(len(ids) for ids, _ in rows)
        input_ids = np.zeros((size, width), np.int32)
        for index, (ids, _) in enumerate(rows):
            input_ids[index, :len(ids)] = ids
        lengths = np.array([[len(ids)] for ids, _ in rows], np.int32)
        return [pb_utils.Tensor("INPUT_ID", input_ids), pb_utils.Tensor("INPUT_LENGTHS", lengths),
                pb_utils.Tensor("STOP_WORDS_IDS", stacked_word_lists([words for _, words in rows]))]

    def encode_row(self, get, index: int, size: int) -> tuple[list[int], np.ndarray]:
        """One prompt's ids and stop-word list; errors name the input (and the batch item)."""
        where = f"batch item {index}: " if size > 1 else ""
        query = texts(get("QUERY"))
        if len(query) != 1:
            raise serving.RequestError(f"{where}input 'text_input' must hold one string, got {len(query)}")
        if serving.split_words(texts(get("BAD_WORDS_DICT"))):
            # Banning words means masking logits inside the lossless verification, which
            # the engines do not do; refusing beats silently ignoring them.
            raise serving.RequestError(f"{where}input 'bad_words' is not supported by the SSD model; "
                                       "send it empty or leave it out")
        chat = get("CHAT")
        try:
            input_ids = self.codec.encode(query[0], chat=chat is not None and bool(chat.reshape(-1)[0]))
            serving.check_prompt_fits(len(input_ids), self.max_context, "text_input")
        except serving.RequestError as error:
            raise serving.RequestError(f"{where}{error}") from None
        return input_ids, serving.word_list(self.codec.encode_word, serving.split_words(texts(get("STOP_WORDS_DICT"))))


def texts(array) -> list[str]:
    if array is None:
        return []
    return [value.decode("utf-8") if isinstance(value, bytes) else str(value) for value in array.reshape(-1)]


def stacked_word_lists(lists: list[np.ndarray]) -> np.ndarray:
    """`[N, 2, W]`: each prompt's word list padded as tensorrtllm_backend pads one."""
    width = max(words.shape[1] for words in lists)
    stacked = np.zeros((len(lists), 2, width), np.int32)
    stacked[:, 1, :] = -1
    for index, words in enumerate(lists):
        stacked[index, :, :words.shape[1]] = words
    return stacked


def error_response(message: str):
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
