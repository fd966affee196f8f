"""Cost per training step of logging 4 scalars: native TensorBoard / W&B against the syncless
drop-ins, measured in one process with interleaved rounds.

    python -m benchmarks.adapters [--device cpu] [--quick] [--out [DIR]]

Every step runs the same small workload (a matmul and the 4 metrics computed from it, all on the
device) and then logs the 4 metric tensors with one variant:

    none               no logging (the workload alone)
    tb_native          torch.utils.tensorboard.SummaryWriter.add_scalar x4
    tb_syncless        syncless.tensorboard.SummaryWriter.add_scalar x4
    wandb_native       wandb run.log({4 tensors}) (offline)
    wandb_syncless     syncless.wandb.log({4 tensors}) (offline)

A round times `--steps` steps plus the writer's flush() and a device synchronize, so every value
has reached the backend inside the timed region. Rounds of all variants are interleaved in a
shuffled order; the table shows medians [IQR] over rounds and the per-round ratio native /
syncless with the 95% CI of its median. With CUDA, a separate untimed pass counts torch's sync
warnings per step of each variant. W&B variants are skipped, with a note, when wandb is not
installed.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
import time

import torch

from ._common import (arg_parser, env_info, interleave, md_table, num, num_spread, pick_device,
                      ratio_summary, seed_all, summarize, syncs_per_call, write_results)


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
    """log(step, metrics), flush(), close(): one way of handing the 4 metrics to a backend."""

    def __init__(self, log=None, flush=None, close=None):
        self.log = log or (lambda step, metrics: None)
        self.flush = flush or (lambda: None)
        self.close = close or (lambda: None)


def tensorboard(cls, logdir: str, **kw) -> Variant:
    w = cls(logdir, **kw)

    def log(step, metrics):
        for tag, value in metrics.items():
            w.add_scalar(tag, value, step)
    return Variant(log, w.flush, w.close)


def make_variants(tmp: str, every: int, notes: list) -> dict[str, Variant]:
    from torch.utils.tensorboard import SummaryWriter as TorchWriter

    from syncless.tensorboard import SummaryWriter as SynclessWriter

    variants = {"none": Variant(),
                "tb_native": tensorboard(TorchWriter, os.path.join(tmp, "tb_native")),
                "tb_syncless": tensorboard(SynclessWriter, os.path.join(tmp, "tb_syncless"),
                                           every=every)}
    try:
        import wandb
    except ImportError:
        notes.append("wandb is not installed: the W&B variants were skipped "
                     "(pip install syncless[wandb])")
        return variants
    import syncless.wandb as swandb
    os.environ.setdefault("WANDB_SILENT", "true")
    settings = dict(mode="offline", dir=tmp, project="syncless-bench", reinit="create_new",
                    settings=wandb.Settings(console="off", x_disable_stats=True, silent=True,
                                            save_code=False, disable_git=True,
                                            x_save_requirements=False))
    native = wandb.init(**settings)
    deferred = swandb.init(every=every, **settings)
    variants["wandb_native"] = Variant(lambda step, m: native.log(m), close=native.finish)
    # create_new runs are not wandb.run: name the run (wandb.log would need the same).
    variants["wandb_syncless"] = Variant(lambda step, m: swandb.log(m, run=deferred),
                                         swandb.flush, deferred.finish)
    return variants


class Rounds:
    """Blocks of steps per variant, each continuing the variant's step count."""

    def __init__(self, work: Workload, device: torch.device):
        self.work, self.device, self.step = work, device, {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def steps(self, name: str, v: Variant, n: int) -> None:
        first = self.step.get(name, 0)
        for i in range(first, first + n):
            v.log(i, self.work.step())
        self.step[name] = first + n

    def block(self, name: str, v: Variant, n: int):
        """µs per step of n steps, then flush and synchronize, all inside the clock."""
        def run() -> float:
            self.sync()
            t0 = time.perf_counter()
            self.steps(name, v, n)
            v.flush()
            self.sync()
            return (time.perf_counter() - t0) / n * 1e6
        return run


def markdown(res: dict) -> str:
    rows = []
    for name, r in res["variants"].items():
        rows.append([name, num_spread(r["us_per_step"]), num(r["logging_us"]),
                     num(r.get("syncs_per_step"))])
    text = (f"Logging 4 scalars per step: {res['rounds']} interleaved rounds of {res['steps']} "
            f"steps; workload: {res['n']}² matmul + 4 metrics; syncless every={res['every']}; "
            f"tensorboard {res['tensorboard']}, wandb {res['wandb']}.\n\n"
            + md_table(["variant", "µs / step [IQR]", "logging µs / step", "syncs / step"], rows)
            + "\n\n")
    for backend, r in res["ratios"].items():
        ci = r["step_time"]["ci95"]
        text += (f"- {backend}: native / syncless step time {num(r['step_time']['median'])}×"
                 + (f" (95% CI {num(ci[0])}–{num(ci[1])})" if ci else "")
                 + f", logging cost {num(r['logging_cost'])}×\n")
    return text + "".join(f"- note: {n}\n" for n in res["notes"])


def main(argv=None) -> int:
    p = arg_parser(__doc__, rounds=9)
    p.add_argument("--steps", type=int, default=200, help="steps per round (default 200)")
    p.add_argument("--every", type=int, default=50, help="syncless rows per copy (default 50)")
    p.add_argument("--n", type=int, default=None,
                   help="workload matmul size (default 1024 on CUDA, 64 on CPU)")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    seed_all(args.seed)
    rounds = args.rounds or (3 if args.quick else 9)
    steps = 2 * args.every if args.quick else args.steps
    n = args.n or (1024 if device.type == "cuda" else 64)
    res = {"env": env_info(device, sys.argv[1:] if argv is None else argv, "benchmarks.adapters"),
           "quick": args.quick, "rounds": rounds, "steps": steps, "every": args.every, "n": n,
           "notes": [], "tensorboard": _version("tensorboard"), "wandb": _version("wandb")}
    r = Rounds(Workload(device, n), device)
    with tempfile.TemporaryDirectory(prefix="syncless-adapters-") as tmp:
        variants = make_variants(tmp, args.every, res["notes"])
        try:
            for name, v in variants.items():                  # warm-up: allocations, files
                r.block(name, v, min(steps, 2 * args.every))()
            times = interleave({name: r.block(name, v, steps) for name, v in variants.items()},
                               rounds, random.Random(args.seed))
            syncs = {}
            if device.type == "cuda":
                for name, v in variants.items():
                    r.sync()
                    syncs[name] = syncs_per_call(lambda: r.steps(name, v, 1), 20)
                    v.flush()
            else:
                res["notes"].append("no CUDA device: CPU tensors, so no syncs to count and the "
                                    "native/syncless gap is only the backends' own CPU cost")
        finally:
            for v in variants.values():
                v.close()
    base = summarize(times["none"])["median"]
    res["variants"] = {name: {"us_per_step": summarize(t), "rounds_us": t,
                              "logging_us": summarize(t)["median"] - base,
                              "syncs_per_step": syncs.get(name)} for name, t in times.items()}
    res["ratios"] = {}
    for backend in ("tb", "wandb"):
        native, ours = f"{backend}_native", f"{backend}_syncless"
        if native in times and ours in times:
            cost = res["variants"][ours]["logging_us"]
            res["ratios"][backend] = {
                "step_time": ratio_summary(times, native, ours),
                "logging_cost": res["variants"][native]["logging_us"] / cost if cost > 0 else None}
    write_results(args.out, "adapters", res, markdown(res))
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
