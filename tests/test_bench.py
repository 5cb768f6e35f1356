"""The benchmark runs end to end and reports every mode; it measures, it never asserts speed."""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_reports_engine_costs_and_all_modes_side_by_side(tiny_engines, tmp_path):
    figures = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--engines", str(tiny_engines),
                             "-k", "3", "--budget", "4", "--prompts", "2", "--max-tokens", "16",
                             "--repeats", "3", "--ignore-eos", "--json", str(figures)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "decode(1)" in out and "verify(4)" in out and "tree(4)" in out
    costs = [line.split() for line in out.splitlines() if line.startswith(("target ", "draft "))]
    assert len(costs) == 4 and all(re.fullmatch(r"\d+\.\d+", row[4]) for row in costs[2:]), out
    names = ("autoregressive", "speculative K=3", "ssd K=3", "ssd load policy")
    rows = {name: line.split() for line in out.splitlines() for name in names if line.startswith(name)}
    assert set(rows) == set(names), out
    assert rows["autoregressive"][-9] == "1.00"  # the baseline of the "vs AR" column
    assert rows["autoregressive"][-7] == "0.00"  # K per round
    assert rows["ssd K=3"][-5] != "-"             # ssd (K fixed) reports a cache hit rate
    assert re.fullmatch(r"\d\.\d\d/\d\.\d\d", rows["ssd K=3"][-4])  # pre-speculated / fresh acceptance
    modes = json.loads(figures.read_text())["modes"]
    assert [m["tokens"] for m in modes.values()] == [2 * 16] * 4  # every mode generates exactly max tokens
    assert any(name.startswith("ssd load policy") for name in modes)  # K chosen per round, side by side
    assert all(m["prefill_s"] > 0 and m["decode_tokens_per_s"] > 0 for m in modes.values())


def test_answers_end_where_the_model_ends_them_unless_eos_is_ignored():
    from types import SimpleNamespace

    from saguaro.benchmarks.bench import mode_options

    def stops(ignore_eos: bool) -> set:
        args = SimpleNamespace(max_tokens=64, ignore_eos=ignore_eos, saguaro=0.5)
        modes = mode_options(args, 4, dict(fanout=(3,), budget=None))
        assert len(modes) == 5 and all(options.max_tokens == 64 for _, options in modes)
        return {options.eos_token_id for _, options in modes}

    assert stops(False) == {None}  # the model's own end-of-generation tokens, in every mode
    assert stops(True) == {-1}     # never stop early


def test_bench_needs_engines_for_the_engine_suite_and_placement(tmp_path):
    for flag in ("--engines-only", "--placement", "--assisted"):
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), flag],
                                capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert result.returncode == 2 and "need --engines DIR" in result.stderr


def test_placement_runs_every_placement_and_reports_both_modes(tiny_engines, tmp_path):
    figures = tmp_path / "placement.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--engines", str(tiny_engines),
                             "--placement", "--rounds", "1", "--prompts", "1", "--max-tokens", "4",
                             "--json", str(figures)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    placements = json.loads(figures.read_text())["placements"]
    assert len(placements) >= 2  # every placement ran (each pipeline closed before the next opens)
    assert all(speeds and all(len(v) == 1 and v[0] > 0 for v in speeds.values()) for speeds in placements.values())


def test_modes_run_interleaved_prompt_by_prompt_in_turned_order_each_pass_the_other_way_round():
    from types import SimpleNamespace

    from saguaro.benchmarks.bench import STAT_KEYS, run_interleaved

    calls = []

    class Recorder:
        def generate(self, prompt, options, sampling):
            calls.append((prompt, options))
            stats = dict.fromkeys(STAT_KEYS, 1) | {"tokens": 10, "total_s": 2.0, "prefill_s": 1.0, "mean_accepted": 0.5}
            return SimpleNamespace(stats=SimpleNamespace(**stats))

    modes = [("a", "A"), ("b", "B"), ("c", "C")]
    totals = run_interleaved(Recorder(), ["p0", "p1", "p2", "p3"], modes, None)
    assert calls == [("p0", "A"), ("p0", "B"), ("p0", "C"), ("p1", "B"), ("p1", "C"), ("p1", "A"),
                     ("p2", "C"), ("p2", "A"), ("p2", "B"), ("p3", "C"), ("p3", "B"), ("p3", "A")]
    assert list(totals) == ["a", "b", "c"]  # the table keeps the modes' order
    assert all(t["tokens"] == 40 and t["decode_tokens_per_s"] == 10.0 and t["accepted"] == 2.0
               for t in totals.values())


def test_passes_keep_each_modes_speed_over_the_first_modes_pass_by_pass(capsys):
    """`--passes N`: totals over every pass, and each mode's ratio to autoregressive decoding
    pass by pass, whose spread is what a ratio of one run cannot show."""
    from types import SimpleNamespace

    import pytest

    from saguaro.benchmarks.bench import STAT_KEYS, parse_args, print_passes, run_interleaved

    calls = []

    class Recorder:
        def generate(self, prompt, options, sampling):
            calls.append(options)
            slow = options == "B" and len(calls) <= 4  # mode b in the first pass (2 prompts x 2 modes)
            stats = dict.fromkeys(STAT_KEYS, 1) | {"tokens": 10, "total_s": 3.0 if slow else 2.0, "prefill_s": 1.0,
                                                   "mean_accepted": 0.5}
            return SimpleNamespace(stats=SimpleNamespace(**stats))

    totals = run_interleaved(Recorder(), ["p0", "p1"], [("a", "A"), ("b", "B")], None, passes=2)
    assert len(calls) == 8 and totals["b"]["tokens"] == 40
    assert totals["a"]["by_pass"] == [1.0, 1.0] and totals["b"]["by_pass"] == [0.5, 1.0]
    print_passes(totals)
    last = capsys.readouterr().out.splitlines()[-1].split()
    assert last[0] == "b" and last[1:3] == ["0.750", "+-"] and last[-3:] == ["0.500", "to", "1.000"]
    with pytest.raises(SystemExit):
        parse_args(["--passes", "0"])


def test_transformers_rows_stop_at_the_end_of_generation_unless_told_to_go_on(tiny_pair):
    import torch

    from saguaro.benchmarks.assisted import generate_timed, load_model

    model = load_model(tiny_pair / "target")
    prompt = [1, 5, 9, 13]
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    # the greedy first token made the end of generation: the answer is that one token
    assert generate_timed(model, prompt, 12, False, eos_token_id=first)[1] == 1
    assert generate_timed(model, prompt, 12, True, eos_token_id=first)[1] == 12  # exactly max tokens
