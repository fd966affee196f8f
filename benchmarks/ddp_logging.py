"""DDP step time with and without cross-rank metric logging, 2 ranks on 2 GPUs (NCCL).

    python benchmarks/ddp_logging.py [--out benchmarks/results] [--rounds 15] [--steps 50]

Variants, interleaved round by round (same order on every rank), medians over rounds:
  no logging          metrics computed, not logged
  syncless reduce     syncless.Logger(reduce="mean"): one async all-reduce per flush (every 100)
  all_reduce+.item()  per step: all_reduce of the 4 metrics, then .item() each (Lightning's
                      sync_dist style)
Each rank times its own steps (synchronize before reading the clock); rank 0 reports.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, store, args, out_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # NVLink multicast stays off
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    import syncless
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                            torch.nn.Linear(width, width), torch.nn.GELU(),
                            torch.nn.Linear(width, 10)).cuda(), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, width, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    log = syncless.Logger(every=100, reduce="mean", device="cuda")

    def step(record):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        conf = logits.softmax(1).amax(1).mean()
        record(loss, acc, gn, conf)

    def nothing(*m):
        pass

    def with_syncless(loss, acc, gn, conf):
        log(loss=loss, acc=acc, grad_norm=gn, conf=conf)

    def sync_dist(*m):
        packed = torch.stack(m)
        dist.all_reduce(packed)
        for v in (packed / world).unbind():
            v.item()

    variants = {"no logging": nothing, "syncless reduce": with_syncless,
                "all_reduce+.item()": sync_dist}
    for fn in variants.values():                               # warm-up
        for _ in range(10):
            step(fn)
    times = {name: [] for name in variants}
    order_rng = __import__("random").Random(0)                 # same order on every rank
    for _ in range(args.rounds):
        names = list(variants)
        order_rng.shuffle(names)
        for name in names:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(variants[name])
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    log.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("ddp_logging needs two GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "times.json")
        mp.start_processes(worker, args=(2, os.path.join(tmp, "store"), args, out_path),
                           nprocs=2, start_method="spawn")
        with open(out_path) as f:
            times = json.load(f)
    base = times["no logging"]
    rows = []
    for name, t in times.items():
        ratios = sorted(a / b for a, b in zip(t, base))
        rows.append((name, statistics.median(t), 100 * (statistics.median(ratios) - 1),
                     100 * (ratios[len(ratios) // 4] - 1), 100 * (ratios[len(ratios) * 3 // 4] - 1)))
    lines = ["| variant | ms/step (median) | vs no logging (median, p25–p75 of per-round ratios) |",
             "|---|---|---|"]
    lines += [f"| {n} | {ms:.3f} | {d:+.2f}% ({lo:+.2f}% … {hi:+.2f}%) |" for n, ms, d, lo, hi in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        import syncless
        os.makedirs(args.out, exist_ok=True)
        env = {"gpu": torch.cuda.get_device_name(0), "gpus": 2, "torch": torch.__version__,
               "driver": syncless._C.driver_version(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(["python"] + sys.argv), "width": args.width,
               "batch": args.batch, "rounds": args.rounds, "steps_per_round": args.steps}
        with open(os.path.join(args.out, "ddp_logging.json"), "w") as f:
            json.dump({"env": env, "times_ms": times}, f, indent=1)
        with open(os.path.join(args.out, "ddp_logging.md"), "w") as f:
            f.write(f"# DDP logging, 2× {env['gpu']}, torch {env['torch']}, {env['date']}\n\n"
                    f"`{env['command']}`: MLP width {args.width}, batch {args.batch} per rank, "
                    f"{args.rounds} interleaved rounds of {args.steps} steps.\n\n{table}\n")


if __name__ == "__main__":
    main()
