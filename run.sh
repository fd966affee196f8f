#!/bin/bash
# GPU job for the frameworks helper: the CUDA tests of syncless.lightning / syncless.hf, then the
# full benchmark (writes benchmarks/results/frameworks.{json,md} into $RESULTS).
set -u
export NCCL_NVLS_ENABLE=0
mkdir -p "$RESULTS"
python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
timeout 60 python3 -m pytest -q -x -rs tests/test_lightning.py tests/test_hf.py -m cuda 2>&1 | tail -25 | tee "$RESULTS/cuda_tests.txt"
echo "cuda tests rc=${PIPESTATUS[0]}"
timeout 170 python3 benchmarks/frameworks.py --out "$RESULTS" 2>&1 | tee "$RESULTS/bench_log.txt" | tail -60
echo "benchmark rc=${PIPESTATUS[0]}"
ls -la "$RESULTS"
