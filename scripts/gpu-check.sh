#!/usr/bin/env bash
# GPU memory end to end (issue 28), on a GPU machine without network or Rust, from what
# scripts/gpu-prepare.sh built on a CPU machine (.gpu/: the wheel and the test binaries).
#
#   bash scripts/gpu-check.sh            # from the checkout root, with .gpu/ carried along
#
# Needs: one NVIDIA GPU and its driver, python3 with torch (CUDA) installed. Installs nothing outside
# .gpu/ (the wheel goes into .gpu/site with pip --no-deps --no-index --target). Every step is bounded
# with `timeout`, prints what it finds, and a failing step does not stop the independent ones after
# it; the last lines are a summary table. Optional steps are skipped when the run nears its budget
# (KVXFER_GPU_BUDGET_S, default 420 s): the required steps are bounded by 420 s in all, the whole run by
# about 7.5 minutes. Expected: 3-5 minutes. Exit status: number of failed steps.
#
# Environment: PYTHON (default python3: the one with torch), KVXFER_GPU_DIR (default .gpu),
# KVXFER_GPU_XFER_ARGS (extra arguments for scripts/gpu_xfer.py, e.g. "--layers 8").
set -uo pipefail
cd "$(dirname "$0")/.."
G=${KVXFER_GPU_DIR:-.gpu}
PY=${PYTHON:-python3}
BUDGET=${KVXFER_GPU_BUDGET_S:-420}
mkdir -p "$G/logs"
G=$(cd "$G" && pwd)
LOGS="$G/logs"
T0=$(date +%s)
declare -a SUMMARY
FAILED=0

elapsed() { echo $(($(date +%s) - T0)); }

# run NAME LIMIT_S [optional] -- CMD...: runs CMD bounded by LIMIT_S, output to the terminal and to
# $LOGS/NAME.log, records the outcome. An optional step is skipped when the budget would be exceeded.
run() {
  local name=$1 limit=$2 optional=$3
  shift 4
  if [ "$optional" = optional ] && [ $(($(elapsed) + limit)) -gt "$BUDGET" ]; then
    printf '\n=== %s: SKIPPED (%ss elapsed, limit %ss would pass the budget of %ss)\n' "$name" "$(elapsed)" "$limit" "$BUDGET"
    SUMMARY+=("$(printf '%-26s %-8s %6s' "$name" skipped -)")
    return 0
  fi
  printf '\n=== %s (limit %ss, %ss elapsed): %s\n' "$name" "$limit" "$(elapsed)" "$*"
  local s rc
  s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$(($(date +%s) - s)) verdict=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    verdict="TIMEOUT"
  elif [ "$rc" != 0 ]; then
    verdict="FAIL($rc)"
  fi
  [ "$verdict" = ok ] || FAILED=$((FAILED + 1))
  printf '=== %s: %s in %ss\n' "$name" "$verdict" "$took"
  SUMMARY+=("$(printf '%-26s %-8s %5ss' "$name" "$verdict" "$took")")
}

echo "=== gpu-check $(date -u +%FT%TZ) on $(hostname) ($(uname -srm)), budget ${BUDGET}s"
[ -f "$G/BUILD" ] && cat "$G/BUILD" || echo "WARNING: $G/BUILD missing: was scripts/gpu-prepare.sh run and $G carried?"
ls -l "$G"/wheel "$G"/bin 2>&1

run environment 30 required -- bash -c '
  echo "--- nvidia-smi"; timeout 20 nvidia-smi || echo "nvidia-smi failed or missing"
  echo "--- nvidia-smi topo / driver"; timeout 10 nvidia-smi -q 2>/dev/null | grep -E "Driver Version|CUDA Version|Product Name|Persistence|Compute Mode|MIG Mode" | head -20
  echo "--- libcuda"; ldconfig -p 2>/dev/null | grep -E "libcuda\.so" || echo "libcuda not in the loader cache"
  echo "--- kernel modules"; lsmod 2>/dev/null | grep -E "^nvidia|peermem" || true
  echo "--- glibc"; ldd --version 2>/dev/null | head -1
  echo "--- env"; env | grep -E "^(CUDA|NVIDIA|PYTORCH|LD_LIBRARY)" || true
  echo "--- python/torch"; '"$PY"' -c "import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), \"devices\", torch.cuda.device_count()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\")"
  echo "--- memory"; free -g; nproc'

