"""CPU microseconds per log() call, syncless against the pure-PyTorch ways of keeping metrics.

    python benchmarks/log_overhead.py [--out benchmarks/results] [--rounds 30]

For K = 1, 4, 16, 64 CUDA scalars, in one process, interleaved round by round (each round runs
every method once, in a shuffled order), medians over rounds:
  syncless      log.log({...})                      one gather launch, no sync
  stack+copy_   ring[i].copy_(torch.stack(ms))      a GPU ring written with torch ops
  copy_ each    ring[i, j].copy_(m) per metric      K copy launches
  .item() each  m.item() per metric                 K syncs (what most loops do)
  floor         x.zero_()                           one bare torch kernel launch
A timed block is 200 calls with the GPU idle at its start, then a synchronize outside the clock,
so the queue never fills and the number is the host's cost of the call itself.
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

CALLS = 200
KS = (1, 4, 16, 64)


def make_methods(k, metrics, log):
    names = [f"m{i}" for i in range(k)]
    ring = torch.zeros(CALLS, k, device="cuda")
    floor_t = torch.zeros((), device="cuda")

    # Each method gets its container ready-made (the dict, the list): the number is the cost of
    # the library call itself, as a loop that already has its metrics at hand pays it.
    as_dict = dict(zip(names, metrics))

    def syncless_call(i):
        log.log(as_dict)

    def stack_copy(i):
        ring[i].copy_(torch.stack(metrics))

    def copy_each(i):
        row = ring[i]
        for j, m in enumerate(metrics):
            row[j].copy_(m)

    def item_each(i):
        for m in metrics:
            m.item()

    def floor(i):
        floor_t.zero_()

    return {"syncless": syncless_call, "stack+copy_": stack_copy, "copy_ each": copy_each,
            ".item() each": item_each, "floor (1 launch)": floor}


def time_block(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(CALLS):
        fn(i)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / CALLS * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for the JSON and markdown results")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("log_overhead needs a CUDA GPU")
    import syncless

    random.seed(0)
    results = {}
    for k in KS:
        metrics = [torch.randn((), device="cuda") for _ in range(k)]
        log = syncless.Logger(every=100, device="cuda")
        methods = make_methods(k, metrics, log)
        for fn in methods.values():                                # warm-up: JIT, allocator
            time_block(fn)
        samples = {name: [] for name in methods}
        for _ in range(args.rounds):
            order = list(methods)
            random.shuffle(order)
            for name in order:
                samples[name].append(time_block(methods[name]))
        log.close()
        results[k] = {name: {"median_us": statistics.median(v),
                             "p10_us": sorted(v)[len(v) // 10],
                             "p90_us": sorted(v)[len(v) * 9 // 10]}
                      for name, v in samples.items()}

    names = list(results[KS[0]])
    lines = ["| method | " + " | ".join(f"K={k} µs (p10–p90)" for k in KS) + " |",
             "|---|" + "---|" * len(KS)]
    for name in names:
        cells = [f"{results[k][name]['median_us']:.2f} ({results[k][name]['p10_us']:.1f}–"
                 f"{results[k][name]['p90_us']:.1f})" for k in KS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    sl = {k: results[k]["syncless"]["median_us"] for k in KS}
    ratio_stack = results[4]["stack+copy_"]["median_us"] / sl[4]
    ratio_item = results[4][".item() each"]["median_us"] / sl[4]
    verdict = [
        f"syncless at K=4: {sl[4]:.2f} µs per call (target ≤ 5 µs)",
        f"stack+copy_ / syncless at K=4: {ratio_stack:.1f}× (target ≥ 5×)",
        f".item() each / syncless at K=4: {ratio_item:.1f}×",
        f"syncless K=64 / K=4: {sl[64] / sl[4]:.2f}× (target ≤ 2×)",
    ]
    table = "\n".join(lines)
    print(table)
    print("\n".join(verdict))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "driver": syncless._C.driver_version(),
               "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "calls_per_block": CALLS, "rounds": args.rounds}
        with open(os.path.join(args.out, "log_overhead.json"), "w") as f:
            json.dump({"env": env, "results": results, "verdict": verdict}, f, indent=1)
        with open(os.path.join(args.out, "log_overhead.md"), "w") as f:
            f.write(f"# log() overhead — {env['gpu']}, torch {env['torch']}, {env['date']}\n\n"
                    f"CPU µs per call, median over {args.rounds} interleaved rounds of "
                    f"{CALLS} calls (`{env['command']}`).\n\n{table}\n\n" +
                    "\n".join(f"- {v}" for v in verdict) + "\n")


if __name__ == "__main__":
    main()
