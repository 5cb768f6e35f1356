"""SSD workers behind NVIDIA Dynamo's real frontend and router, on one machine: the official
`openai` client streams chat answers, greedy answers equal the project's own runtime, the
router spreads requests over both workers, a bad request is refused naming its field, a
worker killed under load loses no request (migrated) and a restarted one rejoins, SIGTERM
drains, and without migration a dead worker's requests end with an error, never in silence.

The engines are the tiny pair with a long context (`served_engines`), so that a long
generation is in flight when a worker is stopped or killed.
"""
from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
import time

import pytest

from saguaro.runtime.control.round_report import UNDRAFTED_REASONS
from saguaro.runtime.core.options import DecodeOptions
from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.pipeline import Pipeline

NO_DYNAMO = "NVIDIA Dynamo is not installed (bash scripts/install_dynamo.sh; scripts/test.sh installs it)"
pytestmark = [pytest.mark.dynamo, pytest.mark.skipif(importlib.util.find_spec("dynamo") is None, reason=NO_DYNAMO)]

# A chat template for the tiny model, whose tokenizer carries none (a real chat model's
# own template needs no flag).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
QUESTION = "The with statement"
LONG = 1200  # tokens: seconds of the tiny model on a busy machine, long enough to be cut by a kill or a stop


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def runtime(served_engines):
    """The project's own runtime on the same engines: what the cluster's answers must equal."""
    with Pipeline.load(engines=served_engines) as pipeline:
        yield pipeline


def start_cluster(engines, run_dir, workers: int, migration_limit: int, chat_template, drain_timeout_s: float = 30,
                  grace_s: float = 1.0):
    from saguaro.serving.dynamo_cluster import LocalCluster

    return LocalCluster(engines, run_dir, workers, migration_limit=migration_limit,
                        worker_flags=["--chat-template", str(chat_template),
                                      "--drain-timeout", str(drain_timeout_s), "--shutdown-grace", str(grace_s)]
                        ).start()


@pytest.fixture(scope="module")
def cluster(served_engines, tmp_path_factory, chat_template):
    """The frontend and two SSD workers, requests migrating when a worker dies."""
    cluster = start_cluster(served_engines, tmp_path_factory.mktemp("cluster"), 2, 3, chat_template)
    yield cluster
    cluster.stop()


def openai_client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.url, api_key="not-needed", max_retries=0)


def greedy(runtime, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> str:
    options = DecodeOptions(max_tokens=max_tokens, eos_token_id=-1 if ignore_eos else None)
    return runtime.decode(runtime.generate(prompt_ids, options, SamplingParams()).output_ids)


def chat_prompt_ids(runtime, question: str) -> list[int]:
    """The chat turn as the frontend renders and tokenizes it."""
    text = runtime.tokenizer.apply_chat_template([{"role": "user", "content": question}], chat_template=CHAT_TEMPLATE,
                                                 add_generation_prompt=True, tokenize=False)
    return runtime.tokenizer.encode(text, add_special_tokens=False)


def plain_prompt_ids(runtime, prompt: str) -> list[int]:
    """A completion prompt as the frontend tokenizes it: tokenizer.json's encoding alone
    (this tokenizer adds its BOS only through tokenizer_config, which the frontend skips)."""
    return runtime.tokenizer.encode(prompt, add_special_tokens=False)


def counters(cluster, name: str, **labels) -> list[float]:
    return [worker.counter(name, **labels) for worker in cluster.live_workers()]


def model_undrafted_rounds(cluster) -> list[float]:
    """Each worker's rounds in which its load policy chose to draft nothing for requests that
    could have drafted (every reason but "asked")."""
    chosen = [reason for reason in UNDRAFTED_REASONS if reason != "asked"]
    return [sum(worker.counter("ssd_undrafted_rounds_total", reason=reason) for reason in chosen)
            for worker in cluster.live_workers()]


def stream_completions(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Streamed completions all at once (asyncio), each one's text, finish reason or error."""
    import openai

    async def one(client, prompt):
        pieces, finish, error = [], None, None
        try:
            stream = await client.completions.create(model="long", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].text or "")
                    finish = chunk.choices[0].finish_reason or finish
        except openai.APIError as failure:
            error = failure
        return {"text": "".join(pieces), "finish_reason": finish, "error": error}

    async def every():
        async with openai.AsyncOpenAI(base_url=url, api_key="not-needed", max_retries=0) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    return asyncio.run(every())


class InFlight:
    """Long streamed completions running in a thread while a test stops or kills a worker."""

    def __init__(self, cluster, count: int, max_tokens: int = LONG):
        self.results: list[dict] = []
        self.thread = threading.Thread(target=lambda: self.results.extend(
            stream_completions(cluster.url, [QUESTION] * count, max_tokens)))
        self.thread.start()
        deadline = time.monotonic() + 60
        while sum(counters(cluster, "ssd_requests_in_flight")) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(counters(cluster, "ssd_requests_in_flight")) == count, "the requests never started"

    def wait(self) -> list[dict]:
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), "the in-flight requests never ended"
        return self.results


