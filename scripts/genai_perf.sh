#!/usr/bin/env bash
# NVIDIA's genai-perf against the served ensemble, as Triton users benchmark tensorrtllm_backend:
#
#   python scripts/serve.py --engines engines/tiny &          # wait for its "ready:" line
#   bash scripts/genai_perf.sh engines/tiny                   # 127.0.0.1:8001, concurrency 1
#   bash scripts/genai_perf.sh engines/tiny 127.0.0.1:9001 --concurrency 4 \
#       --extra-inputs '{"end_id": -1, "decoding_mode": "autoregressive"}'
#
# genai-perf 0.0.16 and the perf_analyzer binary of tritonclient 2.51 (the server's version)
# go into their own environment, .venv-genai-perf, so that their dependencies stay out of the
# project's. Prompts of 128 tokens, 64 output tokens exactly (genai-perf sends min_length
# then, which SSD honours only with end_id -1: hence that extra input), streamed; flags after
# the URL are passed on and override these. Results land in .triton/genai-perf/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINES="${1:?usage: genai_perf.sh ENGINES_DIR [HOST:PORT] [genai-perf flags...]}"
URL="${2:-127.0.0.1:8001}"
shift $(( $# >= 2 ? 2 : 1 ))
VENV="$ROOT/.venv-genai-perf"

if [ ! -x "$VENV/bin/perf_analyzer" ]; then
  echo "[genai_perf] installing genai-perf 0.0.16 and perf_analyzer (tritonclient 2.51) into $VENV"
  python3 -m venv "$VENV"
  # pandas<3: tritonclient 2.51 needs numpy<2, which pandas 3 does not accept.
  "$VENV/bin/pip" install --quiet "genai-perf==0.0.16" "tritonclient[all]==2.51.0" "pandas<3"
fi
# The perf_analyzer binary links libb64 and libcudart by name; the nvidia-pytriton wheel in the
# project's environment ships both (under hashed names), so no system package is needed.
BUNDLED="$(ls -d "$ROOT"/.venv/lib/python3*/site-packages/nvidia_pytriton.libs)"
LIBS="$VENV/perf_analyzer_libs"
mkdir -p "$LIBS"
ln -sf "$(ls "$BUNDLED"/libb64-*.so.0d)" "$LIBS/libb64.so.0d"
ln -sf "$(ls "$BUNDLED"/libcudart-*.so.12*)" "$LIBS/libcudart.so.12"
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1

exec genai-perf profile -m ensemble --backend tensorrtllm --endpoint-type kserve --streaming -u "$URL" \
  --tokenizer "$ENGINES/tokenizer" --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 64 --output-tokens-stddev 0 --output-tokens-mean-deterministic \
  --extra-inputs '{"end_id": -1}' --request-count 40 --warmup-request-count 4 \
  --artifact-dir "$ROOT/.triton/genai-perf" "$@"
