"""The load benchmark end to end: a real Triton server, streams at two concurrencies,
figures from the client side and the server's metrics side by side (never asserted as
speeds: only that every figure was measured)."""
import json
import math

import pytest

from saguaro.benchmarks.load_bench import Level, main, merged, paired_ratios

pytestmark = pytest.mark.server


def test_the_load_benchmark_measures_every_mode_at_every_concurrency(tiny_engines, tmp_path, capsys):
    out = tmp_path / "figures"
    assert main(["--engines", str(tiny_engines), "--concurrency", "1,3", "--max-tokens", "8", "--repeats", "2",
                 "--requests-per-stream", "2", "--min-requests", "3", "--modes", "ar,ssd", "--no-sampled",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    levels = json.loads((out / "load.json").read_text())["greedy"]
    assert [(level["mode"], level["concurrency"]) for level in levels] == [
        ("batched AR", 1), ("batched AR", 3), ("batched SSD policy", 1), ("batched SSD policy", 3)]
    for level in levels:
        assert level["runs"] == 2 and level["requests"] == 2 * max(3, 2 * level["concurrency"])
        assert level["tokens"] == 8 * level["requests"] == 8 * len(level["itl_ms"])
        assert all(math.isfinite(level[name]) and level[name] > 0 for name in
                   ("tokens_per_s", "itl_ms_p50", "ttft_ms_p50", "mean_batch")), level
        assert level["mean_batch"] <= level["concurrency"]
        assert 0.0 <= level["alone"] <= 1.0  # a share of the level's rounds, each counted once
    assert all(level["mean_k"] == 0 for level in levels if level["mode"] == "batched AR")
    # SSD's levels carry their repeats' ratios to AR's, AR's none
    assert [len(level["over_ar"]) for level in levels] == [0, 0, 2, 2]
    assert "SSD policy / batched AR by repeat" in printed
    assert "targets (measured ratios):" in printed and "batched SSD policy" in printed
    measured = [(line[:22].strip(), int(line[22:27])) for line in printed.splitlines()
                if line.startswith("batched") and line[22:27].strip().isdigit() and "runs)" not in line]
    # measured level by level, the modes in turn, the order turned at each repeat and level
    ar, ssd = "batched AR", "batched SSD policy"
    assert measured == [(ar, 1), (ssd, 1), (ssd, 1), (ar, 1), (ssd, 3), (ar, 3), (ar, 3), (ssd, 3)]
    # each concurrency warmed up first, its requests not among the level's
    order = [line[:12] if line.startswith("warm-up") else int(line[22:27]) for line in printed.splitlines()
             if line.startswith("warm-up") or (line.startswith("batched") and "runs)" not in line
                                               and line[22:27].strip().isdigit())]
    assert order == ["warm-up at C", 1, 1, 1, 1, "warm-up at C", 3, 3, 3, 3]
    assert "warm-up at C=3: 3 requests per mode, not counted" in printed


def test_runs_of_a_level_count_as_one_their_tokens_over_their_seconds():
    def run(tokens, seconds, itl, batch, cpu, alone):
        return Level("batched AR", 4, 2, tokens, seconds, tokens / seconds, 0.0, 0.0, 0.0, 0.0, batch, 0.0,
                     {"server": cpu}, itl_ms=itl, ttft_ms=[1.0, 2.0], alone=alone)
    one = merged([run(100, 1.0, [10.0, 12.0], 4.0, 5.0, 1.0), run(300, 3.0, [20.0, 30.0], 3.0, 1.0, 0.6)])
    assert (one.runs, one.requests, one.tokens, one.tokens_per_s) == (2, 4, 400, 100.0)
    assert (one.itl_ms_p50, one.itl_ms_p99) == (20.0, 30.0)  # over every request of both runs
    assert one.mean_batch == pytest.approx(3.25) and one.alone == pytest.approx(0.7)  # by time
    assert one.cpu_ms_per_token["server"] == pytest.approx(2.0)  # by tokens


def test_paired_ratios_divide_each_repeat_by_the_baselines_same_repeat():
    def run(tokens_per_s):
        return Level("m", 4, 2, 100, 1.0, tokens_per_s, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0, {})
    ssd, ar = [run(90.0), run(120.0)], [run(100.0), run(100.0)]
    assert paired_ratios(ssd, ar) == [0.9, 1.2]
    assert paired_ratios(ar, ar) == [] and paired_ratios(ssd, []) == []


def test_a_levels_metrics_are_read_once_no_request_is_in_flight():
    """The `ssd` model counts a request after its final response: a scrape taken while one
    is still in flight waits for its figures, so they are not credited to the next level."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from saguaro.serving.served_metrics import metric, settled_scrape

    pages = iter([f'ssd_requests_in_flight{{model="ssd"}} {n}\nssd_rounds_total{{model="ssd"}} {r}\n'
                  for n, r in ((2, 10), (1, 20), (0, 30), (0, 40))])

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name in http.server
            body = next(pages).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        text = settled_scrape(server.server_address[1], timeout_s=5)
    finally:
        server.shutdown()
    assert metric(text, "ssd_requests_in_flight") == 0 and metric(text, "ssd_rounds_total") == 30


def test_the_sampled_check_sends_top_p_only_when_it_filters_and_refuses_a_bad_one(tiny_engines, capsys):
    from saguaro.benchmarks.load_bench import parse_args, request_inputs, sampled_inputs

    assert sampled_inputs(1.0) == {"temperature": 0.8} and sampled_inputs(0.95)["top_p"] == 0.95
    for path in ("ssd", "ensemble"):
        sent = {item.name(): item for item in request_inputs(path, "hi", 4, sampled_inputs(0.95))}
        assert sent["top_p"].datatype() == "FP32" and sent["temperature"].datatype() == "FP32"
    with pytest.raises(SystemExit):
        parse_args(["--engines", str(tiny_engines), "--sampled-top-p", "1.5"])
    assert "--sampled-top-p must be in (0, 1]" in capsys.readouterr().err