def test_the_dynamo_extra_and_the_install_script_give_ai_dynamo_everything_it_declares_but_aisimulate():
    """What scripts/install_dynamo.sh installed (the `dynamo` extra, then ai-dynamo with
    --no-deps) covers ai-dynamo's own dependency list, less the placeholder package."""
    import importlib.metadata
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    ours = {Requirement(text).name.lower() for text in project["dependencies"] + project["optional-dependencies"]["dynamo"]}
    declared = [Requirement(text) for text in importlib.metadata.requires("ai-dynamo")]
    needed = {req.name.lower() for req in declared if not (req.marker and "extra" in str(req.marker))} - {"aisimulate"}
    assert needed <= ours, needed - ours
    assert importlib.metadata.version("ai-dynamo") == importlib.metadata.version("ai-dynamo-runtime") == "1.6.1"
    assert importlib.util.find_spec("aisimulate") is None  # not needed to serve


def test_the_openai_client_streams_a_chat_answer_equal_to_the_runtimes(cluster, runtime):
    client = openai_client(cluster)
    stream = client.chat.completions.create(model="long", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    pieces = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) > 1, "the answer came in one piece, not streamed"
    prompt_ids = chat_prompt_ids(runtime, QUESTION)
    assert text == greedy(runtime, prompt_ids, 24)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == ["length"]


