#!/usr/bin/env bash
# The main job, from a fresh clone: set up the environment, make the default (tiny) model
# pair if missing, compile it into ONNX Runtime engines, generate with SSD (printing the
# text and its statistics), then serve the engines with a real Triton Inference Server and
# stream a completion from it over gRPC.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
MODELS="${MODELS:-models/tiny}"
ENGINES="${ENGINES:-engines/tiny}"
PROMPT="${PROMPT:-The with statement is used to}"

echo "== 1/4 model pair: $MODELS (made once, under a minute)"
python scripts/make_models.py --size tiny --out "$MODELS"

echo "== 2/4 engines: $ENGINES (ONNX Runtime, FusedVerify and BranchDraft plugins in the graphs)"
python scripts/build_engines.py --config tiny --target "$MODELS/target" \
  --draft "$MODELS/draft" --out "$ENGINES" --quiet

echo "== 3/4 SSD generation on the engines"
python scripts/generate.py --engines "$ENGINES" --mode ssd --num-draft-tokens 4 --fanout 3 \
  --prompt "$PROMPT" --max-tokens 48

echo "== 4/4 Triton Inference Server on 127.0.0.1 (gRPC 8001), a completion streamed over gRPC"
python scripts/serve.py --engines "$ENGINES" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT  # SIGTERM stops Triton cleanly
python scripts/client.py --url 127.0.0.1:8001 --wait 180 --prompt "$PROMPT" --max-tokens 48 --stream
