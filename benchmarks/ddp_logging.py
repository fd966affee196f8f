"""DDP step time with and without cross-rank metric logging, 2 ranks (2 GPUs and NCCL, or CPU
and gloo with --device cpu).

    python -m benchmarks.ddp_logging [--device cpu] [--quick] [--rounds 15] [--steps 50] [--out]

Variants, interleaved round by round (same order on every rank), medians over rounds:
  no logging          metrics computed, not logged
  syncless reduce     syncless.Logger(reduce="mean"): the default, reduce_on="host": the
                      delivered rows are reduced on a gloo group by the logger's own thread
  syncless reduce_on=device  Logger(reduce="mean", reduce_on="device", max_delay=None): one
                      async all-reduce per flush (every 100), enqueued on the training stream
  all_reduce+.item()  per step: all_reduce of the 4 metrics, then .item() each (Lightning's
                      sync_dist style)
Each rank times its own steps (synchronize before reading the clock); rank 0 reports the
per-round ratio to no logging, median [IQR] and the 95% CI of the median.
"""
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._common import (arg_parser, env_info, md_table, num, pct_ci, pct_spread, pick_device,
                      ratio_summary, summarize, write_results)

VARIANTS = ("no logging", "syncless reduce", "syncless reduce_on=device", "all_reduce+.item()")


def worker(rank, world, store, args, out_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # NVLink multicast stays off
    cuda = args.device != "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)                            # two ranks share the host's cores
    import syncless
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                            torch.nn.Linear(width, width), torch.nn.GELU(),
                            torch.nn.Linear(width, 10)).to(dev),
        device_ids=[rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, width, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    log = syncless.Logger(every=100, reduce="mean", device=dev)
    log_dev = syncless.Logger(every=100, reduce="mean", device=dev, reduce_on="device",
                              max_delay=None)

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

    def sync_dist(*m):
        packed = torch.stack(m)
        dist.all_reduce(packed)
        for v in (packed / world).unbind():
            v.item()

    record = dict(zip(VARIANTS, (lambda *m: None,
                                 lambda loss, acc, gn, conf: log(loss=loss, acc=acc,
                                                                 grad_norm=gn, conf=conf),
                                 lambda loss, acc, gn, conf: log_dev(loss=loss, acc=acc,
                                                                     grad_norm=gn, conf=conf),
                                 sync_dist)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in record.values():                                 # warm-up
        for _ in range(10):
            step(fn)
    times = {name: [] for name in VARIANTS}
    order_rng = random.Random(args.seed)                       # same order on every rank
    for _ in range(args.rounds):
        names = list(VARIANTS)
        order_rng.shuffle(names)
        for name in names:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(record[name])
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    log.close()
    log_dev.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def markdown(res: dict) -> str:
    rows = [[name, num(r["ms_per_step"]["median"]), pct_spread(r.get("vs_none")),
             pct_ci(r["vs_none"]["ci95"]) if "vs_none" in r else "—"]
            for name, r in res["variants"].items()]
    return (f"2 ranks ({res['backend']}), MLP width {res['width']}, batch {res['batch']} per "
            f"rank, {res['rounds']} interleaved rounds of {res['steps']} steps.\n\n"
            + md_table(["variant", "ms/step", "vs no logging [IQR]", "95% CI"], rows) + "\n")


def main(argv=None) -> int:
    p = arg_parser(__doc__, rounds=15)
    p.add_argument("--steps", type=int, default=None, help="steps per round (default 50)")
    p.add_argument("--width", type=int, default=None, help="default 4096 (CUDA), 256 (CPU)")
    p.add_argument("--batch", type=int, default=None, help="default 512 (CUDA), 32 (CPU)")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        sys.exit("ddp_logging needs two GPUs (or --device cpu)")
    args.device = device.type
    args.rounds = args.rounds or (3 if args.quick else 15)
    args.steps = args.steps or (5 if args.quick else 50)
    args.width = args.width or (4096 if cuda else 256)
    args.batch = args.batch or (512 if cuda else 32)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "times.json")
        mp.start_processes(worker, args=(2, os.path.join(tmp, "store"), args, out_path),
                           nprocs=2, start_method="spawn")
        with open(out_path) as f:
            times = json.load(f)
    res = {"env": env_info(device, sys.argv[1:] if argv is None else argv,
                           "benchmarks.ddp_logging"),
           "quick": args.quick, "backend": "NCCL" if cuda else "gloo", "gpus": 2 if cuda else 0,
           "width": args.width, "batch": args.batch, "rounds": args.rounds, "steps": args.steps,
           "times_ms": times, "variants": {}}
    for name, t in times.items():
        res["variants"][name] = {"ms_per_step": summarize(t)}
        if name != "no logging":
            res["variants"][name]["vs_none"] = ratio_summary(times, name, "no logging")
    write_results(args.out, "ddp_logging" if cuda else "ddp_logging_cpu", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
