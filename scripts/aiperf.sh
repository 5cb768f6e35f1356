#!/usr/bin/env bash
# NVIDIA's AIPerf (genai-perf's successor) against the OpenAI-compatible front end:
#
#   python scripts/serve.py --engines engines/smollm2 --openai-port 9000 &   # wait for "ready:"
#   bash scripts/aiperf.sh engines/smollm2                                  # http://127.0.0.1:9000
#   bash scripts/aiperf.sh engines/smollm2 http://127.0.0.1:9000 --concurrency 16 --request-count 64
#
# AIPerf goes into its own environment, .venv-aiperf, so that its dependencies stay out of
# the project's. Chat endpoint, streamed, concurrency 8; prompts of 32 tokens and exactly 48
# output tokens (ignore_eos); the model's name is the one serve.py printed (default: the
# engine folder's name). Flags after the URL are passed on and override these. Results land
# in .triton/aiperf/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINES="${1:?usage: aiperf.sh ENGINES_DIR [URL] [aiperf flags...]}"
URL="${2:-http://127.0.0.1:9000}"
shift $(( $# >= 2 ? 2 : 1 ))
VENV="$ROOT/.venv-aiperf"

if [ ! -x "$VENV/bin/aiperf" ]; then
  echo "[aiperf] installing AIPerf into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "aiperf>=0.13,<1"
fi
export HF_HUB_OFFLINE=1
exec "$VENV/bin/aiperf" profile --model "${AIPERF_MODEL:-$(basename "$ENGINES")}" --url "$URL" \
  --endpoint-type chat --streaming --concurrency 8 --request-count 32 \
  --prompt-input-tokens-mean 32 --prompt-input-tokens-stddev 0 --output-tokens-mean 48 \
  --extra-inputs ignore_eos:true --tokenizer "$ENGINES/tokenizer" --ui-type simple \
  --output-artifact-dir "$ROOT/.triton/aiperf" "$@"
