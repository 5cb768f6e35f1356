"""Dynamo's preprocessed request as the pipeline's request, the worker's model card and its
metrics: everything of the Dynamo worker that runs without Dynamo itself."""
import json

import pytest

from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.pipeline import RequestError
from saguaro.serving.dynamo_requests import DEFAULT_TEMPERATURE, parse_request
from saguaro.serving.requests import ModelLimits

LIMITS = ModelLimits(max_context=64, vocab_size=100, eos_token_id=2)
DEFAULTS = DecodeOptions(num_draft_tokens=3, fanout=(2,))


def frontend_request(**changes) -> dict:
    """A request as Dynamo 1.6's frontend sends it (every option group present, unset
    options null), with `changes` merged into its groups."""
    request = {
        "model": "tiny", "token_ids": [5, 6, 7], "eos_token_ids": [2], "mdc_sum": "x", "annotations": [],
        "routing": {}, "router_config_override": None,
        "stop_conditions": {"max_tokens": 8, "stop": None, "stop_token_ids": None, "stop_token_ids_visible": None,
                            "stop_token_ids_hidden": [2], "min_tokens": None, "ignore_eos": None,
                            "max_thinking_tokens": None},
        "sampling_options": {"n": None, "best_of": None, "presence_penalty": None, "frequency_penalty": None,
                             "repetition_penalty": None, "temperature": 0.0, "top_p": None, "top_k": None,
                             "min_p": None, "use_beam_search": None, "length_penalty": None, "seed": None,
                             "include_stop_str_in_output": None, "guided_decoding": None},
        "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": None,
                           "formatted_prompt": None, "return_tokens_as_token_ids": None},
    }
    for key, value in changes.items():
        if isinstance(value, dict):
            request[key] = {**request[key], **value}
        else:
            request[key] = value
    return request


def test_a_greedy_request_keeps_the_worker_defaults_and_its_own_length():
    parsed = parse_request(frontend_request(), DEFAULTS, LIMITS)
    assert parsed.prompt_ids == [5, 6, 7]
    assert parsed.options.max_tokens == 8 and parsed.options.num_draft_tokens == 3 and parsed.options.fanout == (2,)
    assert parsed.sampling.greedy and parsed.end_tokens == {2}


