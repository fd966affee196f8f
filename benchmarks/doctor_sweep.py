"""The doctor's measured worker count against the step measured with that many workers.

    python -m benchmarks.doctor_sweep [--rounds N] [--hogs N] [--out]

Loaders of batch 4: samples that wait 10 ms (storage: the workers need no CPU) and samples that
compute 10 ms of CPU (decode: the workers get the CPUs the step leaves), both with a tiny step
(one Linear, forward, backward, SGD) on one torch thread; and the decoding samples with a step
that keeps torch's threads (one per CPU) busy, ~10 ms of matmuls on 2 cores (busy: the step and
the workers compete for the CPUs, which the doctor does not measure). Each round: syncless.watch() over 12 steps with
num_workers=0, its report (which runs the worker sweep), then the plain loop timed with the
prescribed count and with 0, 2, 4 and 8 workers (the median of three 1-s windows over whole rounds
of batches each), in a shuffled order. Reported: the sweep, the count, the predicted step, and the
measured one (medians over the rounds), with the other processes' load on the CPUs. `--hogs N`
keeps N other processes spinning on the CPUs throughout (a loaded host: the workers, the step and
the hogs compete)."""
from __future__ import annotations

import random
import statistics
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

import syncless
from syncless.doctor._load import LoadMeter

from ._common import arg_parser, env_info, md_table, summarize, write_results


class Storage(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.full((8,), float(i))


class Decode(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        t = time.thread_time()
        while time.thread_time() - t < 0.01:
            pass
        return torch.full((8,), float(i))


def tiny_step():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        opt.zero_grad()
        model(batch).sum().backward()
        opt.step()
    return step


def busy_step():
    """A CPU loop's step on torch's threads: ~10 ms wall, ~17 ms of CPU on 2 cores."""
    a = torch.randn(384, 384)

    def step(batch):
        x = a
        for _ in range(12):
            x = torch.tanh(x @ a)
        return x
    return step


def measured(dataset, workers, step, seconds=1.0, repeats=3):
    """ms/step of the plain loop with `workers` workers: past the prefetch, whole rounds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        it = iter(DataLoader(dataset, batch_size=4, num_workers=workers,
                             persistent_workers=workers > 0))
    per_round = max(workers, 1)
    for _ in range(2 * workers + 1):
        step(next(it))
    readings = []
    for _ in range(repeats):
        t, n = time.perf_counter(), 0
        while n % per_round or time.perf_counter() - t < seconds:
            step(next(it))
            n += 1
        readings.append((time.perf_counter() - t) / n * 1e3)
    if workers:
        it._shutdown_workers()
    return statistics.median(readings)


def prescribed(dataset, step):
    """(workers, predicted ms, sweep) from syncless.watch()'s report."""
    w = syncless.watch(DataLoader(dataset, batch_size=4))
    for i, batch in enumerate(w):
        step(batch)
        if i == 12:
            break
    m = w.summary(skip=2)
    found = w.findings(m)
    if not found:
        print(f"  no finding: {m}", flush=True)
        return None, None, None
    f = found[0]
    return f.extra["workers_needed"], f.fixes[0].predicted_ms, f.extra.get("sweep")


def _hog():
    """A process spinning on a CPU, outside this process tree (started through a shell that
    exits: the load meter counts it as another process's load, as a user's host would): its
    pid."""
    import subprocess
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 "
                          "& echo $!"], capture_output=True, text=True, check=True)
    return int(out.stdout)


def main(argv=None):
    p = arg_parser(__doc__, rounds=5)
    p.add_argument("--hogs", type=int, default=0, help="processes spinning on the CPUs meanwhile")
    ns = p.parse_args(argv)
    import os
    import signal
    hogs = [_hog() for _ in range(ns.hogs)]
    try:
        _rounds(ns)
    finally:
        for pid in hogs:
            os.kill(pid, signal.SIGKILL)


def _rounds(ns):
    rounds = ns.rounds or (2 if ns.quick else 5)
    rng = random.Random(ns.seed)
    import os
    cpus = len(os.sched_getaffinity(0))
    # name: (dataset, step factory, torch threads)
    cases = {"storage": (Storage(), tiny_step, 1), "decode": (Decode(), tiny_step, 1),
             "busy": (Decode(), busy_step, cpus)}
    rows: dict[str, list[dict]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in rng.sample(list(cases), len(cases)):
            dataset, make_step, threads = cases[name]
            torch.set_num_threads(threads)
            meter = LoadMeter()
            k, predicted, sweep = prescribed(dataset, make_step())
            counts = sorted({0, 1, 2, 4, 8, k or 0})
            steps = {}
            for n in rng.sample(counts, len(counts)):
                steps[n] = measured(dataset, n, make_step())
            load = meter.read()
            rows[name].append({"workers": k, "predicted_ms": predicted, "sweep": sweep,
                               "measured_ms": steps, "other_cpus": load.other_cpus
                               if load else None})
            print(f"round {r} {name}: {k} workers, predicted {predicted}, measured "
                  f"{steps.get(k or 0):.2f} ms/step; sweep {sweep and sweep['period_ms']}; "
                  f"all {steps}; "
                  f"load {load.other_cpus if load else float('nan'):.1f}", flush=True)
    table = []
    for name, rs in rows.items():
        told = [x for x in rs if x["predicted_ms"] is not None]
        err = [(x["predicted_ms"] - x["measured_ms"][x["workers"] or 0])
               / x["measured_ms"][x["workers"] or 0] for x in told]
        table.append([name, ", ".join(str(x["workers"] or "none") for x in rs),
                      f"{summarize(x['predicted_ms'] for x in told)['median']:.2f}"
                      if told else "-",
                      f"{summarize(x['measured_ms'][x['workers']] for x in told)['median']:.2f}"
                      if told else "-",
                      f"{statistics.median(err):+.0%} ({min(err):+.0%} to {max(err):+.0%})"
                      if err else "-",
                      ", ".join(f"{n}: {summarize(x['measured_ms'][n] for x in rs)['median']:.1f}"
                                for n in (0, 1, 2, 4, 8)),
                      f"{summarize(x['other_cpus'] for x in rs)['median']:.1f}"])
    text = md_table(["loader", "workers prescribed (per round)", "predicted ms/step (median)",
                     "measured ms/step with them (median)", "prediction error (median, range)",
                     "measured ms/step by workers (median)", "other processes' CPUs (median)"],
                    table)
    sweeps = "\n".join(f"- {name} round {i}: " + ", ".join(
        f"{k}: {ms:.1f}" for k, ms in x["sweep"]["period_ms"].items()) + " ms/batch, "
        f"{x['sweep']['seconds']:.1f} s, {x['sweep']['ended']}"
        + (f"; prescribed {x['workers']}" if x["workers"] else "; no count prescribed")
        if x["sweep"] is not None else f"- {name} round {i}: no finding"
        for name, rs in rows.items() for i, x in enumerate(rs))
    data = {"env": env_info(torch.device("cpu"), sys.argv, "benchmarks.doctor_sweep"),
            "quick": ns.quick, "rounds": rounds, "hogs": ns.hogs, "rows": rows}
    write_results(ns.out, "doctor_sweep" + (f"_hogs{ns.hogs}" if ns.hogs else ""), data, text + "\n\nThe sweeps (ms per batch by "
                  "workers):\n\n" + sweeps)


if __name__ == "__main__":
    main()
