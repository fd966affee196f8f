#!/bin/bash
# GPU job "compile": the CUDA tests of tests/test_compile.py, then benchmarks/compile_step.py.
# Runs from the root of a copy of the worktree; results go to $RESULTS.
set -u
RESULTS=${RESULTS:-/tmp/compile-results}
mkdir -p "$RESULTS"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$RESULTS/probe.txt"
import inspect, torch, syncless, syncless._compile as c
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
print("custom_op", hasattr(torch.library, "custom_op"), "is_dynamo_compiling",
      hasattr(torch.compiler, "is_dynamo_compiling"),
      "disable(reason=)", "reason" in inspect.signature(torch.compiler.disable).parameters)
print("syncless", syncless.__file__)
PY
# CUDA tests only (the CPU ones run in CI); perf_hints names any cudagraph skip.
TORCH_LOGS=perf_hints timeout 60 python3 -m pytest -q -p no:cacheprovider -rs -m cuda \
    tests/test_compile.py > "$RESULTS/tests_full.txt" 2>&1
echo "tests rc=$?"
tail -60 "$RESULTS/tests_full.txt" | cut -c1-400 > "$RESULTS/tests.txt"; tail -25 "$RESULTS/tests.txt"
TORCH_LOGS=perf_hints timeout 80 python3 benchmarks/compile_step.py --rounds 24 --out "$RESULTS" \
    > "$RESULTS/bench_full.txt" 2>&1
echo "bench rc=$?"
grep -i "skipping cudagraphs" "$RESULTS/bench_full.txt" | sort | uniq -c | head -5
grep -v "^\s*$" "$RESULTS/bench_full.txt" | tail -30 | cut -c1-400 > "$RESULTS/bench.txt"; cat "$RESULTS/bench.txt"
echo "=== summary"
tail -3 "$RESULTS/tests.txt"
tail -4 "$RESULTS/bench.txt"
