"""`scripts/gpu_check.sh` on a machine without a GPU: everything it checks before installing
(arguments, pins, the wheel folder against the pins), the dry run, and the clean stop with
exit status 3 where no GPU is found. The wheel folder here holds one small wheel made by
the test; the pins are a file of the test's own. The real pins are checked against the
version ranges the code admits.
"""
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from saguaro.plugins.tensorrt_registry import SUPPORTED_TENSORRT, tensorrt_version
from saguaro.runtime.engines.tensorrt_llm_api import SUPPORTED_TENSORRT_LLM, release

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PROBE = "saguaro_gpu_check_probe"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)$")


def make_wheel(folder: Path, name: str = PROBE, version: str = "1.0") -> Path:
    """A pure-Python wheel with nothing but its metadata and an empty package."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def pins(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text("# test pins\n" + "".join(f"{line}\n" for line in lines))
    return path


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_NVIDIA_SMI": "false"}  # `false`: no GPU listed
    env.pop("GPU_CHECK_WHEELS", None)
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=env)
    return result, out


def status(out: Path) -> str:
    return json.loads((out / "gpu_check.json").read_text())["status"]


def test_without_a_wheel_folder_it_stops_with_status_2(tmp_path):
    result, out = run(tmp_path)
    assert result.returncode == 2 and "no wheel folder: pass --wheels DIR" in result.stdout
    assert status(out) == "usage"
    result, _ = run(tmp_path, "--wheels", str(tmp_path / "empty"))
    assert result.returncode == 2 and "does not exist" in result.stdout
    (tmp_path / "empty").mkdir()
    result, _ = run(tmp_path, "--wheels", str(tmp_path / "empty"))
    assert result.returncode == 2 and "holds no wheels" in result.stdout


def test_an_unpinned_requirement_is_refused(tmp_path):
    make_wheel(tmp_path / "wheels")
    result, _ = run(tmp_path, "--wheels", str(tmp_path / "wheels"), "--requirements",
                    str(pins(tmp_path, f"{PROBE}>=1.0")))
    assert result.returncode == 2 and f"not pinned with == : {PROBE}>=1.0" in result.stdout


def test_a_folder_that_does_not_satisfy_the_pins_is_refused_before_installing(tmp_path):
    make_wheel(tmp_path / "wheels")
    result, out = run(tmp_path, "--wheels", str(tmp_path / "wheels"), "--requirements",
                      str(pins(tmp_path, f"{PROBE}==1.0", "saguaro-absent-package==2.0")))
    assert result.returncode == 2, result.stdout
    assert "does not satisfy" in result.stdout and "saguaro-absent-package" in result.stdout
    assert status(out) == "wheels" and not (out / "venv").exists()


def test_the_dry_run_checks_the_folder_and_prints_the_plan(tmp_path):
    make_wheel(tmp_path / "wheels")
    result, out = run(tmp_path, "--wheels", str(tmp_path / "wheels"), "--requirements",
                      str(pins(tmp_path, f"{PROBE}==1.0")), "--dry-run")
    assert result.returncode == 0, result.stdout
    assert "satisfies" in result.stdout and "engines fp16" in result.stdout and "bench.py fp32" in result.stdout
    assert status(out) == "dry-run" and not (out / "venv").exists()


def test_without_a_gpu_it_stops_cleanly_with_status_3_before_installing(tmp_path):
    make_wheel(tmp_path / "wheels")
    result, out = run(tmp_path, "--wheels", str(tmp_path / "wheels"), "--requirements",
                      str(pins(tmp_path, f"{PROBE}==1.0")))
    assert result.returncode == 3, result.stdout
    assert "no NVIDIA GPU found" in result.stdout and "nothing was installed or run" in result.stdout
    assert "no NVIDIA GPU found" in (out / "gpu_check.log").read_text()
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "no-gpu" and report["steps"] == [] and not (out / "venv").exists()


@pytest.mark.parametrize("name", ["gpu-requirements.txt", "gpu-requirements-tensorrt-llm.txt"])
def test_the_shipped_pins_are_exact_and_inside_the_admitted_ranges(name):
    lines = [line.strip() for line in (ROOT / "scripts" / name).read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    pinned = dict(PIN.match(line).groups() for line in lines)  # AttributeError: an unpinned line
    assert len(pinned) == len(lines)
    for name in {"tensorrt", "tensorrt-cu12", "tensorrt-cu13"} & set(pinned):
        lowest, unsupported = SUPPORTED_TENSORRT
        assert lowest <= tensorrt_version(pinned[name]) < unsupported
    if "tensorrt-llm" in pinned:
        lowest, unchecked = SUPPORTED_TENSORRT_LLM
        assert lowest <= release(pinned["tensorrt-llm"]) < unchecked


def test_the_report_gathers_steps_tests_and_figures(tmp_path):
    """What a finished check leaves in its folder, gathered into gpu_check.json."""
    from saguaro.benchmarks import gpu_report

    (tmp_path / "steps.tsv").write_text("install\tpass\t12.5\nGPU tests\tfail (1)\t40.25\n")
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="test_gpu" name="test_a" time="1.5"/>'
        '<testcase classname="test_gpu" name="test_b" time="2"><failure message="boom"/></testcase>'
        '<testcase classname="test_gpu" name="test_c" time="0"><skipped message="no"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "suite-fp16.json").write_text('{"decode_ms": 1.25}')
    gpu_report.main(["--out", str(tmp_path), "--status", "failed"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "failed"
    assert report["steps"] == [{"step": "install", "status": "pass", "seconds": 12.5},
                               {"step": "GPU tests", "status": "fail (1)", "seconds": 40.25}]
    tests = report["gpu_tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert tests["tests"][1] == {"test": "test_gpu::test_b", "outcome": "failed", "seconds": 2.0, "detail": "boom"}
    assert report["latency_suite"] == {"fp32": None, "fp16": {"decode_ms": 1.25}}


def test_kernels_only_needs_no_wheel_folder_and_stops_cleanly_without_a_gpu(tmp_path):
    result, out = run(tmp_path, "--kernels-only", "--dry-run")
    assert result.returncode == 0 and "GPU tests, kernel timings" in result.stdout, result.stdout
    assert status(out) == "dry-run"
    result, out = run(tmp_path, "--kernels-only")
    assert result.returncode == 3 and "no NVIDIA GPU found" in result.stdout, result.stdout
    assert status(out) == "no-gpu" and not (out / "steps.tsv").read_text()


def test_kernels_only_runs_its_two_steps_with_the_machines_own_python(tmp_path):
    # a stand-in nvidia-smi that lists a GPU: the steps then run here, on the CPU, where the
    # GPU tests skip and the kernel timings time the reference alone
    fake_smi = tmp_path / "nvidia-smi"
    fake_smi.write_text("#!/bin/sh\necho 'NVIDIA Stand-in, 580.00, 1000 MiB'\n")
    fake_smi.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_NVIDIA_SMI": str(fake_smi)}
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(out), "--kernels-only"], capture_output=True,
                            text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    steps = [line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == [["GPU tests", "pass"], ["kernel timings", "pass"]]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "passed" and report["kernels"]["device"] == "cpu"
    assert {row["op"] for row in report["kernels"]["rows"]} == {"fused_verify greedy", "fused_verify sampled",
                                                                "plan_branches"}
