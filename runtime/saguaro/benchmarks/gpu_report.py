"""The figures of a `scripts/gpu_check.sh` run, as one JSON file (standard library only: it
also runs where nothing is installed yet, to record why a check stopped; the script puts
the `runtime/` source folder on PYTHONPATH for it).

    python scripts/gpu_report.py --out gpu-check --status passed    # writes gpu-check/gpu_check.json
    python scripts/gpu_report.py --versions                         # the stack, as JSON, on stdout
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PRECISIONS = ("fp32", "fp16")
STACK = ("torch", "tensorrt", "triton", "onnxruntime", "onnx", "transformers", "tensorrt_llm")


def versions() -> dict:
    """Each package of the GPU stack with its version, or why it is not there."""
    found: dict[str, str | None] = {"python": sys.version.split()[0]}  # torch.version.cuda is None on CPU builds
    for name in STACK:
        try:
            found[name] = importlib.import_module(name).__version__
        except Exception as error:  # noqa: BLE001 - a report line, not a failure
            found[name] = f"not available ({type(error).__name__}: {str(error)[:120]})"
    try:
        import torch

        found["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            found["device"] = torch.cuda.get_device_name()
            found["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    except ImportError:
        pass
    return found


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def steps(path: Path) -> list[dict]:
    """steps.tsv: one `name <TAB> status <TAB> seconds` line per step the check ran."""
    if not path.is_file():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return [{"step": name, "status": status, "seconds": round(float(seconds), 2)} for name, status, seconds in rows]


def checks(path: Path) -> dict | None:
    """The pytest JUnit XML of a test step: counts, and each test's outcome and time."""
    if not path.is_file():
        return None
    tests = []
    for case in ElementTree.parse(path).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                detail = (found.get("message") or "")[:200]
                break
        else:
            detail = ""
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "detail": detail})
    counts = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failed", "skipped")}
    return {**counts, "tests": tests}


def engines(out: Path) -> dict:
    """Per precision built: how the manifest says the engines compute, and their size."""
    found = {}
    for precision in PRECISIONS:
        folder = out / "engines" / f"tiny-{precision}"
        manifest = read_json(folder / "manifest.json")
        if manifest is not None:
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            found[precision] = {"tensorrt": manifest.get("tensorrt"), "versions": manifest.get("versions"),
                                "megabytes": round(size / 1e6, 2)}
    return found


def report(out: Path, status: str) -> dict:
    gpus = out / "gpus.txt"
    return {"status": status,
            "gpus": gpus.read_text().splitlines() if gpus.is_file() else [],
            "versions": read_json(out / "versions.json"),
            "steps": steps(out / "steps.tsv"),
            "gpu_tests": checks(out / "gpu_tests.xml"),
            "tensorrt_llm_tests": checks(out / "tensorrt_llm_tests.xml"),
            "engines": engines(out),
            "latency_suite": {p: read_json(out / f"suite-{p}.json") for p in PRECISIONS},
            "bench": {p: read_json(out / f"bench-{p}.json") for p in PRECISIONS},
            "kernels": read_json(out / "kernels.json")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the check's output folder: writes gpu_check.json there")
    parser.add_argument("--status", default="unknown", help="how the check ended")
    parser.add_argument("--versions", action="store_true", help="print the GPU stack's versions as JSON")
    args = parser.parse_args(argv)
    if args.versions:
        print(json.dumps(versions(), indent=1))
        return 0
    if args.out is None:
        parser.error("--out or --versions is required")
    (args.out / "gpu_check.json").write_text(json.dumps(report(args.out, args.status), indent=1) + "\n")
    return 0