# The wheel goes into .gpu/site: no network, no dependencies, nothing installed system-wide.
run install-wheel 45 required -- bash -c '
  rm -rf "'"$G"'/site" && "'"$PY"'" -m pip install --no-deps --no-index --no-compile --disable-pip-version-check \
    --target "'"$G"'/site" "'"$G"'"/wheel/kvxfer-*.whl &&
  PYTHONPATH="'"$G"'/site" "'"$PY"'" -c "import kvxfer; print(\"kvxfer\", kvxfer.__version__, \"backends\", kvxfer.backends(), \"from\", kvxfer.__file__)" &&
  if ! "'"$PY"'" -c "import pytest" 2>/dev/null; then
    echo "pytest missing: installing the carried wheels" &&
    "'"$PY"'" -m pip install --no-index --no-compile --disable-pip-version-check --find-links "'"$G"'/deps" \
      --target "'"$G"'/site" pytest
  fi'
export PYTHONPATH="$G/site${PYTHONPATH:+:$PYTHONPATH}"
# CUDA IPC needs legacy handles: PyTorch's expandable segments have none.
unset PYTORCH_CUDA_ALLOC_CONF
export KVXFER_TEST_CUDA=real RUST_BACKTRACE=1 KVXFER_LOG=${KVXFER_LOG:-warn}

run cuda-driver 45 required -- "$G/bin/cuda-driver" --nocapture --test-threads=1

run gpu-xfer 180 required -- "$PY" scripts/gpu_xfer.py --timeout 165 --json "$LOGS/gpu_xfer.json" ${KVXFER_GPU_XFER_ARGS:-}

# The copy kernel (crates/cuda/src/kernel.rs, off by default until this passes on a GPU): the cuda-ipc
# transfers, every byte checked, beside the default path's figures above; then its conformance suite.
run gpu-xfer-kernel 60 required -- env KVXFER_CUDA_COPY_KERNEL=1 "$PY" scripts/gpu_xfer.py --timeout 50 \
  --configs cuda-ipc/cuda --json "$LOGS/gpu_xfer_kernel.json"
run conformance-cuda-ipc-kernel 120 required -- env KVXFER_CUDA_COPY_KERNEL=1 "$G/bin/conformance-cuda-ipc" \
  --test-threads=8 --quiet

run conformance-cuda-ipc 120 required -- "$G/bin/conformance-cuda-ipc" --test-threads=8 --quiet

# From inside python/tests, so the installed wheel is what is tested (not the source tree).
run pytest-gpu 120 optional -- bash -c 'cd python/tests && "$0" -m pytest -q -p no:cacheprovider -rs test_gpu.py' "$PY"

run conformance-tcp-cuda 100 optional -- "$G/bin/conformance-tcp-cuda" --test-threads=8 --quiet

run conformance-local-cuda 60 optional -- "$G/bin/conformance-local-cuda" --test-threads=8 --quiet

echo
echo "=== gpu-check summary ($(elapsed)s, $FAILED failed; logs in $LOGS/)"
printf '%s\n' "${SUMMARY[@]}"
grep -h "summary:" "$LOGS"/conformance-*.log 2>/dev/null
echo "--- gpu_xfer"
sed -n '/^==== gpu_xfer/,$p' "$LOGS/gpu-xfer.log" 2>/dev/null | grep -v '^\[' | head -40
echo "--- gpu_xfer, cuda-ipc with the copy kernel on (KVXFER_CUDA_COPY_KERNEL=1)"
sed -n '/^==== gpu_xfer/,$p' "$LOGS/gpu-xfer-kernel.log" 2>/dev/null | grep -E "cuda-ipc|OK|WRONG" | head -6
grep -h "^ERROR\|WRONG BYTES\|panicked" "$LOGS"/*.log 2>/dev/null | head -20
# The device runner brings back what is under $OUT: every log and the measurements.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  # One archive: the runner brings back at most 8 files.
  tar czf "$OUT/gpu-check-logs.tgz" -C "$G" logs && echo "logs archived to \$OUT/gpu-check-logs.tgz"
fi
exit "$FAILED"
