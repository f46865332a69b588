#!/usr/bin/env bash
# One device-machine session (a GPU node with torch, nvcc, Triton; no vLLM, nothing
# installable, no network): build the CUDA staging ops, check that caller errors raised in
# the library reach Python, run the GPU tests (kernels, and the connector's worker side on
# CUDA KV caches), run the staging benchmark, and — when a wheel is carried in
# .wheelcheck/ — install that wheel and check that its `build-ops` builds a library the
# GPU tests pass against. Logs and the benchmark's JSON go under $OUT.
#
# Python packages the image lacks travel as wheels in .whl/ (pydantic and its deps: the
# core config and metadata models need it; see docs/staging-ops.md).
# Usage (repository root): bash scripts/device_run.sh [quick|tests|ab]
#   quick: the benchmark at 1 and 64 blocks only; tests: no benchmark at all;
#   ab: quick, plus the one-block comparison (public call / pinned copy per page size)
#   of an earlier checkout carried in build/ab-before/ (its hf3fsctl/ and this
#   benchmarks/bench_staging.py; carry it), each in its own process: before, after, before,
#   after, in one session; then this checkout's one-block comparison twice more with
#   1999 blocks per layer (a layer stride that is not a power of two) and on a side stream.
set -uo pipefail
OUT=${OUT:-/tmp/hf3fsctl-device-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=$(command -v python3)
REPO=$PWD
status=0
if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$REPO
else
  export PYTHONPATH=$REPO
fi

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  nvcc --version | tail -2; c++ --version | head -1
  "$PY" -m pip list 2>/dev/null | grep -iE '^(pydantic|xxhash|pyyaml|numpy|fastapi|uvicorn|httpx|typer|rich|pytest|redis|prometheus.client) '
} 2>&1 | tee "$OUT/env.log"

echo "== build"
OPS=/tmp/ops-cuda
"$PY" -m hf3fsctl.ops.build --cpu --out /tmp/ops-cpu --force > "$OUT/build.log" 2>&1 &
"$PY" -m hf3fsctl.ops.build --cpu --no-openmp --out /tmp/ops-cpu-serial --force >> "$OUT/build.log" 2>&1 &
if [ "${1:-}" = ab ]; then
  (cd build/ab-before && PYTHONPATH=/tmp/site:$REPO/build/ab-before \
    "$PY" -m hf3fsctl.ops.build --cuda --out /tmp/ops-before --force > "$OUT/build-before.log" 2>&1) &
fi
if ! "$PY" -m hf3fsctl.ops.build --cuda --out $OPS --force >> "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED"; tail -30 "$OUT/build.log"; status=1
fi
wait
export HF3FSCTL_OPS_LIB=$OPS/_ops.so
grep -E "^built|error" "$OUT/build.log"
cuobjdump --dump-sass $OPS/_ops.so 2>/dev/null \
  | grep -oE '(LDG|STG|LDL|STL)[.A-Z0-9]*' | sort | uniq -c > "$OUT/sass.txt" || true
cuobjdump --dump-resource-usage $OPS/_ops.so 2>/dev/null | grep -oE 'REG:[0-9]+|STACK:[0-9]+|LOCAL:[0-9]+' \
  | sort | uniq -c >> "$OUT/sass.txt" || true
cat "$OUT/sass.txt"

echo "== throw check"
for lib in $OPS/_ops.so:cpu $OPS/_ops.so:cuda /tmp/ops-cpu/_ops.so:cpu \
           /tmp/ops-cpu-serial/_ops.so:cpu; do
  timeout 60 "$PY" scripts/ops_throw_check.py "${lib%%:*}" "${lib##*:}" > /tmp/throw.txt 2>&1
  echo "$lib rc=$? $(tail -1 /tmp/throw.txt)"
done 2>&1 | tee "$OUT/throw.log"

echo "== tests (by path: other areas' tests need what this machine lacks)"
"$PY" -m pytest -q tests/gpu/test_staging_cuda.py tests/gpu/test_worker_cuda.py tests/gpu/test_worker_cuda_hybrid.py \
  tests/unit/test_staging.py tests/unit/test_staging_kernels.py -p no:cacheprovider \
  -rfE 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR|[0-9]+ passed)|passed|failed" || status=1

if [ "${1:-}" = tests ]; then
  echo "== benchmark skipped"
elif [ "${1:-}" = quick ]; then bench_args=(--blocks 1 64 --roundtrip-blocks 0)
elif [ "${1:-}" = ab ]; then bench_args=(--blocks 1 64 --roundtrip-blocks 0); else
  bench_args=(--chunk-sweep 16384 65536 --roundtrip-blocks 64); fi
