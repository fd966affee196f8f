"""Does the doctor's monitored window measure the step the user has? The user's own clock inside
the step, in the doctor's plain window (timed unobserved) and in its monitored window (the stack
sampler, the monitor's marks), with and without the sampler.

    python -m benchmarks.doctor_window [--rounds 5] [--baseline DIR [--baseline-label L]] [--out]

The loop (tests/test_doctor_window.py runs it too): a 2-worker DataLoader whose samples take 50 ms each (a batch each 25 ms), a step body of
~5.8 ms (a tiny model and a 5 ms sleep), 20 batches prefetched: `syncless.doctor(step, loader=)`.
Each variant runs in a fresh interpreter (worker processes, and the doctor's caches start empty
as a user's do); the variants are interleaved, in a new order each round. Reported per variant:
the median over rounds of the step body as the step itself timed it in each window, the ratio
monitored / plain, and the doctor's own split of the monitored step into data wait and body.
The floor is the "sampler off" variant: the monitor without the sampler thread. --baseline DIR
adds the variant "baseline": the same loop with another build's package first on PYTHONPATH
(DIR holds its `syncless` folder, extension modules built).
A ratio near 1 means the window measures the user's step; the doctor's data wait then reads
what the loader makes the step wait (here ~19 ms of a ~25 ms step).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap

import torch

from ._common import arg_parser, env_info, interleave, md_table, num, ratio_summary, write_results

SCRIPT = """
    import json, sys, time, statistics, importlib, torch
    from torch.utils.data import DataLoader, Dataset
    import syncless
    if sys.argv[1] == "sampler off":
        s = importlib.import_module("syncless.doctor._sampler").StackSampler
        s.start = s.stop = lambda self: None
    class Slow(Dataset):
        def __len__(self): return 100000
        def __getitem__(self, i):
            time.sleep(0.05)
            return torch.ones(4, 8)
    if __name__ == "__main__":
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        inside = []
        def step(b):
            t = time.perf_counter()
            opt.zero_grad(); model(b).sum().backward(); time.sleep(0.005); opt.step()
            inside.append(time.perf_counter() - t)
        it = iter(DataLoader(Slow(), batch_size=None, num_workers=2, prefetch_factor=10))
        time.sleep(1.5)
        d = syncless.doctor(step, steps=15, warmup=2, audit_steps=3, loader=it, file=None)
        dd = d.as_dict()
        w, p = dd["warmup_steps"], dd["plain_steps"]
        ms = lambda xs: statistics.fmean(xs) * 1e3
        dd.update(plain_body=ms(inside[w:w + p]), monitored_body=ms(inside[w + p:w + p + 15]))
        print(json.dumps(dd, default=str))
"""
SHOWN = ("plain_body", "monitored_body", "step_ms", "data_ms", "cpu_ms", "plain_step_ms")

VARIANTS = ("as shipped", "sampler off")


def main() -> None:
    p = arg_parser(__doc__, rounds=5)
    p.add_argument("--baseline", default=None,
                   help="a folder holding another build's syncless package, for a third variant")
    p.add_argument("--baseline-label", default="",
                   help="what the baseline build is (a commit), for the results file")
    ns = p.parse_args()
    rounds = ns.rounds or (2 if ns.quick else 5)
    env = env_info(torch.device("cpu"), sys.argv, "benchmarks.doctor_window")
    folder = tempfile.mkdtemp(prefix="syncless-doctor-window-")
    path = os.path.join(folder, "loop.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(SCRIPT))
    variants = VARIANTS + (("baseline",) if ns.baseline else ())
    runs: dict[str, list[dict]] = {v: [] for v in variants}

    def variant(name: str):
        child = dict(os.environ)
        if name == "baseline":
            child["PYTHONPATH"] = os.path.abspath(ns.baseline) + os.pathsep + \
                child.get("PYTHONPATH", "")

        def run() -> float:
            r = subprocess.run([sys.executable, path, name], capture_output=True, text=True,
                               cwd=folder, timeout=300, env=child)
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-2000:])
            out = {k: v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()
                   if k in SHOWN}
            runs[name].append(out)
            print(f"  {name}: body {out['plain_body']:.2f} ms plain, "
                  f"{out['monitored_body']:.2f} ms monitored", flush=True)
            return out["monitored_body"] / out["plain_body"]
        return run

    values = interleave({v: variant(v) for v in variants}, rounds, random.Random(ns.seed))
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]}
           for v in variants if runs[v]}
    rows = [[v, num(m["plain_body"], 2), num(m["monitored_body"], 2),
             num(statistics.median(values[v]), 3), num(m["step_ms"], 2), num(m["data_ms"], 2),
             num(m["cpu_ms"], 2)] for v, m in med.items()]
    versus = ratio_summary(values, "as shipped", "sampler off")
    text = md_table(["variant", "step body, plain window (ms)", "monitored window (ms)",
                     "monitored / plain", "doctor: step (ms)", "doctor: data wait (ms)",
                     "doctor: body (ms)"], rows)
    text += (f"\n\nAs shipped over the floor (sampler off), monitored/plain per round: median "
             f"{num(versus.get('median'), 3)}, 95% CI {versus.get('ci95')}")
    if ns.baseline:
        text += f"; the baseline build: {ns.baseline_label or os.path.abspath(ns.baseline)}"
    text += f". {rounds} rounds, each variant a fresh interpreter; medians over rounds.\n"
    write_results(ns.out, "doctor_window", {"env": env, "quick": ns.quick, "rounds": rounds,
                                            "runs": runs, "ratios": values,
                                            "versus_floor": versus}, text)


if __name__ == "__main__":
    main()
