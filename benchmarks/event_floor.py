"""Host cost of timing one block on the GPU, against the driver's floor measured in the same run.

    python benchmarks/event_floor.py [--rounds 30] [--out results.json]

Rows (host ns per timed block, an empty block on an idle stream):
  C: cuEventRecord x2          the floor: two timing-event records in a C loop (_C.event_floor)
  C: start+stop path           what EventPair.start()+stop() do in C, without Python: context
                               check and current stream twice, one capture check, two records
  EventPair start()+stop()     _C.EventPair(d) made per use, .start(), .stop() from Python
  with a reused Timer          one Timer object used again (its readings then form a series)
  with syncless.timer()        the public timer
  perf_counter pair            two time.perf_counter() calls: no GPU clock at all
One process, interleaved: each round runs every row once, in a shuffled order, a block of 200
uses each, with a synchronize outside the clock between blocks (the launch queue never fills).
Medians over rounds with a 95% confidence interval of the median (order statistics), and each
row's ratio to the floor. Without a GPU only the perf_counter row runs.
"""
import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import median_ci  # noqa: E402  (run as a script from anywhere)

USES = 200


def rows(device: int | None) -> dict:
    clock = time.perf_counter

    def timed(body):
        def run():
            t0 = clock()
            for _ in range(USES):
                body()
            return (clock() - t0) / USES * 1e9
        return run

    def perf_pair():
        t0 = clock()
        clock() - t0

    out = {}
    if device is not None:
        import syncless
        from syncless._torch import _C
        EventPair = _C.EventPair
        reused = syncless.timer(device=device)      # from its second use on, it keeps a series

        def pair_calls():
            p = EventPair(device)
            p.start()
            p.stop()

        def pair_with():
            with reused:
                pass

        def public_timer():
            with syncless.timer():
                pass

        out["C: cuEventRecord x2"] = lambda: _C.event_floor(device, USES)["record_pair"]
        out["C: start+stop path"] = lambda: _C.event_floor(device, USES)["checked_pair"]
        out["EventPair start()+stop()"] = timed(pair_calls)
        out["with a reused timer()"] = timed(pair_with)
        out["with syncless.timer()"] = timed(public_timer)
    out["perf_counter pair"] = timed(perf_pair)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.cuda.current_device() if cuda else None
    table = rows(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for run in table.values():                  # warm-up: JIT, pools, first-use costs
        run()
    sync()
    random.seed(0)
    samples = {name: [] for name in table}
    for _ in range(args.rounds):
        order = list(table)
        random.shuffle(order)
        for name in order:
            samples[name].append(table[name]())
            sync()                              # outside the clock: the stream stays idle
    floor = statistics.median(samples["C: cuEventRecord x2"]) if cuda else None
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "rounds": args.rounds, "uses_per_block": USES,
              "rows": {}}
    print(f"host ns per timed block, {args.rounds} rounds x {USES} uses, "
          f"{result['device']}, torch {torch.__version__}")
    print(f"{'':28s} {'median':>8s} {'95% CI':>17s} {'x floor':>8s}")
    for name, xs in samples.items():
        med = statistics.median(xs)
        ci = median_ci(xs)                       # None with fewer than 6 rounds
        ratio = med / floor if floor else math.nan
        result["rows"][name] = {"median_ns": med, "ci95_ns": list(ci) if ci else None,
                                "x_floor": ratio}
        text = f"[{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "n/a"
        print(f"{name:28s} {med:8.0f} {text:>17s} {ratio:8.2f}")
    if not cuda:
        print("no GPU: only the host clock row ran", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
