#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 (frontend, router, Python worker API) into the project's venv.
#
# `pip install ai-dynamo==1.6.1` fails: ai-dynamo declares `aisimulate`, whose PyPI release is
# a placeholder that downloads from NVIDIA's own index (unreachable here; the simulator is
# not needed to serve). So: the project's `dynamo` extra (ai-dynamo-runtime, the Rust
# runtime with its compiled core, plus every other dependency ai-dynamo declares, and the
# openai client), then ai-dynamo itself without its dependencies. Run after
# scripts/bootstrap.sh; safe to run again (skips when this file and pyproject.toml are
# unchanged since the last install). See docs/dynamo.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
DYNAMO_VERSION=1.6.1
if [ ! -x "$VENV/bin/python" ]; then
  echo "[install_dynamo] no $VENV: run scripts/bootstrap.sh first" >&2
  exit 1
fi
STAMP="$VENV/.saguaro-dynamo-installed"
WANT="$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[install_dynamo] installing NVIDIA Dynamo $DYNAMO_VERSION into $VENV"
  "$VENV/bin/pip" install --quiet -e "$ROOT[dev,dynamo]"
  "$VENV/bin/pip" install --quiet --no-deps "ai-dynamo==$DYNAMO_VERSION"
  "$VENV/bin/python" -c "import dynamo.frontend, dynamo.llm, dynamo.runtime"  # the parts used here
  echo "$WANT" > "$STAMP"
fi
