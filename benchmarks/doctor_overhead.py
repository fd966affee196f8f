"""Always-on cost of syncless.watch(): the same training loop bare and watched, interleaved.

Three steps: a GPU-bound MLP step (a few ms), a launch-bound batch-1 step (about 2 ms, the worst
realistic case for a per-step monitor), and a "step" of one tiny kernel (20x the steps per
block), where the monitor's own host cost per step shows with little noise: the µs it adds there
is what any CPU-bound step pays. Variants: the bare loop; watch() as shipped (the GPU timed on a
sample of steps sized to the step time); watch(gpu_every=1) (every step GPU-timed: two event
records and a poll per step); watch(gpu=False) (no events: the Python cost alone); watch()
feeding a Logger a row per step. Each round times the steps
of every variant between two synchronize() calls (drain() of the GPU times is inside the timing);
the order of the variants is shuffled every round. Reported: median ms/step per variant, the
median of the per-round ratio to the bare loop with its 95% confidence interval, the added µs
per step, and how many steps were GPU-timed. The target is <= 1% of the step.

    python benchmarks/doctor_overhead.py [--device cuda] [--rounds 30] [--steps 100] [--json out]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time

import torch
from torch import nn

from syncless import Logger, sinks
from syncless.doctor import watch

try:
    from benchmarks._common import median_ci, paired_ratios
except ImportError:                                   # run as a script: benchmarks/ is on path
    from _common import median_ci, paired_ratios


def make_step(kind: str, device: str):
    if kind == "tiny":                                # one small kernel: isolates the host cost
        t = torch.zeros(256, device=device)
        return lambda _: t.add_(1.0)
    if kind == "gpu-bound":
        width, batch, depth = (4096, 512, 4) if device == "cuda" else (512, 64, 2)
    else:                                             # launch-bound: batch 1, many small kernels
        width, batch, depth = 256, 1, 8
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)

    def step(_):
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(variant: str, step, steps: int, device: str, timed: dict) -> float:
    batches = range(steps)
    gc.collect()                                      # no block pays for an earlier one's garbage
    sync(device)
    t0 = time.perf_counter()
    w = None
    if variant == "bare":
        for b in batches:
            step(b)
    elif variant in ("watch", "watch every step", "watch, no GPU"):
        w = watch(batches, gpu_every=1 if variant == "watch every step" else None,
                  gpu=False if variant == "watch, no GPU" else None)
        for b in w:
            step(b)
        w.monitor.drain()
    else:                                             # watch + Logger rows every step
        with Logger(every=100, sinks=[sinks.Callback(lambda s, t, v: None)]) as log:
            w = watch(batches, log=log)
            for b in w:
                step(b)
            w.monitor.drain()
    sync(device)
    ms = (time.perf_counter() - t0) / steps * 1e3
    if w is not None:
        timed.setdefault(variant, []).append(len(w.monitor.gpu_ms))
    return ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kinds", default="gpu-bound,launch-bound,tiny",
                   help="steps to measure, from gpu-bound, launch-bound, tiny (one small "
                        "kernel: the monitor's own host cost per step, with little noise)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    random.seed(0)
    torch.manual_seed(0)
    variants = ["bare", "watch", "watch, no GPU", "watch every step", "watch+log"]
    results = {}
    for kind in args.kinds.split(","):
        step = make_step(kind, args.device)
        for v in variants:                            # warm-up: kernels, allocator, event pool
            run(v, step, 20, args.device, {})
        times = {v: [] for v in variants}
        timed: dict = {}
        steps = args.steps * (20 if kind == "tiny" else 1)
        for _ in range(args.rounds):
            order = variants[:]
            random.shuffle(order)
            for v in order:
                times[v].append(run(v, step, steps, args.device, timed))
        med = {v: statistics.median(t) for v, t in times.items()}
        results[kind] = {}
        for v in variants:
            ratios = paired_ratios(times, v, "bare")
            ratio = statistics.median(ratios)
            results[kind][v] = {
                "ms_per_step": med[v], "ratio": ratio, "ratio_ci95": median_ci(ratios),
                "added_us_per_step": (ratio - 1) * med["bare"] * 1e3,
                "spread_ms": [min(times[v]), max(times[v])],
                "quartiles_ms": (statistics.quantiles(times[v], n=4)
                                 if len(times[v]) > 1 else times[v]),
                "steps_per_block": steps,
                "gpu_timed_steps": statistics.median(timed[v]) if v in timed else None}
    print(f"syncless.watch() overhead on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f": {args.rounds} interleaved rounds x {args.steps} steps, medians")
    print(f"{'step':14}{'variant':18}{'ms/step':>10}{'ratio':>9}{'95% CI':>18}{'added µs':>10}"
          f"{'GPU-timed':>11}")
    for kind, r in results.items():
        for v, row in r.items():
            n, ci = row["gpu_timed_steps"], row["ratio_ci95"]
            ci_s = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "n/a"
            print(f"{kind:14}{v:18}{row['ms_per_step']:>10.4f}{row['ratio']:>9.4f}{ci_s:>18}"
                  f"{row['added_us_per_step']:>10.2f}"
                  + (f"{n:>7.0f}/{row['steps_per_block']}" if n is not None else f"{'-':>11}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "rounds": args.rounds,
                       "steps": args.steps, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
