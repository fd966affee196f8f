"""Cost per training step of logging 4 scalars: native TensorBoard / W&B against the syncless
drop-ins, measured in one process with interleaved rounds.

    python benchmarks/adapters.py                    # CUDA if present, else CPU; < 60 s
    python benchmarks/adapters.py --out benchmarks/results

Every step runs the same small workload (a matmul and the 4 metrics computed from it, all on the
device) and then logs the 4 metric tensors with one variant:

    none               no logging (the workload alone)
    tb_native          torch.utils.tensorboard.SummaryWriter.add_scalar x4
    tb_syncless        syncless.tensorboard.SummaryWriter.add_scalar x4
    wandb_native       wandb run.log({4 tensors}) (offline)
    wandb_syncless     syncless.wandb.log({4 tensors}) (offline)

A round times `--steps` steps plus the writer's flush() and a device synchronize, so every value
has reached the backend inside the timed region. Rounds of all variants are interleaved in a
shuffled order; the table shows medians over rounds. With CUDA, a separate untimed pass counts
torch's sync warnings (set_sync_debug_mode("warn")) per step of each variant. W&B variants are
skipped, with a note, when wandb is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))   # a plain checkout works too


class Workload:
    """A matmul and 4 metrics on the device: what a training step would produce."""

    def __init__(self, device: torch.device, n: int):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.x = torch.randn(n, n, generator=g).to(device)
        self.w = torch.randn(n, n, generator=g).to(device) / n ** 0.5

    def step(self) -> dict:
        y = self.x @ self.w
        return {"loss": y.square().mean(), "acc": (y > 0).float().mean(),
                "gnorm": self.w.norm(), "ymax": y.amax()}


class Variant:
    name = ""

    def log(self, step: int, metrics: dict) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class NoLogging(Variant):
    name = "none"

    def log(self, step, metrics):
        pass


class TensorBoardVariant(Variant):
    def __init__(self, name, cls, logdir, **kwargs):
        self.name = name
        self.writer = cls(logdir, **kwargs)

    def log(self, step, metrics):
        add = self.writer.add_scalar
        for tag, value in metrics.items():
            add(tag, value, step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbVariant(Variant):
    def __init__(self, name, log_fn, run):
        self.name = name
        self.log_fn = log_fn
        self.run = run

    def log(self, step, metrics):
        self.log_fn(metrics)

    def flush(self):
        if self.name == "wandb_syncless":
            import syncless.wandb
            syncless.wandb.flush()

    def close(self):
        self.run.finish()


def make_variants(tmp: str, every: int, notes: list) -> list[Variant]:
    from torch.utils.tensorboard import SummaryWriter as TorchWriter

    from syncless.tensorboard import SummaryWriter as SynclessWriter

    variants: list[Variant] = [
        NoLogging(),
        TensorBoardVariant("tb_native", TorchWriter, os.path.join(tmp, "tb_native")),
        TensorBoardVariant("tb_syncless", SynclessWriter, os.path.join(tmp, "tb_syncless"),
                           every=every),
    ]
    try:
        import wandb
    except ImportError:
        notes.append("wandb is not installed: the W&B variants were skipped "
                     "(pip install syncless[wandb])")
        print(f"note: {notes[-1]}", flush=True)
        return variants
    import syncless.wandb as swandb
    os.environ.setdefault("WANDB_SILENT", "true")
    settings = dict(mode="offline", dir=tmp, project="syncless-bench", reinit="create_new",
                    settings=wandb.Settings(console="off", x_disable_stats=True, silent=True,
                                            save_code=False, disable_git=True,
                                            x_save_requirements=False))
    native = wandb.init(**settings)
    deferred = swandb.init(every=every, **settings)
    variants.append(WandbVariant("wandb_native", native.log, native))
    # create_new runs are not wandb.run: name the run (wandb.log would need the same).
    variants.append(WandbVariant("wandb_syncless",
                                 lambda data: swandb.log(data, run=deferred), deferred))
    return variants


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round(variant: Variant, work: Workload, steps: int, first_step: int,
               device: torch.device) -> float:
    """Seconds per step: `steps` steps, then flush and synchronize."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(first_step, first_step + steps):
        variant.log(i, work.step())
    variant.flush()
    sync(device)
    return (time.perf_counter() - t0) / steps


