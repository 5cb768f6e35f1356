"""The benchmark runs end to end and reports every mode; it measures, it never asserts speed."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_reports_engine_costs_and_all_modes_side_by_side(tiny_engines):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--engines", str(tiny_engines),
                             "-k", "3", "--budget", "4", "--prompts", "2", "--max-tokens", "16",
                             "--repeats", "3"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for cost in ("target decode (1 token)", "target verify (4 tokens)", "draft tree step (4 branches)"):
        assert re.search(re.escape(cost) + r"\s+\d+\.\d+", out), out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("autoregressive", "speculative", "ssd"))}
    assert set(rows) == {"autoregressive", "speculative", "ssd"}
    assert rows["autoregressive"][-6] == "1.00"  # the baseline of the "vs AR" column
    assert rows["ssd"][-4] != "-"                  # ssd reports a cache hit rate
