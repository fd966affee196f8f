#!/bin/bash
# GPU job for the doctor helper: the corpus runner, then the doctor's CUDA tests if time is left.
set -u
export NCCL_NVLS_ENABLE=0
START=$(date +%s)
RESULTS=${RESULTS:-/tmp/results}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$RESULTS/gpu.txt" 2>&1
timeout 215 python3 benchmarks/doctor_corpus.py --device cuda --out "$RESULTS" --timeout 70 \
    > "$RESULTS/corpus_log.txt" 2>&1
echo "corpus rc=$? after $(( $(date +%s) - START )) s"
LEFT=$(( 272 - ($(date +%s) - START) ))
if [ "$LEFT" -gt 25 ]; then
    timeout "$LEFT" python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_monitor.py \
        tests/test_doctor.py > "$RESULTS/pytest_cuda.txt" 2>&1
    echo "pytest rc=$?"
    tail -15 "$RESULTS/pytest_cuda.txt"
fi
grep -E "^\[|scripts meet" "$RESULTS/corpus_log.txt" | cut -c1-400
