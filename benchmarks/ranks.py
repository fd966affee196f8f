"""Logger(reduce="mean") across many gloo ranks on one CPU host (issue 35): what the training
loop pays per rank, how late the reduced row comes, and what one 3x slower rank does.

    python -m benchmarks.ranks [--ranks 2 8 16 32 48 64] [--steps 150] [--step-ms 10] [--out DIR]

Each rank runs sleep-dominated steps (a stand-in for compute that leaves the cores to the
others: this 2-core host holds 32 processes only that way), 4 metrics a step, in rounds
interleaved the same way on every rank: "no logger" (the metrics made, not logged) and
"logger" (Logger(every=10, max_delay=0.1, reduce="mean"), reduced on the host). Then one round
with the last rank sleeping 3x longer. Per rank: the median step time of each; rank 0: the
delay from each step's log() call to its reduced row reaching a sink (median, p90), and the
RSS of every rank at the end. A rank count whose processes do not fit (or fail) is reported
as where the sweep stopped.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ._common import arg_parser, env_info, md_table, quantile, write_results

WORKER = r'''
import json, os, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, tmp, steps, step_s, rounds = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                            int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
import syncless
out = {"plain": [], "logger": [], "delays": []}
def loop(log, sleep):
    took = []
    for step in range(steps):
        began = time.perf_counter()
        time.sleep(sleep)
        m = {"loss": float(step + rank), "acc": 0.5, "gn": float(rank), "lr": 1e-3}
        if log is not None:
            log(**m)
        took.append(time.perf_counter() - began)
    return statistics.median(took)
for r in range(rounds):
    for variant in (("plain", "logger") if r % 2 == 0 else ("logger", "plain")):
        if variant == "plain":
            out["plain"].append(loop(None, step_s))
            continue
        got = []
        log = syncless.Logger(every=10, max_delay=0.1, reduce="mean", sinks=[
            syncless.sinks.Callback(lambda s, t, v: got.append(time.time() - t))])
        out["logger"].append(loop(log, step_s))
        log.close()
        out["delays"] += got
got = []
log = syncless.Logger(every=10, max_delay=0.1, reduce="mean", sinks=[
    syncless.sinks.Callback(lambda s, t, v: got.append((time.time() - t, v["ranks/slowest"]
                                                        if "ranks/slowest" in v else None)))])
out["slow_round"] = loop(log, step_s * (3 if rank == world - 1 else 1))
log.close()
out["slow_delays"] = [d for d, _ in got]
out["slowest"] = [w for _, w in got if w is not None]
out["stragglers"] = log.stragglers()._asdict() if log.stragglers() else None
with open("/proc/self/status") as f:
    out["rss_mib"] = [int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS")][0]
json.dump(out, open(f"{tmp}/rank{rank}.json", "w"))
dist.destroy_process_group()
'''


def host_name():
    """The machine, named: no GPU, the CPU model, its cores and memory."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.startswith("model name")), "unknown CPU")
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return f"no GPU: CPU host, {model}, {os.cpu_count()} cores, {total / 2**20:.0f} GiB"


def _available_mib():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 1024


def run_world(world, args, per_rank_mib):
    need = world * per_rank_mib * 1.1 + 2048      # keep 2 GiB for the rest of the host
    if _available_mib() < need:
        return {"world": world, "failed": f"not started: {world} ranks need about {need:.0f} "
                f"MiB, {_available_mib():.0f} MiB available"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(os.path.dirname(__file__), "..", "python"),
             os.environ.get("PYTHONPATH", "")]))
        began = time.monotonic()
        procs = [subprocess.Popen([sys.executable, script, str(r), str(world), tmp,
                                   str(args.steps), str(args.step_ms / 1e3), str(args.rounds)],
                                  env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        errs = [p.communicate(timeout=args.timeout)[1] for p in procs]
        if any(p.returncode for p in procs):
            bad = next(i for i, p in enumerate(procs) if p.returncode)
            return {"world": world, "failed": f"rank {bad}: {errs[bad][-500:]}"}
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    wall = time.monotonic() - began
    plain = [statistics.median(r["plain"]) * 1e3 for r in ranks]
    logger = [statistics.median(r["logger"]) * 1e3 for r in ranks]
    over = [lg / pl - 1 for lg, pl in zip(logger, plain)]
    slow_fast = [r["slow_round"] * 1e3 for r in ranks[:-1]]
    r0 = ranks[0]
    return {
        "world": world, "wall_s": wall,
        "plain_ms": plain, "logger_ms": logger, "overhead": over,
        "slow_round_fast_ranks_ms": slow_fast,
        "delay_ms": {"median": statistics.median(r0["delays"]) * 1e3,
                     "p90": quantile(r0["delays"], 0.9) * 1e3},
        "slow_delay_ms": {"median": statistics.median(r0["slow_delays"]) * 1e3,
                          "p90": quantile(r0["slow_delays"], 0.9) * 1e3},
        "slowest_is_slow_rank": sum(w == world - 1 for w in r0["slowest"]) / len(r0["slowest"]),
        "stragglers": r0["stragglers"],
        "rss_mib": [r["rss_mib"] for r in ranks],
    }


def main(argv=None):
    p = arg_parser(__doc__, rounds=4)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 16, 32, 48, 64])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 4)
    if args.quick:
        args.ranks, args.steps = [2], 30
    results = []
    per_rank = 400.0                               # MiB, until a run measures it
    for world in args.ranks:
        res = run_world(world, args, per_rank)
        if "rss_mib" in res:
            per_rank = max(res["rss_mib"])
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}), flush=True)
        if "failed" in res:
            break
    rows = []
    for r in results:
        if "failed" in r:
            rows.append([r["world"], "failed: " + r["failed"][:80], "", "", "", "", "", ""])
            continue
        rows.append([r["world"], f"{statistics.median(r['plain_ms']):.2f}",
                     f"{statistics.median(r['logger_ms']):.2f}",
                     f"{statistics.median(r['overhead']) * 100:+.1f}% "
                     f"[{min(r['overhead']) * 100:+.1f}, {max(r['overhead']) * 100:+.1f}]",
                     f"{statistics.median(r['slow_round_fast_ranks_ms']):.2f}",
                     f"{r['delay_ms']['median']:.0f} / {r['delay_ms']['p90']:.0f}",
                     f"{r['slow_delay_ms']['median']:.0f} / {r['slow_delay_ms']['p90']:.0f}",
                     f"{statistics.median(r['rss_mib']):.0f} (max {max(r['rss_mib']):.0f})"])
    text = (f"{args.steps} sleep-dominated steps of {args.step_ms} ms per round, {args.rounds} "
            "rounds interleaved (no logger / logger), 4 metrics a step, Logger(every=10, "
            "max_delay=0.1, reduce='mean') reduced on the host (gloo). CPU only: 2 shared cores, "
            "so the ranks' processes compete for them.\n\n"
            + md_table(["ranks", "step ms, no logger (median rank)", "step ms, logger",
                        "logger overhead per rank: median [min, max]",
                        "step ms of the fast ranks, last rank 3x slower",
                        "delay step -> reduced row ms (median / p90)",
                        "same, last rank 3x slower", "RSS MiB per rank"], rows)
            + "\n\nA rank count that did not run says why (the sweep stops there).")
    data = {"env": env_info(torch.device("cpu"), sys.argv[1:], "benchmarks.ranks"),
            "args": vars(args), "results": results}
    data["env"]["gpu"] = host_name()
    write_results(args.out, "ranks", data, text)


if __name__ == "__main__":
    main()
