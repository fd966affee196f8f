"""Always-on cost of syncless.watch(): the same training loop bare and watched, interleaved.

    python -m benchmarks.doctor_overhead [--device cuda] [--rounds 30] [--steps 100] [--out]

Three steps: a GPU-bound MLP step (a few ms), a launch-bound batch-1 step (about 2 ms, the worst
realistic case for a per-step monitor), and a "step" of one tiny kernel (20x the steps per
block), where the monitor's own host cost per step shows with little noise: the µs it adds there
is what any CPU-bound step pays. Variants: the bare loop; watch() as shipped (the GPU timed on a
sample of steps sized to the step time); watch(gpu_every=1) (every step GPU-timed: two event
records and a poll per step); watch(gpu=False) (no events: the Python cost alone); watch()
feeding a Logger a row per step. Each round times the steps of every variant between two
synchronize() calls (drain() of the GPU times is inside the timing); the order of the variants
is shuffled every round. Reported: median ms/step per variant, the median of the per-round ratio
to the bare loop with its 95% confidence interval, the added µs per step, and how many steps
were GPU-timed. The target is <= 1% of the step. benchmarks/percall.py measures the tiny step's
variants too, beside the timer and log(), and can compare two builds.
"""
from __future__ import annotations

import gc
import random
import statistics
import sys
import time

import torch
from torch import nn

from ._common import (arg_parser, env_info, interleave, md_table, num, pct, pct_ci, pick_device,
                      ratio_summary, seed_all, summarize, write_results)

VARIANTS = {"bare": "bare loop", "watch": "watch() (sampled GPU timing)",
            "watch, no GPU": "watch(gpu=False)", "watch every step": "watch(gpu_every=1)",
            "watch+log": "watch(log=Logger) (a row per step)"}


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


def run(variant: str, step, steps: int, device: str, timed: dict) -> float:
    """ms per step of `steps` steps of one variant; `timed[variant]` gets the GPU-timed count."""
    from syncless import Logger, sinks
    from syncless.doctor import watch

    batches = range(steps)
    gc.collect()                                      # no block pays for an earlier one's garbage
    if device == "cuda":
        torch.cuda.synchronize()
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
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    if w is not None:
        timed.setdefault(variant, []).append(len(w.monitor.gpu_ms))
    return ms


def measure(kind: str, device: str, rounds: int, steps: int, rng: random.Random) -> dict:
    step = make_step(kind, device)
    for v in VARIANTS:                                # warm-up: kernels, allocator, event pool
        run(v, step, 20, device, {})
    timed: dict = {}
    steps *= 20 if kind == "tiny" else 1
    times = interleave({v: (lambda v=v: run(v, step, steps, device, timed)) for v in VARIANTS},
                       rounds, rng)
    bare = statistics.median(times["bare"])
    out = {}
    for v in VARIANTS:
        ratio = ratio_summary(times, v, "bare")
        out[v] = {"ms_per_step": summarize(times[v]), "ratio": ratio,
                  "added_us_per_step": (ratio["median"] - 1) * bare * 1e3,
                  "steps_per_block": steps,
                  "gpu_timed_steps": statistics.median(timed[v]) if v in timed else None}
    return out


def markdown(res: dict) -> str:
    rows = []
    for kind, r in res["results"].items():
        for v, row in r.items():
            n = row["gpu_timed_steps"]
            rows.append([kind, VARIANTS[v], num(row["ms_per_step"]["median"], 4),
                         pct(row["ratio"]["median"], 2), pct_ci(row["ratio"]["ci95"]),
                         num(row["added_us_per_step"]),
                         "—" if n is None else f"{n:.0f}/{row['steps_per_block']}"])
    return (f"{res['rounds']} interleaved rounds × {res['steps']} steps (tiny: ×20), medians; "
            "change vs the bare loop as the median per-round ratio with its 95% CI.\n\n"
            + md_table(["step", "variant", "ms/step", "vs bare", "95% CI", "added µs/step",
                        "GPU-timed"], rows) + "\n")


def main(argv=None) -> int:
    p = arg_parser(__doc__, rounds=30)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kinds", default="gpu-bound,launch-bound,tiny",
                   help="steps to measure, from gpu-bound, launch-bound, tiny (one small "
                        "kernel: the monitor's own host cost per step, with little noise)")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    rounds = args.rounds or (5 if args.quick else 30)
    steps = 20 if args.quick else args.steps
    seed_all(args.seed)
    rng = random.Random(args.seed)
    res = {"env": env_info(device, sys.argv[1:] if argv is None else argv,
                           "benchmarks.doctor_overhead"),
           "quick": args.quick, "rounds": rounds, "steps": steps, "results": {}}
    for kind in args.kinds.split(","):
        res["results"][kind] = measure(kind, device.type, rounds, steps, rng)
    write_results(args.out, "doctor_overhead", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