def test_sampling_options_map_to_the_pipeline_and_unset_ones_take_openai_defaults():
    parsed = parse_request(frontend_request(sampling_options={"temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                                              "seed": 11}), DEFAULTS, LIMITS)
    assert (parsed.sampling.temperature, parsed.sampling.top_p, parsed.sampling.top_k, parsed.sampling.seed) == (
        pytest.approx(0.7), pytest.approx(0.9), 20, 11)
    unset = parse_request(frontend_request(sampling_options={"temperature": None, "top_k": -1}), DEFAULTS, LIMITS)
    assert unset.sampling.temperature == DEFAULT_TEMPERATURE and unset.sampling.top_k == 0
    assert unset.sampling.top_p == 1.0 and unset.sampling.seed is None


def test_no_max_tokens_means_the_room_the_context_leaves():
    parsed = parse_request(frontend_request(stop_conditions={"max_tokens": None}), DEFAULTS, LIMITS)
    assert parsed.options.max_tokens == 64 - 3


def test_end_tokens_are_the_models_and_every_stop_token_and_ignore_eos_drops_the_models():
    stops = {"stop_token_ids": [9], "stop_token_ids_visible": [10], "stop_token_ids_hidden": [2, 11]}
    parsed = parse_request(frontend_request(eos_token_ids=[2, 3], stop_conditions=stops), DEFAULTS, LIMITS)
    assert parsed.end_tokens == {2, 3, 9, 10, 11}
    ignoring = parse_request(frontend_request(eos_token_ids=[2, 3], stop_conditions={**stops, "ignore_eos": True}),
                             DEFAULTS, LIMITS)
    assert ignoring.end_tokens == {9, 10, 11}
    assert parsed.options.eos_token_id == -1  # the pipeline's own end token is replaced by end_tokens


@pytest.mark.parametrize("changes, named", [
    ({"token_ids": []}, "token_ids is empty"),
    ({"token_ids": None}, "token_ids is missing"),
    ({"token_ids": [1, "a"]}, "token_ids must be a list of token ids"),
    ({"token_ids": [1, 100]}, "token_ids: token ids must lie in [0, 100)"),
    ({"token_ids": list(range(64))}, "token_ids: a prompt of 64 tokens leaves no room"),
    ({"stop_conditions": {"max_tokens": 62}}, "stop_conditions.max_tokens: 62 new tokens"),
    ({"stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens must be an integer >= 1"),
    ({"stop_conditions": {"min_tokens": 4}}, "stop_conditions.min_tokens = 4 cannot be honoured"),
    ({"stop_conditions": {"stop_token_ids": [100]}}, "stop_conditions.stop_token_ids: token ids must lie"),
    ({"sampling_options": {"presence_penalty": 0.5}}, "sampling_options.presence_penalty = 0.5 cannot be honoured"),
    ({"sampling_options": {"frequency_penalty": -1.0}}, "sampling_options.frequency_penalty = -1.0"),
    ({"sampling_options": {"repetition_penalty": 1.2}}, "sampling_options.repetition_penalty = 1.2"),
    ({"sampling_options": {"min_p": 0.1}}, "sampling_options.min_p = 0.1"),
    ({"sampling_options": {"n": 2}}, "sampling_options.n = 2 cannot be honoured: one sequence"),
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search = True"),
    ({"sampling_options": {"guided_decoding": {"json": {}}}}, "sampling_options.guided_decoding"),
    ({"sampling_options": {"temperature": -1.0}}, "sampling_options.temperature: temperature must be"),
    ({"sampling_options": {"top_p": 0.0}}, "sampling_options.top_p: top_p must be in (0, 1]"),
    ({"sampling_options": {"top_k": -2}}, "sampling_options.top_k: top_k must be an integer >= 0"),
    ({"sampling_options": {"seed": -5}}, "sampling_options.seed: seed must be an integer"),
    ({"sampling_options": {"temperature": "hot"}}, "sampling_options.temperature must be a finite number"),
    ({"output_options": {"logprobs": 3}}, "output_options.logprobs = 3 cannot be honoured"),
    ({"stop_conditions": "none"}, "stop_conditions must be an object"),
])
def test_a_request_ssd_cannot_honour_is_refused_naming_the_field(changes, named):
    with pytest.raises(RequestError) as refused:
        parse_request(frontend_request(**changes), DEFAULTS, LIMITS)
    assert named in str(refused.value)


def test_neutral_values_of_the_refused_options_are_accepted():
    neutral = {"n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0,
               "min_p": 0.0, "use_beam_search": False, "length_penalty": 2.0}
    parse_request(frontend_request(sampling_options=neutral, output_options={"logprobs": 0},
                                   stop_conditions={"min_tokens": 1}), DEFAULTS, LIMITS)
    parse_request(frontend_request(stop_conditions={"min_tokens": 5, "ignore_eos": True, "stop_token_ids_hidden": []},
                                   eos_token_ids=[]), DEFAULTS, ModelLimits(64, 100, None))


# --- the model card and the metrics (dynamo_worker imports Dynamo only when it is there) ----

def test_the_model_card_carries_tokenizer_config_end_tokens_and_a_given_chat_template(tiny_engines, tmp_path):
    from saguaro.serving.dynamo_worker import model_card_files, write_model_card
    from saguaro.serving.model_repo import source_from_engines

    source = source_from_engines(tiny_engines)
    files = model_card_files(source, [1], 0, chat_template="{{ messages[0]['content'] }}")
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
            "chat_template.jinja"} <= set(files)
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": [1], "bos_token_id": 0}
    assert json.loads(files["config.json"])["model_type"] == "llama"
    assert json.loads(files["tokenizer_config.json"])["chat_template"] == "{{ messages[0]['content'] }}"
    card = write_model_card(files, tmp_path, "tiny")
    assert sorted(path.name for path in card.iterdir()) == sorted(files)
    # the same content, the same folder (every worker of a model must register one card)
    assert write_model_card(dict(files), tmp_path, "tiny") == card
    assert write_model_card({**files, "config.json": b"{}"}, tmp_path, "tiny") != card


def test_the_worker_metrics_count_rounds_drafts_and_requests():
    pytest.importorskip("prometheus_client", reason="the dynamo extra is not installed")
    from types import SimpleNamespace

    from saguaro.runtime.control.round_report import Plan, RoundReport, undrafted_reason
    from saguaro.serving.dynamo_metrics import WorkerMetrics
    from saguaro.serving.served_metrics import metric

    def round_of(plans: list[Plan], alone: bool):
        """A round's batch and its report, as the decoder makes them."""
        report = RoundReport(len(plans), len(plans), 0.001, alone, undrafted=undrafted_reason(plans))
        return [SimpleNamespace(plan=plan) for plan in plans], report

    metrics = WorkerMetrics("tiny")
    metrics.started()
    metrics.observe_round(*round_of([Plan(2), Plan(0, undrafted="priced")], alone=False), queued=2)
    metrics.observe_round(*round_of([Plan(0, undrafted="clock"), Plan(0)], alone=True), queued=1)
    metrics.finished("stop", 7, {"rounds": 3, "accepted_histogram": [1, 0, 2], "drafted_tokens": 5, "cache_hits": 2,
                                 "cache_misses": 1, "tokens_per_s": 50.0})
    metrics.refused("rejected")
    text = metrics.exposition()
    assert metric(text, "ssd_generated_tokens_total", model="tiny") == 7
    assert metric(text, "ssd_accepted_draft_tokens_total") == 4 and metric(text, "ssd_verified_draft_tokens_total") == 5
    assert metric(text, "ssd_cache_hits_total") == 2 and metric(text, "ssd_cache_misses_total") == 1
    assert metric(text, "ssd_requests_total", finish_reason="stop") == 1
    assert metric(text, "ssd_requests_total", finish_reason="rejected") == 1
    assert metric(text, "ssd_requests_in_flight") == 0 and metric(text, "ssd_requests_queued") == 1
    assert metric(text, "ssd_batch_size_count") == 2 and metric(text, "ssd_batch_size_sum") == 4
    assert metric(text, "ssd_undrafted_rounds_total", reason="clock") == 1  # the round that drafted is not counted
    assert metric(text, "ssd_undrafted_rounds_total", reason="priced") == 0
    assert metric(text, "ssd_target_alone_rounds_total") == 1


def test_the_projection_multiplies_the_one_worker_figure_and_ignores_other_cluster_sizes():
    from saguaro.benchmarks.dynamo_bench import Level, projection

    def level(workers, streams, rate):
        return Level(workers, streams, 8, 512, 1.0, rate, rate / workers, 10.0, 1.0, [8] * workers, 0.5)

    rows = projection([level(1, 1, 100.0), level(1, 4, 250.0), level(2, 4, 260.0)], (1, 4))
    assert rows == [{"streams_per_worker": 1, "1_workers": 100.0, "4_workers": 400.0},
                    {"streams_per_worker": 4, "1_workers": 250.0, "4_workers": 1000.0}]
