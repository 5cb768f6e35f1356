"""A pytest plugin for `scripts/gpu_check.sh`: one line per check at the end of the run,

    CHECK PASS  test_gpu.py::test_ssd_on_tensorrt_engines_equals_the_target_alone[ssd budget 6]  (4.1 s)
    CHECK SKIP  test_gpu.py::test_triton_kernels_compiled_...  (needs a CUDA GPU)

and a last line counting them. Load it with `-p gpu_summary` (tests/ on the path).
"""
from __future__ import annotations

LABELS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "FAIL"}


def _line(report) -> str:
    name = report.nodeid.split("/")[-1]
    label = LABELS[report.outcome if report.when == "call" or report.outcome != "passed" else "passed"]
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        detail = report.longrepr[2].removeprefix("Skipped: ")
    elif report.outcome != "passed":
        detail = f"{report.when}: {str(report.longrepr).strip().splitlines()[-1][:200]}"
    else:
        detail = f"{report.duration:.1f} s"
    return f"CHECK {label:4}  {name}  ({detail})"


def pytest_terminal_summary(terminalreporter) -> None:
    reports = [r for outcome in ("passed", "failed", "skipped", "error")
               for r in terminalreporter.stats.get(outcome, [])
               if r.when == "call" or r.outcome != "passed"]
    reports.sort(key=lambda r: r.nodeid)
    terminalreporter.write_sep("=", "GPU checks")
    for report in reports:
        terminalreporter.write_line(_line(report))
    counts = {label: sum(_line(r).startswith(f"CHECK {label}") for r in reports) for label in ("PASS", "FAIL", "SKIP")}
    terminalreporter.write_line("GPU CHECK SUMMARY: " + ", ".join(f"{n} {label.lower()}" for label, n in counts.items()))
