#!/bin/bash
# GPU job "compile" (2nd): the CUDA tests of tests/test_compile.py, a look at where inductor puts
# the op in a reduce-overhead training graph, then benchmarks/compile_step.py. Results in $RESULTS.
set -u
RESULTS=${RESULTS:-/tmp/compile-results}
mkdir -p "$RESULTS"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$RESULTS/probe.txt"
import inspect, torch, syncless
import torch._inductor.config as ic
print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
print("graph_partition", getattr(ic, "graph_partition", None), "cudagraph_trees", ic.triton.cudagraph_trees)
PY
# CUDA tests only (the CPU ones run in CI).
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_compile.py \
    > "$RESULTS/tests_full.txt" 2>&1
echo "tests rc=$?"
grep -v "^DEBUG" "$RESULTS/tests_full.txt" | tail -60 | cut -c1-300 > "$RESULTS/tests.txt"
tail -15 "$RESULTS/tests.txt"
# Where is syncless.log in the generated code of a reduce-overhead training forward?
TORCH_LOGS=output_code timeout 40 python3 - > "$RESULTS/output_code.txt" 2>&1 <<'PY'
import torch, syncless
from torch._dynamo.utils import counters
log = syncless.Logger(every=50)
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).cuda()
def fwd(x, y):
    logits = m(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    log(loss=loss, acc=(logits.argmax(1) == y).float().mean(), lr=0.01)
    return loss
f = torch.compile(fwd, mode="reduce-overhead")
x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
for i in range(20):
    torch.compiler.cudagraph_mark_step_begin()
    f(x, y).backward()
torch.cuda.synchronize()
print("PROBE host log() calls", log.stats.steps, "for 20 steps; captured", log._gen.captured,
      "skips", counters["inductor"]["cudagraph_skips"])
log.close()
print("PROBE rows", log.stats.delivered, "lost", log.stats.lost)
PY
echo "probe rc=$?"
grep -n "PROBE\|partitions\[\|def partition_\|syncless.log\|skipping cudagraph\|def call" \
    "$RESULTS/output_code.txt" | cut -c1-220 | head -30
gzip -f "$RESULTS/output_code.txt"
timeout 80 python3 benchmarks/compile_step.py --rounds 30 --steps 50 --out "$RESULTS" \
    > "$RESULTS/bench_full.txt" 2>&1
echo "bench rc=$?"
grep -v "^\s*$" "$RESULTS/bench_full.txt" | grep -v "UserWarning\|warnings.warn" | tail -32 \
    | cut -c1-400 > "$RESULTS/bench.txt"
cat "$RESULTS/bench.txt"
python3 -c "
import json; d = json.load(open('$RESULTS/compile_step.json'))
for k, s in d['sections'].items(): print(k, 'cudagraph trees', s['cudagraph_trees'])"
echo "=== summary"
tail -2 "$RESULTS/tests.txt"
tail -3 "$RESULTS/bench.txt"
