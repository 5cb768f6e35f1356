#!/usr/bin/env bash
# Check the GPU path on a machine with an NVIDIA GPU and no package index: install the pinned
# requirements from a local wheel folder, build fp32 and fp16 TensorRT engines of the tiny pair,
# run the GPU tests, time the plugins' kernels against their reference ops at SmolLM2's vocabulary
# (scripts/bench_kernels.py), then the engine latency suite and bench.py on those engines; one log and
# one JSON of figures in the output folder. docs/gpu.md says how to fill the wheel folder.
#
#   bash scripts/gpu_check.sh --wheels DIR [--out DIR] [--tensorrt-llm] [--dry-run] [-- PYTEST_ARGS]
#   bash scripts/gpu_check.sh --kernels-only [--out DIR] [--dry-run]
#
#   --wheels DIR        the wheel folder (also GPU_CHECK_WHEELS); nothing is fetched from anywhere
#   --out DIR           where the log, the JSON, the venvs, models and engines go (default gpu-check)
#   --requirements F    the pinned requirements (default scripts/gpu-requirements.txt)
#   --tensorrt-llm      also the real TensorRT-LLM target, in a venv of its own
#                       (scripts/gpu-requirements-tensorrt-llm.txt)
#   --dry-run           check the folder satisfies the pins and print the plan; install nothing
#   --kernels-only      no wheel folder, nothing installed: with the machine's own torch and OpenAI
#                       Triton, the GPU tests (those needing TensorRT skip) and the kernel timings
#
# Exit status: 0 every check passed; 1 a step or a check failed; 2 bad usage, an unpinned
# requirement or a wheel folder that does not satisfy the pins; 3 no NVIDIA GPU found (stopped
# before installing anything). PYTHON picks the base interpreter (default python3);
# GPU_CHECK_NVIDIA_SMI the nvidia-smi command; GPU_CHECK_TIMEOUT a limit per step (s, 900).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

WHEELS="${GPU_CHECK_WHEELS:-}"
OUT="gpu-check"
REQUIREMENTS="scripts/gpu-requirements.txt"
LLM_REQUIREMENTS="scripts/gpu-requirements-tensorrt-llm.txt"
WITH_TENSORRT_LLM=0
DRY_RUN=0
KERNELS_ONLY=0
PYTEST_ARGS=()
usage() { sed -n '7,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) [ $# -ge 2 ] || usage; WHEELS="$2"; shift 2 ;;
    --out) [ $# -ge 2 ] || usage; OUT="$2"; shift 2 ;;
    --requirements) [ $# -ge 2 ] || usage; REQUIREMENTS="$2"; shift 2 ;;
    --tensorrt-llm) WITH_TENSORRT_LLM=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --kernels-only) KERNELS_ONLY=1; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage ;;
  esac
done

BASE_PYTHON="${PYTHON:-python3}"
NVIDIA_SMI="${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}"
STEP_TIMEOUT="${GPU_CHECK_TIMEOUT:-900}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
STEPS="$OUT/steps.tsv"  # step <TAB> status <TAB> seconds, for the JSON
: > "$STEPS"

report() {  # report <status>: the JSON of figures, from whatever the steps left in $OUT
  PYTHONPATH="$ROOT/runtime" "$BASE_PYTHON" scripts/gpu_report.py --out "$OUT" --status "$1" \
    || echo "gpu_check: the report failed"
}
stop() {  # stop <exit code> <status> <message>
  echo "gpu_check: $3"
  report "$2"
  echo "gpu_check: log $LOG, figures $OUT/gpu_check.json"
  exit "$1"
}

find_gpu() {  # stop with status 3 unless nvidia-smi lists a GPU; record it
  if ! GPUS="$("$NVIDIA_SMI" --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)" \
      || [ -z "$GPUS" ]; then
    stop 3 no-gpu "no NVIDIA GPU found ($NVIDIA_SMI lists none): nothing was installed or run"
  fi
  echo "$GPUS" | sed 's/^/gpu: /' | tee "$OUT/gpus.txt"
}
step() {  # step <name> <command...>: run it with a time limit, record status and seconds
  local name="$1"; shift
  local started; started="$(date +%s.%N)"
  echo "=== $name: $*"
  timeout "$STEP_TIMEOUT" "$@"
  local rc=$?
  local seconds; seconds="$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')"
  local status=pass; [ $rc -eq 0 ] || status="fail ($rc)"
  printf '%s\t%s\t%s\n' "$name" "$status" "$seconds" >> "$STEPS"
  echo "=== $name: $status in ${seconds} s"
  return $rc
}
install_env() {  # install_env <venv> <requirements>
  [ -x "$1/bin/python" ] || "$BASE_PYTHON" -m venv --system-site-packages "$1"
  "$1/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" -r "$2"
}

