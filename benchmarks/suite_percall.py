"""Section 2: the cost of one logging call with K = 1, 4, 16, 64 scalars.

Each method logs K 0-dim float32 tensors that already sit on the device (produced before the
timed loop, GPU idle): the host-side cost of the call plus, for methods that read the value, one
round trip per read. A measurement is n calls between two synchronize() calls, divided by n, so
work a method leaves queued on the GPU is paid inside the measurement. Methods are interleaved in
rounds; we report the median time per call and its interquartile range.
"""
from __future__ import annotations

import os
import random
import tempfile

import torch

from ._common import Ctx, clock, interleave, md_table, num_spread, summarize

KS = (1, 4, 16, 64)
RING_EVERY = 100

METHODS = {
    "floor": "floor: one torch kernel launch (x.zero_())",
    "syncless": "syncless.Logger(**K)",
    "syncless_tb": "syncless.tensorboard add_scalar ×K",
    "syncless_wandb": "syncless.wandb.log(K)",
    "ring_stack": f"torch ring: ring[i].copy_(stack(K)), .cpu() every {RING_EVERY}",
    "ring_each": f"torch ring: ring[i, j].copy_(m) ×K, .cpu() every {RING_EVERY}",
    "torchmetrics": "torchmetrics MeanMetric.update ×K",
    "tb_native": "TensorBoard add_scalar(tensor) ×K",
    "wandb_native": "wandb.log({k: v.item()}) (offline)",
    "item": "Lightning-style .item() per metric",
}


def _setup(ctx: Ctx, k: int, tmp: str, errors: dict, shared: dict) -> dict:
    """One callable per method logging K metrics; missing backends are skipped with a note."""
    dev = ctx.device
    names = [f"m{j}" for j in range(k)]
    vals = [torch.rand((), device=dev) for _ in range(k)]
    metrics = dict(zip(names, vals))
    fns = {}
    scratch = torch.zeros(1, device=dev)
    fns["floor"] = lambda: scratch.zero_()

    try:
        import syncless
        logger = syncless.Logger(every=RING_EVERY,
                                 sinks=[syncless.sinks.Callback(lambda s, t, v: None)])
        shared.setdefault("close", []).append(logger.close)
        fns["syncless"] = lambda: logger(**metrics)
    except Exception as exc:
        errors["syncless"] = f"unavailable: {type(exc).__name__}: {exc}"

    try:
        from syncless import tensorboard as stb
        sw = stb.SummaryWriter(log_dir=os.path.join(tmp, f"stb-{k}"))
        shared.setdefault("close", []).append(sw.close)
        step = [0]

        def stb_log():
            step[0] += 1
            for n, v in metrics.items():
                sw.add_scalar(n, v, step[0])
        fns["syncless_tb"] = stb_log
    except Exception as exc:
        errors["syncless_tb"] = f"unavailable: {type(exc).__name__}: {exc}"

    ring = torch.zeros(RING_EVERY, k, device=dev)
    pos = [0]

    def ring_stack():
        i = pos[0] % RING_EVERY
        ring[i].copy_(torch.stack(vals))
        pos[0] += 1
        if i == RING_EVERY - 1:
            shared["host"] = ring.cpu()

    def ring_each():
        i = pos[0] % RING_EVERY
        row = ring[i]
        for j, v in enumerate(vals):
            row[j].copy_(v)
        pos[0] += 1
        if i == RING_EVERY - 1:
            shared["host"] = ring.cpu()
    fns["ring_stack"], fns["ring_each"] = ring_stack, ring_each

    try:
        import torchmetrics
        mms = [torchmetrics.MeanMetric().to(dev) for _ in range(k)]

        def tm_update():
            for m, v in zip(mms, vals):
                m.update(v)
        fns["torchmetrics"] = tm_update
    except Exception as exc:
        errors["torchmetrics"] = f"torchmetrics skipped: {type(exc).__name__}: {exc}"

    try:
        from torch.utils.tensorboard import SummaryWriter
        tw = SummaryWriter(log_dir=os.path.join(tmp, f"tb-{k}"))
        shared.setdefault("close", []).append(tw.close)
        tstep = [0]

        def tb_log():
            tstep[0] += 1
            for n, v in metrics.items():
                tw.add_scalar(n, v, tstep[0])
        fns["tb_native"] = tb_log
    except Exception as exc:
        errors["tb_native"] = f"TensorBoard skipped: {type(exc).__name__}: {exc}"

    wb = shared.get("wandb")
    if wb is not None:
        fns["wandb_native"] = lambda: wb.log({n: v.item() for n, v in metrics.items()})
    else:
        errors["wandb_native"] = "wandb " + shared.get("wandb_error", "not available")

    try:
        if shared.get("wandb") is None:
            raise RuntimeError(shared.get("wandb_error", "wandb not available"))
        from syncless import wandb as swb
        fns["syncless_wandb"] = lambda: swb.log(metrics)     # replayed with .item() later
    except Exception as exc:
        errors["syncless_wandb"] = f"syncless.wandb {exc}"

    fns["item"] = lambda: [v.item() for v in vals]
    return fns


