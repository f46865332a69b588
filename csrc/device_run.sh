#!/usr/bin/env bash
# One device-machine session: build the CUDA staging ops, run the GPU and staging tests,
# run the staging benchmark. Logs and the benchmark's JSON go under $OUT (default /tmp/...).
# Usage (repository root): bash csrc/device_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/hf3fsctl-device-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=$(command -v python3)
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  nvcc --version | tail -2
  "$PY" -m pip show pytest-timeout 2>/dev/null | head -2
} 2>&1 | tee "$OUT/env.log"

echo "== build"
if ! "$PY" csrc/build.py --cuda 2>&1 | tee "$OUT/build.log"; then
  echo "BUILD FAILED"; status=1
fi
cuobjdump --dump-sass hf3fsctl/_ops.so 2>/dev/null \
  | grep -oE '(LDG|STG)[.A-Z0-9]*' | sort | uniq -c > "$OUT/sass.txt" || true
cat "$OUT/sass.txt"

echo "== tests"
"$PY" -m pytest -q tests/gpu tests/unit/test_staging.py tests/unit/test_staging_kernels.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1

echo "== benchmark"
"$PY" benchmarks/bench_staging.py --out "$OUT/bench.json" --storage-dir /tmp 2>&1 \
  | tee "$OUT/bench.log" || status=1
exit $status
