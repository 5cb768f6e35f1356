#!/usr/bin/env bash
# The main job, from a fresh clone: set up the environment, make the default (tiny) model
# pair if missing, compile it into ONNX Runtime engines, and generate with SSD, printing
# the text and its statistics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
MODELS="${MODELS:-models/tiny}"
ENGINES="${ENGINES:-engines/tiny}"
PROMPT="${PROMPT:-The with statement is used to}"

echo "== 1/3 model pair: $MODELS (made once, under a minute)"
python scripts/make_models.py --size tiny --out "$MODELS"

echo "== 2/3 engines: $ENGINES (ONNX Runtime, FusedVerify and BranchDraft plugins in the graphs)"
python scripts/build_engines.py --config build/configs/tiny.yaml --target "$MODELS/target" \
  --draft "$MODELS/draft" --out "$ENGINES" --quiet

echo "== 3/3 SSD generation on the engines"
python scripts/generate.py --engines "$ENGINES" --mode ssd --num-draft-tokens 4 --fanout 3 \
  --prompt "$PROMPT" --max-tokens 48