def count_syncs(variant: Variant, work: Workload, steps: int, first_step: int) -> float:
    """torch's sync warnings per step (log calls only; flush is outside the count)."""
    sync(torch.device("cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(first_step, first_step + steps):
                variant.log(i, work.step())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    variant.flush()
    # torch's own "debug mode is a prototype feature" notice is not a sync: match the sync text.
    n = sum("synchronizing cuda operation" in str(w.message).lower() for w in caught)
    return n / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per round (default 200)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    p.add_argument("--every", type=int, default=50, help="syncless rows per copy (default 50)")
    p.add_argument("--n", type=int, default=None,
                   help="workload matmul size (default 1024 on CUDA, 64 on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default=None, help="directory for adapters.json and adapters.md")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    random.seed(args.seed)
    notes: list[str] = []
    if args.n is None:
        args.n = 1024 if device.type == "cuda" else 64
    work = Workload(device, args.n)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="syncless-adapters-") as tmp:
        variants = make_variants(tmp, args.every, notes)
        step = {v.name: 0 for v in variants}
        try:
            for v in variants:                                  # warm-up: allocations, files
                time_round(v, work, min(args.steps, 2 * args.every), step[v.name], device)
                step[v.name] += min(args.steps, 2 * args.every)
            per_step: dict[str, list[float]] = {v.name: [] for v in variants}
            for _ in range(args.rounds):
                order = variants[:]
                random.shuffle(order)
                for v in order:
                    per_step[v.name].append(time_round(v, work, args.steps, step[v.name], device))
                    step[v.name] += args.steps
            syncs: dict[str, float | None] = {v.name: None for v in variants}
            if device.type == "cuda":
                for v in variants:
                    syncs[v.name] = count_syncs(v, work, 20, step[v.name])
                    step[v.name] += 20
            else:
                notes.append("no CUDA device: CPU tensors, so no syncs to count and the "
                             "native/syncless gap is only the backends' own CPU cost")
                print(f"note: {notes[-1]}", flush=True)
        finally:
            for v in variants:
                v.close()

    med = {name: statistics.median(xs) * 1e6 for name, xs in per_step.items()}
    base = med["none"]
    rows = []
    for name, xs in per_step.items():
        us = [x * 1e6 for x in xs]
        rows.append({
            "variant": name,
            "us_per_step": med[name],
            "min_us": min(us), "max_us": max(us),
            "logging_us": med[name] - base,
            "syncs_per_step": syncs[name],
            "rounds_us": us,
        })
    ratios = {}
    for backend in ("tb", "wandb"):
        native, ours = f"{backend}_native", f"{backend}_syncless"
        if native in med and ours in med:
            ratios[backend] = {
                "step_time": med[native] / med[ours],
                "logging_cost": ((med[native] - base) / (med[ours] - base)
                                 if med[ours] - base > 0 else None),
            }

    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or platform.machine()),
        "wandb": _version("wandb"), "tensorboard": _version("tensorboard"),
        "steps": args.steps, "rounds": args.rounds, "every": args.every, "n": args.n,
        "seconds": round(time.time() - started, 1),
    }
    md = render(rows, ratios, env, notes)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "adapters.json"), "w") as f:
            json.dump({"env": env, "rows": rows, "ratios": ratios, "notes": notes}, f, indent=1)
        with open(os.path.join(args.out, "adapters.md"), "w") as f:
            f.write(md)
        print(f"wrote {args.out}/adapters.json and adapters.md")
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def render(rows, ratios, env, notes) -> str:
    lines = [
        f"# Logging 4 scalars per step: native vs syncless adapters ({env['device']})",
        "",
        f"torch {env['torch']}, tensorboard {env['tensorboard']}, wandb {env['wandb']}; "
        f"{env['rounds']} interleaved rounds of {env['steps']} steps, medians; workload: "
        f"{env['n']}² matmul + 4 metrics; syncless every={env['every']}.",
        "",
        "| variant | µs / step | min–max | logging µs / step | syncs / step |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = "–" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:g}"
        lines.append(f"| {r['variant']} | {r['us_per_step']:.1f} | {r['min_us']:.1f}–"
                     f"{r['max_us']:.1f} | {r['logging_us']:.1f} | {s} |")
    lines.append("")
    for backend, rt in ratios.items():
        cost = rt["logging_cost"]
        cost_s = f"{cost:.1f}×" if cost is not None else "n/a (syncless within noise of none)"
        lines.append(f"- {backend}: native / syncless step time {rt['step_time']:.2f}×, "
                     f"logging cost {cost_s}")
    lines += [f"- note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
