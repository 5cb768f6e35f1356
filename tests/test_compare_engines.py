"""The interleaved A/B of two engine folders' forwards."""
from saguaro.benchmarks.compare_engines import FORWARDS, compare, main


def test_every_forward_is_timed_for_both_folders(tiny_engines):
    rows = compare([tiny_engines, tiny_engines], repeats=3, context=16)
    assert [row[0] for row in rows] == [name for name, _, _ in FORWARDS]
    assert all(first > 0 and second > 0 for _, first, second in rows)


def test_the_command_prints_a_ratio_per_forward(tiny_engines, capsys):
    assert main([str(tiny_engines), str(tiny_engines), "--repeats", "2", "--context", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(FORWARDS) and all(float(line.split()[-1]) > 0 for line in lines[2:])
