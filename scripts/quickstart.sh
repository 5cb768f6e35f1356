#!/usr/bin/env bash
# The main job, from a fresh clone: set up the environment, make the default (tiny) model
# pair if missing, and generate with SSD, printing the text and its statistics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
MODELS="${MODELS:-models/tiny}"
PROMPT="${PROMPT:-The with statement is used to}"

echo "== 1. models: $MODELS"
python scripts/make_models.py --size tiny --out "$MODELS"

echo "== 2. SSD generation on the checkpoints (torch engines)"
python scripts/generate.py --target "$MODELS/target" --draft "$MODELS/draft" \
  --mode ssd --num-draft-tokens 4 --fanout 3 --prompt "$PROMPT" --max-tokens 48