def test_greedy_completions_equal_the_runtimes_and_stop_at_the_end_token(cluster, runtime):
    client = openai_client(cluster)
    for prompt in ("The for statement is used to", "Exceptions are raised by"):
        answer = client.completions.create(model="long", prompt=prompt, max_tokens=40, temperature=0)
        assert answer.choices[0].text == greedy(runtime, plain_prompt_ids(runtime, prompt), 40)
    long = client.completions.create(model="long", prompt=QUESTION, max_tokens=200, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.choices[0].text == greedy(runtime, plain_prompt_ids(runtime, QUESTION), 200, ignore_eos=True)
    assert long.usage.completion_tokens == 200 and long.choices[0].finish_reason == "length"


def test_the_router_spreads_concurrent_requests_over_both_workers(cluster):
    before = counters(cluster, "dynamo_component_requests_total")
    tokens_before = counters(cluster, "ssd_generated_tokens_total")
    drafts_before, undrafted_before = counters(cluster, "ssd_verified_draft_tokens_total"), model_undrafted_rounds(cluster)
    results = stream_completions(cluster.url, [QUESTION] * 8, 16)
    assert all(result["error"] is None and result["finish_reason"] == "length" for result in results), results
    served = [after - was for after, was in zip(counters(cluster, "dynamo_component_requests_total"), before)]
    generated = [after - was for after, was in zip(counters(cluster, "ssd_generated_tokens_total"), tokens_before)]
    assert sum(served) == 8 and min(served) >= 2, served  # round-robin: 4 each
    assert sum(generated) == 8 * 16 and min(generated) > 0
    # Each worker speculated, or its load policy counted why it chose not to (on a fast
    # machine batched rounds without drafts can be the cheaper choice at four streams).
    drafts = [after - was for after, was in zip(counters(cluster, "ssd_verified_draft_tokens_total"), drafts_before)]
    undrafted = [after - was for after, was in zip(model_undrafted_rounds(cluster), undrafted_before)]
    assert all(drafted > 0 or chose_not > 0 for drafted, chose_not in zip(drafts, undrafted)), (drafts, undrafted)


def test_a_request_ssd_cannot_honour_is_refused_naming_the_field(cluster):
    import openai

    client = openai_client(cluster)
    with pytest.raises(openai.BadRequestError, match=r"sampling_options\.presence_penalty = 0\.5 cannot be honoured"):
        client.completions.create(model="long", prompt=QUESTION, max_tokens=4, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match=r"stop_conditions\.max_tokens: 20000 new tokens"):
        client.completions.create(model="long", prompt=QUESTION, max_tokens=20000)
    # the workers serve on
    assert client.completions.create(model="long", prompt=QUESTION, max_tokens=4).usage.completion_tokens == 4


def test_a_killed_worker_loses_no_request_and_a_restarted_one_rejoins(cluster, runtime):
    victim = cluster.live_workers()[0]
    migrated_before = cluster.frontend_counter("dynamo_frontend_model_migration_total")
    in_flight = InFlight(cluster, 4)
    assert victim.counter("ssd_requests_in_flight") >= 1
    victim.service.kill()
    newcomers = stream_completions(cluster.url, [QUESTION] * 4, 8)  # the dead worker may still be listed
    results = in_flight.wait()
    reference = greedy(runtime, plain_prompt_ids(runtime, QUESTION), LONG, ignore_eos=True)
    assert [result["error"] for result in results + newcomers] == [None] * 8
    assert [result["text"] for result in results] == [reference] * 4  # migrated mid-stream, nothing lost
    assert cluster.frontend_counter("dynamo_frontend_model_migration_total") > migrated_before
    rejoined = cluster.start_worker()
    cluster.wait_ready()
    before = rejoined.counter("dynamo_component_requests_total")
    assert all(result["error"] is None for result in stream_completions(cluster.url, [QUESTION] * 6, 8))
    assert rejoined.counter("dynamo_component_requests_total") - before >= 2


def test_sigterm_drains_a_worker_while_the_other_takes_new_requests(cluster, runtime):
    """Runs after the tests above: it stops one of the two workers for good, one that has
    requests in flight (after the restart above, the round-robin may have put both of them
    on the same worker)."""
    in_flight = InFlight(cluster, 2)
    stopping = max(cluster.live_workers(), key=lambda worker: worker.counter("ssd_requests_in_flight"))
    stopping.service.terminate()
    newcomers = stream_completions(cluster.url, [QUESTION] * 3, 8)
    results = in_flight.wait()
    assert stopping.service.process.wait(60) == 0  # every request in flight finished: drained
    reference = greedy(runtime, plain_prompt_ids(runtime, QUESTION), LONG, ignore_eos=True)
    assert [result["text"] for result in results] == [reference, reference]
    assert all(result["error"] is None for result in newcomers + results)
    report = re.search(r"drained: (\{.*\})", stopping.service.log_path.read_text())
    # nothing cut at the deadline; how many were in flight at the drain is not asserted: CI
    # once saw 0 (the worker's requests had ended or moved before its drain request), with
    # every answer whole and the exit clean, which is what the test is about
    assert report and '"stopped_at_deadline": 0' in report.group(1)


def test_without_migration_a_stopped_or_dead_workers_requests_end_with_an_error(served_engines, tmp_path,
                                                                              chat_template):
    """One worker, no migration, a drain deadline shorter than the generations: a SIGTERM
    cuts them at the deadline (EngineShutdown, exit code 3), a kill cuts them at once; the
    client hears of it either way, never a silent, short answer."""
    with start_cluster(served_engines, tmp_path, 1, 0, chat_template, drain_timeout_s=0.2, grace_s=0) as alone:
        in_flight = InFlight(alone, 2)
        alone.members[0].service.terminate()
        cut = in_flight.wait()
        assert alone.members[0].service.process.wait(60) == 3
        assert '"stopped_at_deadline": 2' in alone.members[0].service.log_path.read_text()
        alone.start_worker()
        alone.wait_ready()
        in_flight = InFlight(alone, 2)
        alone.members[1].service.kill()
        killed = in_flight.wait()
    assert all(result["error"] is not None and result["finish_reason"] is None for result in cut + killed), \
        cut + killed


@pytest.mark.parametrize("flags, named", [
    (["--system-port", "40000"], "--system-port must be in 1..32767"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["--num-draft-tokens", "99"], "--num-draft-tokens: 99 draft tokens exceed the engines' built maximum"),
])
def test_the_worker_refuses_a_bad_flag_naming_it_before_loading(tiny_engines, flags, named, capsys):
    from saguaro.serving.dynamo_worker import main

    assert main(["--engines", str(tiny_engines), *flags]) == 2
    assert named in capsys.readouterr().err
