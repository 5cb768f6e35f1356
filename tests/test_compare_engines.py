"""The interleaved A/B of two engine folders' forwards."""
from saguaro.benchmarks.compare_engines import FORWARDS, agreement, compare, main
from saguaro.runtime.models.prompts import PROMPTS


def test_every_forward_is_timed_for_both_folders(tiny_engines):
    rows = compare([tiny_engines, tiny_engines], repeats=3, context=16)
    assert [row[0] for row in rows] == [name for name, _, _ in FORWARDS]
    assert all(first > 0 and second > 0 for _, first, second in rows)


def test_the_command_prints_a_ratio_per_forward(tiny_engines, capsys):
    assert main([str(tiny_engines), str(tiny_engines), "--repeats", "2", "--context", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(FORWARDS) and all(float(line.split()[-1]) > 0 for line in lines[2:])


def test_agreement_is_one_against_itself_and_less_against_another_precision(tiny_engines, tiny_pair, tmp_path):
    """A target read against itself agrees everywhere with zero divergence; the int4
    build of the same checkpoint moves its distributions (KL > 0)."""
    from checkpoints import build_small_engines

    same, divergence, positions = agreement([tiny_engines, tiny_engines], tokens=12)
    assert same == 1.0 and divergence == 0.0 and positions == 12 * len(PROMPTS)
    int4 = build_small_engines(tiny_pair, tmp_path / "int4", "agreement-int4", max_draft_tokens=2, max_branches=2,
                               precision="int4")
    share, divergence, _ = agreement([tiny_engines, int4], tokens=12)
    assert divergence > 1e-6 and 0.0 <= share <= 1.0
