#!/usr/bin/env bash
# The test command: set up the environment if needed, lint and type-check, then run the
# whole test suite (unit, exactness, engines, and end-to-end tests against a real Triton server).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
# NVIDIA Dynamo for the tests of the Dynamo worker and cluster (tests/test_dynamo*.py); kept
# out of bootstrap.sh, which the quickstart shares.
bash "$ROOT/scripts/install_dynamo.sh"
cd "$ROOT"
# Lint and type-check the source roots, scripts and tests first (pyproject.toml names them:
# tools skip a folder named build/ by default); a failure stops the run.
echo "[test] ruff"; ruff check --quiet
echo "[test] mypy"; mypy
exec python -m pytest -q "$@"
