"""Host microseconds per timed block (enter + exit), syncless.timer() against the usual ways.

    python benchmarks/timer_overhead.py [--out [DIR]] [--rounds 50]

Every method times an empty block; the number is what the timer itself costs the host:
  syncless.timer()         `with syncless.timer():` two pooled events on the current stream
  syncless.timer(name)     the same, also aggregated under a name (with its batched reads)
  Event pair, new          torch.cuda.Event(enable_timing=True) x2, .record() x2 (hand-written)
  Event pair, reused       .record() x2 on events made beforehand
  synchronize+perf_counter torch.cuda.synchronize(), perf_counter(), ..., the same again
  perf_counter pair        the floor: two perf_counter() calls, no GPU clock at all
One process, interleaved: each round runs every method once in a shuffled order, a block of
200 uses each, with a synchronize outside the clock between blocks (the queue never fills).
Medians over rounds, p10-p90 beside them, ratios against syncless.timer(). Without a GPU only
the CPU clock rows run. --out writes timer_overhead.json and timer_overhead.md (default
directory: benchmarks/results). The default run takes a few seconds.
"""
import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

USES = 200


def methods(cuda: bool) -> dict:
    from syncless.timer import timer

    clock = time.perf_counter
    out = {}
    if cuda:
        reused = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(USES)]

        def syncless_timer(i):
            with timer():
                pass

        def syncless_named(i):
            with timer("timer_overhead"):
                pass

        def event_pair_new(i):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            end.record()

        def event_pair_reused(i):
            start, end = reused[i]
            start.record()
            end.record()

        def synchronize(i):
            torch.cuda.synchronize()
            t0 = clock()
            torch.cuda.synchronize()
            clock() - t0

        out.update({"syncless.timer()": syncless_timer, "syncless.timer(name)": syncless_named,
                    "Event pair, new": event_pair_new, "Event pair, reused": event_pair_reused,
                    "synchronize+perf_counter": synchronize})

    def syncless_cpu(i):
        with timer(device="cpu"):
            pass

    def floor(i):
        t0 = clock()
        clock() - t0

    out.update({"syncless.timer(device='cpu')": syncless_cpu, "perf_counter pair": floor})
    return out


def time_block(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(USES):
        fn(i)
    t1 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    return (t1 - t0) / USES * 1e6


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", nargs="?", const=os.path.join(here, "results"),
                        help="directory for timer_overhead.json/.md (default benchmarks/results)")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    import syncless
    from syncless.timer import timers

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
    else:
        print("no CUDA GPU: only the CPU clock rows run", file=sys.stderr)
    fns = methods(cuda)
    rng = random.Random(0)
    for fn in fns.values():                       # warm-up: the event pool, torch's event cache
        time_block(fn, cuda)
    samples = {name: [] for name in fns}
    for _ in range(args.rounds):
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            samples[name].append(time_block(fns[name], cuda))
    timers.reset("timer_overhead")

    ref_name = "syncless.timer()" if cuda else "syncless.timer(device='cpu')"
    results = {}
    for name, v in samples.items():
        v = sorted(v)
        results[name] = {"median_us": statistics.median(v), "p10_us": v[len(v) // 10],
                         "p90_us": v[len(v) * 9 // 10]}
    ref = results[ref_name]["median_us"]
    for r in results.values():
        r["vs_syncless"] = r["median_us"] / ref

    lines = ["| method | µs per enter+exit, median (p10–p90) | × syncless.timer() |",
             "|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['median_us']:.2f} ({r['p10_us']:.2f}–{r['p90_us']:.2f}) | "
                     f"{r['vs_syncless']:.2f}× |")
    table = "\n".join(lines)
    verdict = [f"{ref_name}: {ref:.2f} µs per enter+exit" + (" (target ≤ 3 µs)" if cuda else "")]
    if cuda:
        for name in ("Event pair, new", "Event pair, reused", "synchronize+perf_counter"):
            verdict.append(f"{name} / syncless.timer(): {results[name]['vs_syncless']:.2f}×")
    print(table)
    print("\n".join(verdict))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env = {"gpu": torch.cuda.get_device_name() if cuda else "none (CPU only)",
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "driver": syncless._C.driver_version() if cuda else None,
               "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "uses_per_block": USES, "rounds": args.rounds}
        with open(os.path.join(args.out, "timer_overhead.json"), "w") as f:
            json.dump({"env": env, "results": results, "verdict": verdict}, f, indent=1)
        with open(os.path.join(args.out, "timer_overhead.md"), "w") as f:
            f.write(f"# timer overhead — {env['gpu']}, torch {env['torch']}, {env['date']}\n\n"
                    f"Host µs per enter+exit of an empty timed block, median over {args.rounds} "
                    f"interleaved rounds of {USES} uses (`{env['command']}`).\n\n{table}\n\n"
                    + "\n".join(f"- {v}" for v in verdict) + "\n")


if __name__ == "__main__":
    main()
