"""The flip-rate benchmark: its counting, and a short run on the tiny engines."""
import json

from saguaro.benchmarks.flip_rate import Comparison, main, prompt_texts


def test_a_comparison_counts_tokens_up_to_the_first_flip():
    result = Comparison("test")
    result.add(0, [1, 2, 3, 4], [1, 2, 3, 4])
    result.add(1, [1, 2, 3, 4], [1, 2, 9, 4])
    result.add(2, [5, 6], [5, 6, 7])  # one stopped earlier: differs at its end
    assert (result.prompts, result.differing, result.tokens_compared) == (3, 2, 4 + 2 + 2)
    assert result.first_flips == [(1, 2), (2, 2)]


def test_prompts_are_distinct_and_fixed():
    texts = prompt_texts(1000)
    assert len(set(texts)) == 1000 and texts == prompt_texts(1000)


def test_a_short_run_reports_no_flip_on_fp32_engines(tiny_engines, tmp_path, capsys):
    report = tmp_path / "flips.json"
    assert main(["--engines", str(tiny_engines), "--prompts", "6", "--max-tokens", "12", "--sampled", "3",
                 "--json", str(report)]) == 0
    comparisons = json.loads(report.read_text())["comparisons"]
    assert [c["prompts"] for c in comparisons] == [6, 6, 3]
    greedy, sampled = comparisons[:2], comparisons[2]
    assert all(c["differing"] == 0 and c["tokens_compared"] == c["prompts"] * 12 for c in greedy)
    assert sampled["tokens_compared"] > 0  # counted, not promised: see docs/exactness.md
    assert sum(comparisons[1]["draft_tokens_per_round"].values()) > 0
    assert "greedy: ssd, load policy" in capsys.readouterr().out
