"""Section 4: DataLoader starvation.

An image-like pipeline whose items cost real CPU time (a seeded "decode" of a 3×160×160 uint8
image, then random resized crop to 128², flip, brightness jitter and normalisation), feeding a
small CNN training step (bf16 autocast on CUDA). We compare the default `num_workers=0` with the
best of a short worker sweep plus `pin_memory=True`, `persistent_workers=True` and non-blocking
copies. Reported: images/s, and the share of wall time the training loop spent blocked in
`next(loader)`. Worker start-up is excluded (a few warm-up batches before timing), which
favours neither side: with persistent workers it is paid once per run.
"""
from __future__ import annotations

import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ._common import Ctx, clock, md_table, num_spread, seed_all, summarize

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class SyntheticImages(Dataset):
    """Deterministic per index, so every loader sees the same work."""

    def __init__(self, n: int, src: int = 160, out: int = 128):
        self.n, self.src, self.out = n, src, out

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        # "decode": a noisy image smoothed by a 5×5 box filter (a stand-in for JPEG decoding cost)
        raw = torch.randint(0, 256, (3, self.src, self.src), dtype=torch.uint8, generator=g)
        img = F.avg_pool2d(raw.float()[None], 5, stride=1, padding=2)[0] / 255.0
        # augment: random resized crop, horizontal flip, brightness jitter, normalise
        side = int(self.src * (0.6 + 0.4 * torch.rand((), generator=g).item()))
        top, left = torch.randint(0, self.src - side + 1, (2,), generator=g).tolist()
        img = img[:, top:top + side, left:left + side]
        img = F.interpolate(img[None], size=(self.out, self.out), mode="bilinear",
                            antialias=True, align_corners=False)[0]
        if torch.rand((), generator=g).item() < 0.5:
            img = img.flip(-1)
        img = img * (0.8 + 0.4 * torch.rand((), generator=g).item())
        img = (img.clamp_(0, 1) - MEAN) / STD
        return img.contiguous(), i % 10


def small_cnn() -> nn.Module:
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]
    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), *block(128, 256),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


class Pipe:
    def __init__(self, ctx: Ctx, ds: Dataset, batch: int, workers: int, tuned: bool):
        self.ctx, self.workers, self.tuned = ctx, workers, tuned
        g = torch.Generator().manual_seed(ctx.seed)
        kw = {}
        if workers > 0:
            kw = {"persistent_workers": tuned, "prefetch_factor": 4}
        self.loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                 pin_memory=tuned and ctx.cuda, drop_last=True, generator=g,
                                 **kw)
        self.it = iter(self.loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:                     # a new epoch (persistent workers stay up)
            self.it = iter(self.loader)
            return next(self.it)

    def close(self):
        self.it = None
        self.loader = None


class Trainer:
    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.model = small_cnn().to(ctx.device).to(memory_format=torch.channels_last)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self, x, y, non_blocking: bool):
        dev = self.ctx.device
        x = x.to(dev, non_blocking=non_blocking).to(memory_format=torch.channels_last)
        y = y.to(dev, non_blocking=non_blocking)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.ctx.cuda):
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def measure(ctx: Ctx, pipe: Pipe, tr: Trainer, batches: int) -> dict:
    ctx.sync()
    waited = 0.0
    n = 0
    t0 = clock()
    for _ in range(batches):
        t = clock()
        x, y = pipe.next()
        waited += clock() - t
        n += x.shape[0]
        tr.step(x, y, non_blocking=pipe.tuned)
    ctx.sync()
    wall = clock() - t0
    return {"images_per_s": n / wall, "wait_share": waited / wall}


def run(ctx: Ctx) -> dict:
    seed_all(ctx.seed)
    cpus = os.cpu_count() or 2
    batch = 32 if ctx.quick else 64
    warm, batches = (2, 4) if ctx.quick else (3, 12)
    rounds = 2 if ctx.quick else 3
    if ctx.quick:
        candidates = [2]
    else:
        candidates = sorted({w for w in (2, 4, 8, 12, 16) if w <= max(2, cpus - 2)})
    ds = SyntheticImages(100_000)
    t = clock()
    for i in range(16):
        ds[i]
    item_ms = (clock() - t) / 16 * 1e3
    tr = Trainer(ctx)
    out = {"batch": batch, "item_ms_main_process": item_ms, "cpu_count": cpus, "sweep": {},
           "note": "worker start-up excluded (warm-up batches before timing)"}
    print(f"  one item costs {item_ms:.2f} ms of CPU in the main process; {cpus} CPUs", flush=True)

    # Short sweep over worker counts (tuned settings), then interleaved rounds: 0 vs best.
    best, best_ips = None, -1.0
    for w in candidates:
        p = Pipe(ctx, ds, batch, w, tuned=True)
        for _ in range(warm):
            tr.step(*p.next(), non_blocking=True)
        r = measure(ctx, p, tr, max(4, batches // 2))
        p.close()
        out["sweep"][str(w)] = r
        print(f"  workers={w}: {r['images_per_s']:.0f} img/s, waiting {r['wait_share']:.0%}",
              flush=True)
        if r["images_per_s"] > best_ips:
            best, best_ips = w, r["images_per_s"]
    out["tuned_workers"] = best

    pipes = {"workers0": Pipe(ctx, ds, batch, 0, tuned=False),
             "tuned": Pipe(ctx, ds, batch, best, tuned=True)}
    for p in pipes.values():
        for _ in range(warm):
            tr.step(*p.next(), non_blocking=p.tuned)
    res = {k: [] for k in pipes}
    rng = random.Random(ctx.seed + 4)
    for _ in range(rounds):
        order = list(pipes)
        rng.shuffle(order)
        for k in order:
            res[k].append(measure(ctx, pipes[k], tr, batches))
    for p in pipes.values():
        p.close()
    for k, rs in res.items():
        out[k] = {"images_per_s": summarize([r["images_per_s"] for r in rs]),
                  "wait_share": summarize([r["wait_share"] for r in rs])}
    ratios = [b["images_per_s"] / a["images_per_s"] for a, b in zip(res["workers0"], res["tuned"])]
    out["speedup"] = summarize(ratios)
    out["labels"] = {"workers0": "num_workers=0 (default)",
                     "tuned": f"num_workers={best}, pin_memory, persistent_workers"}
    print(f"  speedup {out['speedup']['median']:.2f}×", flush=True)
    return out


def markdown(res: dict) -> str:
    rows = [[res["labels"][k], num_spread(res[k]["images_per_s"]),
             num_spread(res[k]["wait_share"], 100.0, 2) + " %"] for k in ("workers0", "tuned")]
    sweep = ", ".join(f"{w}: {r['images_per_s']:.0f}" for w, r in res["sweep"].items())
    return (f"Batch {res['batch']} of 3×128² images; one item costs "
            f"{res['item_ms_main_process']:.2f} ms of CPU; {res['cpu_count']} CPUs. "
            f"Worker sweep (img/s): {sweep}. {res['note']}.\n\n"
            + md_table(["loader", "images/s [IQR]", "time waiting for data [IQR]"], rows)
            + f"\n\nSpeedup: {num_spread(res['speedup'])}× (paired per round).\n")


def headline(res: dict) -> list[list[str]]:
    if "speedup" not in res:
        return []
    return [[f"DataLoader: {res['labels']['tuned']} vs workers=0", "4.52× (seed); 9.2× (H200, 12 w)",
             f"{num_spread(res['speedup'])}× (waiting {res['workers0']['wait_share']['median']:.0%}"
             f" → {res['tuned']['wait_share']['median']:.0%})"]]
