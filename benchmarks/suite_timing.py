"""Section 3: timing pitfalls. One workload timed four ways; CUDA events are the reference.

- host clock, no sync: perf_counter around the call (the queue is empty when it starts). It
  measures how long the CPU took to *enqueue* the work, not to run it.
- synchronize(): synchronize, perf_counter, work, synchronize, perf_counter. Correct, but it adds
  the sync round trip and stalls the pipeline.
- CUDA events: record, work, record, then wait for the end event: the GPU's own clock.
- syncless.timer(): an event pair from a pool; reading `.ms` waits for the end event.

Two workloads: a large bf16 matmul (the host clock is wildly early) and a small one (where the
round trip of synchronize() is a visible share).
"""
from __future__ import annotations

import random

import torch

from ._common import Ctx, clock, interleave, md_table, num, num_spread, summarize

METHODS = {
    "host": "host clock, no sync",
    "sync": "host clock + synchronize()",
    "events": "CUDA events (reference)",
    "syncless": "syncless.timer()",
}


def _syncless_timer():
    import syncless
    t = getattr(syncless, "timer", None)
    if t is not None and not callable(t):          # the module, not the function
        t = getattr(t, "timer", None)
    if t is None:
        from syncless.timer import timer as t      # raises ImportError when not there yet
    return t


def run(ctx: Ctx) -> dict:
    if not ctx.cuda:
        print("  skipped: needs CUDA (on CPU every clock is already synchronous)", flush=True)
        return {"skipped": "needs CUDA"}
    rng = random.Random(ctx.seed + 3)
    rounds = 5 if ctx.quick else 25
    out = {"methods": METHODS, "workloads": {}, "errors": {}}
    try:
        timer = _syncless_timer()
    except Exception as exc:
        timer = None
        out["errors"]["syncless"] = f"syncless.timer unavailable: {type(exc).__name__}: {exc}"
        print(f"  note: {out['errors']['syncless']} (row skipped)", flush=True)

    dev = ctx.device
    for wname, n in (("matmul 8192² bf16", 8192), ("matmul 512² bf16", 512)):
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        work = lambda: torch.mm(a, b)
        for _ in range(3):
            work()
        ctx.sync()

        def host():
            ctx.sync()                              # empty queue; then the mistake
            t = clock()
            work()
            return (clock() - t) * 1e3

        def synced():
            ctx.sync()
            t = clock()
            work()
            ctx.sync()
            return (clock() - t) * 1e3

        def events():
            ctx.sync()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            work()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)

        def sl():
            ctx.sync()
            with timer() as t:
                work()
            return t.ms

        fns = {"host": host, "sync": synced, "events": events}
        if timer is not None:
            fns["syncless"] = sl
        errors = out["errors"]
        times = interleave(fns, rounds, rng, errors)
        ref = summarize(times["events"])["median"]
        res = {}
        for m in METHODS:
            if times.get(m):
                s = summarize(times[m])
                res[m] = {"ms": s, "error_vs_events": s["median"] / ref - 1.0}
        out["workloads"][wname] = res
        print(f"  {wname}: " + ", ".join(f"{m} {r['ms']['median']:.3f} ms" for m, r in res.items()),
              flush=True)
        del a, b
    return out


def markdown(res: dict) -> str:
    if "skipped" in res:
        return f"Skipped: {res['skipped']}.\n"
    rows = []
    for w, r in res["workloads"].items():
        for m, label in METHODS.items():
            if m in r:
                rows.append([w, label, num_spread(r[m]["ms"]),
                             f"{r[m]['error_vs_events'] * 100:+.1f}%"])
            else:
                rows.append([w, label, "—", res["errors"].get(m, "")])
    return ("Measured time, ms, median [IQR], and error against CUDA events:\n\n"
            + md_table(["workload", "method", "ms", "error vs events"], rows) + "\n")


def headline(res: dict) -> list[list[str]]:
    r = res.get("workloads", {}).get("matmul 8192² bf16")
    if not r:
        return []
    rows = [["8192² bf16 matmul, host clock without sync", "0.17 vs 1.47 ms (8.5× wrong, H200)",
             f"{num(r['host']['ms']['median'])} vs {num(r['events']['ms']['median'])} ms "
             f"({r['events']['ms']['median'] / r['host']['ms']['median']:.1f}× wrong)"]]
    if "syncless" in r:
        rows.append(["8192² matmul, syncless.timer() error vs events", "—",
                     f"{r['syncless']['error_vs_events'] * 100:+.1f}%"])
    return rows