def _start_wandb(ctx: Ctx, tmp: str, shared: dict) -> None:
    """One offline run for both wandb methods: syncless.wandb.init returns the real run when the
    adapter is there (two inits would finish the first run)."""
    if ctx.quick and not ctx.cuda:
        shared["wandb_error"] = "skipped in --quick on CPU (wandb startup takes seconds)"
        return
    try:
        import wandb
    except Exception:
        shared["wandb_error"] = "skipped: wandb is not installed"
        print("  note: wandb is not installed; its methods are skipped", flush=True)
        return
    try:
        try:
            from syncless import wandb as swb
            shared["wandb"] = swb.init(project="syncless-bench", mode="offline", dir=tmp)
            shared["wandb_finish"] = swb.finish
        except ImportError:
            shared["wandb"] = wandb.init(project="syncless-bench", mode="offline", dir=tmp)
            shared["wandb_finish"] = shared["wandb"].finish
    except Exception as exc:
        shared["wandb"] = None
        shared["wandb_error"] = f"wandb.init failed: {type(exc).__name__}: {exc}"


def run(ctx: Ctx) -> dict:
    rng = random.Random(ctx.seed + 2)
    rounds = 3 if ctx.quick else 7
    target_s = 0.01 if ctx.quick else 0.04
    ks = (1, 4) if ctx.quick and not ctx.cuda else KS
    out = {"ks": list(ks), "methods": METHODS, "results": {}, "errors": {}}
    shared: dict = {}
    with tempfile.TemporaryDirectory(prefix="syncless-percall-") as tmp:
        _start_wandb(ctx, tmp, shared)
        try:
            for k in ks:
                errors: dict = {}
                fns = _setup(ctx, k, tmp, errors, shared)
                calls = {}
                for name, fn in fns.items():           # warm-up and calibrate n per method
                    try:
                        fn()
                        ctx.sync()
                        t = clock()
                        for _ in range(3):
                            fn()
                        ctx.sync()
                        per = max((clock() - t) / 3, 1e-6)
                        calls[name] = max(3, min(2000, round(target_s / per)))
                    except Exception as exc:
                        errors[name] = f"{type(exc).__name__}: {exc}"

                def timed(fn, n):
                    def go():
                        ctx.sync()
                        t = clock()
                        for _ in range(n):
                            fn()
                        ctx.sync()
                        return (clock() - t) / n
                    return go
                live = {n: timed(fns[n], calls[n]) for n in fns if n not in errors}
                times = interleave(live, rounds, rng, errors)
                res = {}
                for name in METHODS:
                    if times.get(name):
                        s = summarize([x * 1e6 for x in times[name]])
                        res[name] = {"us": s, "calls": calls.get(name)}
                    elif name in errors:
                        res[name] = {"error": errors[name]}
                out["results"][str(k)] = res
                for e in errors.values():
                    out["errors"].setdefault(e, True)
                for close in shared.pop("close", []):
                    try:
                        close()
                    except Exception as exc:
                        print(f"  ! close failed: {exc}", flush=True)
                print(f"  K={k}: " + ", ".join(f"{n} {r['us']['median']:.1f}µs"
                                               for n, r in res.items() if "us" in r), flush=True)
        finally:
            for close in shared.pop("close", []):
                close()
            if shared.get("wandb_finish") is not None:
                try:
                    shared["wandb_finish"]()
                except Exception as exc:
                    print(f"  ! wandb finish failed: {exc}", flush=True)
    out["errors"] = sorted(out["errors"])
    return out


def markdown(res: dict) -> str:
    ks = res["ks"]
    rows = []
    for name, label in METHODS.items():
        cells = [label]
        for k in ks:
            r = res["results"].get(str(k), {}).get(name, {})
            cells.append(num_spread(r["us"]) if "us" in r else "—")
        rows.append(cells)
    text = ("Time per logging call, µs, median [IQR] (metric tensors already on the device; "
            "queued work is paid inside the measurement):\n\n"
            + md_table(["method"] + [f"K={k}" for k in ks], rows) + "\n")
    if res.get("errors"):
        text += "\nSkipped or failed: " + "; ".join(res["errors"]) + "\n"
    return text


def headline(res: dict) -> list[list[str]]:
    r4 = res["results"].get("4", {})
    rows = []
    for name, seed in (("syncless", "≤ 5 µs, 0 syncs (design bar)"),
                       ("tb_native", "342 µs, 4 syncs (H200)"),
                       ("torchmetrics", "795 µs, 8 syncs (H200)"),
                       ("ring_stack", "27 µs (H200)")):
        if "us" in r4.get(name, {}):
            rows.append([f"per call, K=4: {METHODS[name]}", seed, num_spread(r4[name]["us"]) + " µs"])
    return rows
