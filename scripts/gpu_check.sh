#!/usr/bin/env bash
# Check the GPU path on a machine with an NVIDIA GPU, in a few minutes: install what can be
# installed (TensorRT from NVIDIA's index, OpenAI Triton, the CPU-side dependencies; TensorRT-LLM
# only with GPU_CHECK_TENSORRT_LLM=1), run the GPU-only tests (tests/test_gpu.py and the real
# TensorRT-LLM test) and print one line per check (tests/gpu_summary.py), then a count.
#
#   bash scripts/gpu_check.sh                 # PYTHON=... picks the interpreter (default: .venv, else python3)
#   GPU_CHECK_TENSORRT_LLM=1 bash scripts/gpu_check.sh -x
#
# The interpreter must already have a CUDA build of torch (this never installs torch). An install
# that fails (no network, no wheel) is reported and its checks skip with the reason.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
INSTALL_TIMEOUT="${GPU_CHECK_INSTALL_TIMEOUT:-300}"

try_install() {  # try_install <what> <pip arguments...>
  local what="$1"; shift
  if timeout "$INSTALL_TIMEOUT" "$PYTHON" -m pip install --quiet "$@" >/tmp/gpu_check_pip.log 2>&1; then
    echo "install: $what ok"
  else
    echo "install: $what FAILED ($(tail -n 1 /tmp/gpu_check_pip.log))"
  fi
}

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

for module in onnx onnxruntime transformers tokenizers safetensors yaml tqdm pytest; do
  has "$module" || try_install "$module" "$( [ "$module" = yaml ] && echo pyyaml || echo "$module")"
done
has onnx_ir || try_install onnx-ir "onnx-ir>=1.0,<2"
has triton || try_install triton "triton>=3.2,<4"
has tensorrt || try_install tensorrt --extra-index-url https://pypi.nvidia.com "tensorrt>=10.8,<12"
if [ "${GPU_CHECK_TENSORRT_LLM:-0}" = 1 ]; then
  has tensorrt_llm || try_install tensorrt_llm --extra-index-url https://pypi.nvidia.com tensorrt_llm
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | sed 's/^/gpu: /'
"$PYTHON" - <<'PY'
import importlib
import torch
print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
for name in ("tensorrt", "triton", "onnxruntime", "tensorrt_llm"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as error:  # noqa: BLE001 - a report line, not a failure
        print(f"{name}: not available ({type(error).__name__}: {str(error)[:120]})")
PY

# TRITON_INTERPRET=0: the OpenAI Triton kernels compile for the device (tests/conftest.py
# defaults to the CPU interpreter). The source folders are the `saguaro` namespace package.
export TRITON_INTERPRET=0
export PYTHONPATH="$ROOT/runtime:$ROOT/plugins:$ROOT/build:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
exec timeout "${GPU_CHECK_TIMEOUT:-1200}" "$PYTHON" -m pytest -q -p no:cacheprovider -p gpu_summary -m gpu \
  tests/test_gpu.py tests/test_tensorrt_llm_target.py "$@"
