#!/usr/bin/env bash
# One device-machine session: build the CUDA staging ops, check that caller errors raised
# in the library reach Python (per build variant), run the GPU and staging tests, run the
# staging benchmark. Logs and the benchmark's JSON go under $OUT (default /tmp/...).
# Usage (repository root): bash scripts/device_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/hf3fsctl-device-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=$(command -v python3)
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  nvcc --version | tail -2; c++ --version | head -1
  ls "$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib" | grep -i gomp
} 2>&1 | tee "$OUT/env.log"

echo "== build"
"$PY" -m hf3fsctl.ops.build --cpu --out /tmp/ops-cpu > "$OUT/build.log" 2>&1 &
"$PY" -m hf3fsctl.ops.build --cpu --no-openmp --out /tmp/ops-cpu-serial >> "$OUT/build.log" 2>&1 &
if ! "$PY" -m hf3fsctl.ops.build --cuda >> "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED"; status=1
fi
wait
grep -E "^built|error" "$OUT/build.log"
cuobjdump --dump-sass hf3fsctl/_ops.so 2>/dev/null \
  | grep -oE '(LDG|STG)[.A-Z0-9]*' | sort | uniq -c > "$OUT/sass.txt" || true

echo "== throw check"
for lib in hf3fsctl/_ops.so:cpu hf3fsctl/_ops.so:cuda /tmp/ops-cpu/_ops.so:cpu \
           /tmp/ops-cpu-serial/_ops.so:cpu; do
  timeout 60 "$PY" scripts/ops_throw_check.py "${lib%%:*}" "${lib##*:}" > /tmp/throw.txt 2>&1
  echo "$lib rc=$? $(tail -1 /tmp/throw.txt)"
done 2>&1 | tee "$OUT/throw.log"
if grep -q "rc=1[0-9][0-9]" "$OUT/throw.log"; then
  timeout 150 cuda-gdb -batch -ex run -ex bt --args "$PY" scripts/ops_throw_check.py hf3fsctl/_ops.so cpu \
    > "$OUT/gdb.log" 2>&1
  grep -E "^#[0-9]+" "$OUT/gdb.log" | head -30
fi

echo "== tests"
"$PY" -m pytest -q tests/gpu tests/unit/test_staging.py tests/unit/test_staging_kernels.py \
  -p no:cacheprovider -k "not rejects" 2>&1 | tee "$OUT/tests.log" | tail -15 || status=1
"$PY" -m pytest -q tests/unit/test_staging_kernels.py -p no:cacheprovider -k rejects 2>&1 \
  | tee -a "$OUT/tests.log" | grep -vE '^  File' | tail -15 || status=1

echo "== benchmark (second timing of the same build)"
"$PY" benchmarks/bench_staging.py --out "$OUT/bench.json" --roundtrip-blocks 64 \
  --storage-dir /tmp 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
