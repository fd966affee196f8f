"""What running the sinks' calls whole costs delivery="caller" (issue 36): on the main thread a
sink's write() runs on a helper thread while the loop waits for it (python/syncless/_whole.py),
one hand-over between two threads per sink call, where before the loop called the sink itself.

    python -m benchmarks.caller_whole --baseline DIR [--rounds 9] [--calls 200000] [--out [DIR]]

DIR is another checkout's python/ folder (built in place). Each round runs one worker process per
build and per `every` (interleaved, the first build alternating), each timing `calls` log() calls
of one host float on a CPU Logger(delivery="caller") with a sink that keeps the rows, then
close(). Per-call time: medians over rounds, and the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = """
import gc, sys, time, syncless
every, calls = int(sys.argv[1]), int(sys.argv[2])
class Keep:
    def __init__(self):
        self.n = 0
    def write(self, rows):
        self.n += len(rows)
sink = Keep()
log = syncless.Logger(every=every, sinks=[sink], delivery="caller", max_delay=None)
for i in range(2000):
    log(x=1.0)
gc.disable()
t, c = time.perf_counter(), time.process_time()
for i in range(calls):
    log(x=1.0)
dt, dc = time.perf_counter() - t, time.process_time() - c
log.close()
assert sink.n == calls + 2000, sink.n
print(dt / calls * 1e9, dc / calls * 1e9)
"""


def _one(tree: str, every: int, calls: int) -> tuple[float, float]:
    """(wall, CPU) ns per call; CPU: the process's, both threads, robust to a loaded host."""
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", WORKER, str(every), str(calls)], env=env,
                         capture_output=True, text=True, check=True)
    wall, cpu = out.stdout.split()[-2:]
    return float(wall), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--out", nargs="?", const=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args()
    trees = {"current": os.path.join(ROOT, "python"), "baseline": a.baseline}
    res: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for every in (10, 100):
        res[str(every)] = {"current": [], "baseline": []}
        for r in range(a.rounds):
            order = ["current", "baseline"] if r % 2 == 0 else ["baseline", "current"]
            for name in order:
                res[str(every)][name].append(_one(trees[name], every, a.calls))
    lines = ["| every | clock | baseline ns/call | current ns/call | current/baseline: median "
             "of per-round ratios [min, max] |", "|---|---|---|---|---|"]
    for label, d in res.items():
        for k, clock in enumerate(("wall", "CPU")):
            b = [x[k] for x in d["baseline"]]
            c = [x[k] for x in d["current"]]
            ratios = [x / y for x, y in zip(c, b)]
            lines.append(f"| {label} | {clock} | {statistics.median(b):.0f} | "
                         f"{statistics.median(c):.0f} | {statistics.median(ratios):.3f} "
                         f"[{min(ratios):.3f}, {max(ratios):.3f}] |")
    print("\n".join(lines))
    if a.out:
        with open(os.path.join(a.out, "caller_whole.json"), "w") as f:
            json.dump({"rounds": a.rounds, "calls": a.calls, "ns_per_call": res}, f, indent=1)
        with open(os.path.join(a.out, "caller_whole.md"), "w") as f:
            f.write(f"# caller_whole: {a.rounds} interleaved rounds, {a.calls} calls each, CPU "
                    "host floats, one sink\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