finish() {  # the exit status from the steps' record
  if grep -q $'\tfail' "$STEPS"; then
    stop 1 failed "some steps failed: $(grep $'\tfail' "$STEPS" | cut -f1 | paste -sd, -)"
  fi
  stop 0 passed "every step passed"
}
record_versions() {  # what $PY runs with, into versions.json
  PYTHONPATH="$ROOT/runtime" "$PY" scripts/gpu_report.py --versions > "$OUT/versions.json" && cat "$OUT/versions.json"
}
device_kernels() {  # compile the OpenAI Triton kernels for the device, not the interpreter
  export TRITON_INTERPRET=0
  export PYTHONPATH="$ROOT/runtime:$ROOT/plugins:$ROOT/build:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
}
if [ "$KERNELS_ONLY" = 1 ]; then  # the machine's own torch and OpenAI Triton, nothing installed
  if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run; would run, with $("$BASE_PYTHON" -V 2>&1): GPU tests, kernel timings"
    stop 0 dry-run "dry run done: nothing installed, built or run"
  fi
  find_gpu
  PY="$BASE_PYTHON"
  record_versions
  device_kernels
  step "GPU tests" "$PY" -m pytest -q -p no:cacheprovider -p gpu_summary -m gpu --junitxml "$OUT/gpu_tests.xml" \
    tests/test_gpu.py
  step "kernel timings" "$PY" scripts/bench_kernels.py --json "$OUT/kernels.json"
  finish
fi

# 1. the arguments and the wheel folder, before anything else
[ -n "$WHEELS" ] || stop 2 usage "no wheel folder: pass --wheels DIR (docs/gpu.md says how to fill one)"
[ -d "$WHEELS" ] || stop 2 usage "wheel folder $WHEELS does not exist"
WHEELS="$(cd "$WHEELS" && pwd)"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || stop 2 usage "wheel folder $WHEELS holds no wheels (docs/gpu.md says how to fill it)"
REQUIREMENT_FILES=("$REQUIREMENTS")
[ "$WITH_TENSORRT_LLM" = 1 ] && REQUIREMENT_FILES+=("$LLM_REQUIREMENTS")
for file in "${REQUIREMENT_FILES[@]}"; do
  [ -f "$file" ] || stop 2 usage "requirements file $file does not exist"
  unpinned="$(grep -vE '^\s*(#|$)' "$file" | grep -vE '^[A-Za-z0-9._-]+(\[[A-Za-z0-9,._-]+\])?==[^=<>!~]+$' || true)"
  [ -z "$unpinned" ] || stop 2 usage "$file: not pinned with == : $(echo $unpinned)"
done

resolve() {  # resolve <requirements>: can the folder alone satisfy them, for this interpreter?
  "$BASE_PYTHON" -m pip install --dry-run --ignore-installed --quiet --no-index --find-links "$WHEELS" \
    -r "$1" > "$OUT/resolve.log" 2>&1
}
for file in "${REQUIREMENT_FILES[@]}"; do
  if ! resolve "$file"; then
    grep -E "ERROR|No matching|conflict" "$OUT/resolve.log" | head -n 5
    stop 2 wheels "the wheel folder does not satisfy $file for $("$BASE_PYTHON" -V 2>&1) (above; docs/gpu.md)"
  fi
  echo "gpu_check: $WHEELS satisfies $file"
done

PLAN=("tiny model pair" "engines fp32" "engines fp16" "GPU tests" "kernel timings" "engine latency suite fp32"
      "engine latency suite fp16" "bench.py fp32" "bench.py fp16")
[ "$WITH_TENSORRT_LLM" = 1 ] && PLAN+=("TensorRT-LLM target")
if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check: dry run; would install ${REQUIREMENT_FILES[*]} from $WHEELS, then run:"
  printf '  %s\n' "${PLAN[@]}"
  stop 0 dry-run "dry run done: nothing installed, built or run"
fi

# 2. a GPU, before installing gigabytes of CUDA wheels
find_gpu

# 3. install, then the checks; a failed step is recorded and the next ones still run
VENV="$OUT/venv"
step "install" install_env "$VENV" "$REQUIREMENTS" || stop 1 failed "installing from $WHEELS failed (above)"
PY="$VENV/bin/python"
record_versions

# the OpenAI Triton kernels compile for the device (tests/conftest.py defaults to the
# interpreter); the source folders are the `saguaro` namespace package, nothing is installed
device_kernels
PAIR="$OUT/models/tiny"
step "tiny model pair" "$PY" scripts/make_models.py --size tiny --out "$PAIR"
for precision in fp32 fp16; do
  step "engines $precision" "$PY" scripts/build_engines.py --config tiny --backend tensorrt --precision "$precision" \
    --target "$PAIR/target" --draft "$PAIR/draft" --out "$OUT/engines/tiny-$precision" --quiet
done
step "GPU tests" "$PY" -m pytest -q -p no:cacheprovider -p gpu_summary -m gpu --junitxml "$OUT/gpu_tests.xml" \
  tests/test_gpu.py "${PYTEST_ARGS[@]}"
step "kernel timings" "$PY" scripts/bench_kernels.py --json "$OUT/kernels.json"
for precision in fp32 fp16; do
  step "engine latency suite $precision" "$PY" scripts/bench.py --engines "$OUT/engines/tiny-$precision" \
    --engines-only -k 4 --json "$OUT/suite-$precision.json"
  step "bench.py $precision" "$PY" scripts/bench.py --engines "$OUT/engines/tiny-$precision" -k 4 --max-tokens 64 \
    --json "$OUT/bench-$precision.json"
done
if [ "$WITH_TENSORRT_LLM" = 1 ]; then
  step "install TensorRT-LLM" install_env "$OUT/venv-tensorrt-llm" "$LLM_REQUIREMENTS" \
    && step "TensorRT-LLM target" "$OUT/venv-tensorrt-llm/bin/python" -m pytest -q -p no:cacheprovider \
      -p gpu_summary -m tensorrt_llm --junitxml "$OUT/tensorrt_llm_tests.xml" tests/test_tensorrt_llm_target.py
fi

finish
