"""The load benchmark end to end: a real Triton server, streams at two concurrencies,
figures from the client side and the server's metrics side by side (never asserted as
speeds: only that every figure was measured)."""
import json
import math

import pytest

from saguaro.benchmarks.load_bench import main

pytestmark = pytest.mark.server


def test_the_load_benchmark_measures_every_mode_at_every_concurrency(tiny_engines, tmp_path, capsys):
    out = tmp_path / "figures"
    assert main(["--engines", str(tiny_engines), "--concurrency", "1,3", "--max-tokens", "8",
                 "--min-requests", "3", "--modes", "ar,ssd", "--no-sampled", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    levels = json.loads((out / "load.json").read_text())["greedy"]
    assert [(level["mode"], level["concurrency"]) for level in levels] == [
        ("batched AR", 1), ("batched AR", 3), ("batched SSD policy", 1), ("batched SSD policy", 3)]
    for level in levels:
        assert level["requests"] == max(3, 2 * level["concurrency"]) and level["tokens"] == 8 * level["requests"]
        assert all(math.isfinite(level[name]) and level[name] > 0 for name in
                   ("tokens_per_s", "itl_ms_p50", "ttft_ms_p50", "mean_batch")), level
        assert level["mean_batch"] <= level["concurrency"]
    assert all(level["mean_k"] == 0 for level in levels if level["mode"] == "batched AR")
    assert "targets (measured ratios):" in printed and "batched SSD policy" in printed
    measured = [(line[:22].strip(), int(line[22:27])) for line in printed.splitlines()
                if line.startswith("batched") and line[22:27].strip().isdigit()]
    # measured level by level, the modes in turn, the order turned at the next level
    assert measured[:4] == [("batched AR", 1), ("batched SSD policy", 1), ("batched SSD policy", 3), ("batched AR", 3)]
