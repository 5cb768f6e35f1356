"""tensorrtllm_backend's ensemble inputs that SSD does not act on, and why.

The ensemble takes every input of tensorrtllm_backend's `inflight_batcher_llm` ensemble
(v0.19 and its TensorRT-LLM copy), so that its clients (genai-perf, the backend's own
client scripts) work unchanged. Most are honoured (see `requests.parse_request`). The
rest fall in two groups, listed here once for the parser, the tests and the README:

- IGNORED: accepted with any value, because with one sequence per request they change
  nothing (or ask for outputs this server does not produce);
- NEUTRAL_ONLY: accepted only at the value that changes nothing; any other value is
  refused with an error naming the input and saying why it cannot be honoured. Most of
  them would change the target's distribution, which verification inside the engines
  does not model, so honouring them would break the lossless guarantee silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from saguaro.runtime.pipeline import RequestError

IGNORED = {
    "pad_id": "nothing is padded: every response carries exactly its own tokens",
    "length_penalty": "it scores beams, and one sequence has no beams to score (as in TensorRT-LLM with "
                      "beam_width 1)",
    "return_num_input_tokens": "num_input_tokens is on every response",
    "return_num_output_tokens": "num_output_tokens is on every response",
}


def values(array) -> list:
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in np.asarray(array).reshape(-1)]


def empty(array) -> bool:
    return all(v == "" for v in values(array))


def equals(neutral) -> Callable[[np.ndarray], bool]:
    return lambda array: all(v == neutral for v in values(array))


@dataclass(frozen=True)
class NeutralOnly:
    neutral: Callable[[np.ndarray], bool]
    accepted: str  # the value(s) accepted, as the error message says it
    why: str


UNCHANGED_TARGET = ("the engines verify drafts against the unchanged target, so SSD could not keep "
                    "its output lossless")
LOSSLESS = "it changes the target's distribution; " + UNCHANGED_TARGET
GUIDED = "guided decoding masks the target's distribution; " + UNCHANGED_TARGET
NEUTRAL_ONLY = {
    "num_return_sequences": NeutralOnly(equals(1), "1", "one sequence is generated per request"),
    "beam_width": NeutralOnly(equals(1), "1", "SSD decodes one sequence (greedy or sampled); beam search "
                                              "is not implemented"),
    "repetition_penalty": NeutralOnly(equals(1.0), "1.0", LOSSLESS),
    "presence_penalty": NeutralOnly(equals(0.0), "0", LOSSLESS),
    "frequency_penalty": NeutralOnly(equals(0.0), "0", LOSSLESS),
    "embedding_bias_words": NeutralOnly(empty, "empty", LOSSLESS),
    "embedding_bias_weights": NeutralOnly(empty, "empty", LOSSLESS),
    "guided_decoding_guide_type": NeutralOnly(empty, "empty", GUIDED),
    "guided_decoding_guide": NeutralOnly(empty, "empty", GUIDED),
    "return_context_logits": NeutralOnly(equals(False), "false", "the engines return no logits to the server"),
    "return_generation_logits": NeutralOnly(equals(False), "false", "the engines return no logits to the "
                                                                    "server"),
    "decoder_text_input": NeutralOnly(empty, "empty", "it is the decoder input of encoder-decoder models, "
                                                      "and these models are decoder-only"),
    "prompt_embedding_table": NeutralOnly(empty, "empty", "prompt tuning is not supported"),
    "prompt_vocab_size": NeutralOnly(equals(0), "0", "prompt tuning is not supported"),
    "prompt_table_extra_id": NeutralOnly(equals(0), "0", "prompt tuning is not supported"),
    "lora_task_id": NeutralOnly(lambda array: False, "left out", "LoRA adapters are not supported"),
    "lora_weights": NeutralOnly(empty, "empty", "LoRA adapters are not supported"),
    "lora_config": NeutralOnly(empty, "empty", "LoRA adapters are not supported"),
}


def refuse_unhonoured(get) -> None:
    """RequestError naming the first input whose value SSD cannot honour."""
    for name, rule in NEUTRAL_ONLY.items():
        array = get(name)
        if array is not None and not rule.neutral(array):
            shown = values(array)
            raise RequestError(f"input '{name}' = {shown[0] if len(shown) == 1 else shown} cannot be honoured: "
                               f"{rule.why} (accepted: {rule.accepted})")
