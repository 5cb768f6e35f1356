#!/usr/bin/env bash
# The test command: set up the environment if needed, then run the whole test suite
# (unit, exactness, engines, and end-to-end tests against a real Triton server).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
# NVIDIA Dynamo for the tests of the Dynamo worker and cluster (tests/test_dynamo*.py); kept
# out of bootstrap.sh, which the quickstart shares.
bash "$ROOT/scripts/install_dynamo.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