[ "${1:-}" = tests ] || "$PY" benchmarks/bench_staging.py --out "$OUT/bench.json" --storage-dir /tmp "${bench_args[@]}" \
  > "$OUT/bench.log" 2>&1 || status=1
[ "${1:-}" = tests ] || "$PY" - "$OUT/bench.json" <<'EOF' || status=1
import json, sys
doc = json.load(open(sys.argv[1]))
print("geometry op blocks variant ms GB/s of_PCIe time/copy")
for r in doc["results"]:
    if r["variant"] in ("loop", "torch", "device"):
        continue
    c = doc["ceilings"][r["ceiling"]]
    pcie = c["pcie_d2h" if r["op"] == "gather" else "pcie_h2d"]
    print(r["geometry"], r["op"], r["blocks"], r["variant"], f"{r['median_ms']:.3f}",
          f"{r['gbps']:.1f}", f"{r['gbps'] / pcie:.2f}", f"{pcie / r['gbps']:.2f}")
print("roundtrip", doc.get("roundtrip"))
EOF

if [ "${1:-}" = ab ]; then
  echo "== one block, each its own process: before, after, before, after"
  grep -E "^built|error" "$OUT/build-before.log"
  for i in 1 2; do
    HF3FSCTL_OPS_LIB=/tmp/ops-before/_ops.so PYTHONPATH=/tmp/site:$REPO/build/ab-before "$PY" \
      build/ab-before/benchmarks/bench_staging.py --only-one-block --out "$OUT/one-before$i.json" \
      > "$OUT/one-before$i.log" 2>&1 || status=1
    "$PY" benchmarks/bench_staging.py --only-one-block --out "$OUT/one-after$i.json" \
      > "$OUT/one-after$i.log" 2>&1 || status=1
  done
  for i in 1 2; do
    "$PY" benchmarks/bench_staging.py --only-one-block --one-block-cache-blocks 1999 \
      --out "$OUT/one-odd$i.json" > "$OUT/one-odd$i.log" 2>&1 || status=1
    "$PY" benchmarks/bench_staging.py --only-one-block --side-stream \
      --out "$OUT/one-side$i.json" > "$OUT/one-side$i.log" 2>&1 || status=1
  done
  "$PY" - "$OUT" <<'EOF' || status=1
import json, sys
print("run geometry KiB | copy_us g/s | call_us g/s | call/copy g/s | host_us copy/call_g/call_s/is_pinned")
for label in ("before1", "after1", "before2", "after2", "odd1", "odd2", "side1", "side2"):
    for r in json.load(open(f"{sys.argv[1]}/one-{label}.json")).get("one_block", []):
        m, c, h = r["median_us"], r["call_over_copy"], r["host_us"]
        print(label, r["geometry"], r["bytes"] // 1024, f"| {m['copy/g']:.1f}/{m['copy/s']:.1f}",
              f"| {m['call/g']:.1f}/{m['call/s']:.1f}", f"| {c['gather']:.2f}/{c['scatter']:.2f}",
              f"| {h['copy_gather']:.1f}/{h['call_gather']:.1f}/{h['call_scatter']:.1f}/{h['is_pinned']:.1f}",
              "" if r.get("verified", True) else "| WRONG BYTES")
EOF
fi

if ls .wheelcheck/*.whl > /dev/null 2>&1; then
  echo "== wheel: install, build-ops from the installed package, GPU tests against that build"
  rm -rf /tmp/w ~/.cache/hf3fsctl
  "$PY" -m pip install -q --no-deps --no-compile --target /tmp/w .wheelcheck/*.whl || status=1
  (
    cd /tmp && unset HF3FSCTL_OPS_LIB && export PYTHONPATH=/tmp/w:/tmp/site
    "$PY" -P -m hf3fsctl build-ops 2>&1 | tail -5 || "$PY" -P -m hf3fsctl.ops.build --cuda 2>&1 | tail -5
    find ~/.cache/hf3fsctl -name '_ops.so'
    cd "$REPO" && "$PY" -P -c 'import hf3fsctl.staging as s; print(s.__file__, sorted(s.load_compiled_ops()))'
    "$PY" -P -m pytest -q tests/gpu/test_staging_cuda.py tests/gpu/test_worker_cuda.py \
      -p no:cacheprovider -rfE 2>&1 | tee /tmp/wheel-tests.log | grep -E "^(FAILED|ERROR)|passed|failed"
  ) 2>&1 | tee "$OUT/wheel.log" || status=1
  cat /tmp/wheel-tests.log >> "$OUT/wheel.log"
fi
exit $status
