"""The engine-level latency suite runs on small engines and prints every figure; it fails
only on errors (a missing row, a figure that is not a finite positive number), never on
speed. Not in the default run (pytest -m latency): with the model pair it takes ~40 s."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"-?\d+(?:\.\d+)?%?|nan|inf"


def table_rows(out: str, first_word: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first_word]]


def figures(row: list[str]) -> list[float]:
    numbers = [cell for cell in row if re.fullmatch(NUMBER, cell)]
    return [float(cell.rstrip("%")) for cell in numbers]


def assert_finite_positive(row):
    values = figures(row)
    assert values and all(math.isfinite(v) and v > 0 for v in values), row


@pytest.mark.latency
def test_engine_suite_prints_every_row_with_finite_positive_figures(tiny_engines, tmp_path):
    report = tmp_path / "suite.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--engines-only",
                             "--engines", str(tiny_engines), "--threads", "1,2", "--contexts", "16,64",
                             "--tree-branches", "2,4", "--prefill", "32", "--repeats", "3", "-k", "3",
                             "--json", str(report)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    engine_rows = [row for row in table_rows(out, "target") + table_rows(out, "draft")]
    # per role and thread count: one row of prefill and bytes, one row per context
    assert len(engine_rows) == 2 * 2 * (1 + 2), out
    for row in engine_rows:
        assert_finite_positive(row[2:])
    assert "verify(4)" in out and "tree(4)" in out and "decode % of bw limit" in out
    fp32_rows = table_rows(out, "fp32")
    assert len(fp32_rows) == 1, out  # the memory table
    assert_finite_positive(fp32_rows[0][1:4] + fp32_rows[0][-1:])
    data = json.loads(report.read_text())
    assert data["bandwidth_gbs"] > 0 and len(data["engines"]) == 4
    assert {e["threads"] for e in data["engines"]} == {1, 2}
    assert all(c["verify_ms"] > 0 for e in data["engines"] for c in e["contexts"])
    assert set(data["hidden_branches"]) == {"1", "2"}
    assert data["stored_hidden_branches"] is not None
