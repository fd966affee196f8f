#!/usr/bin/env bash
# On the GPU machine: build, run the cuda-marked tests named in $TESTS (default: all), then the
# benchmarks named in $BENCH (module names, e.g. "benchmarks.percall benchmarks.adapters"). Logs and results land in $OUT (the device tool's folder) if set.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/syncless-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "running pip as the 'root'" | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest ${TESTS:-tests} -m cuda --run-slow -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest-cuda.log" | tail -40
RES=/tmp/syncless-results
mkdir -p "$RES"
for b in $BENCH; do
  echo "== $b"
  python3 -m "$b" --out "$RES" 2>&1 | tee -a "$OUT/bench.log"
done
# The device tool brings back at most 8 files: pack the results.
tar czf "$OUT/results.tgz" -C "$RES" .
