"""A changing Python number logged inside a reduce-overhead step: graphs, partitions, values, cost.

    python -m benchmarks.compile_numbers_probe [--device cuda|cpu] [--steps N]

A probe, not an interleaved benchmark: one run of 1,100 steps per variant, one after another,
timing steps 100-1,099 of each (MLP 3x512, batch 256, no_grad, flush(wait=False) every 100
steps). Variants: no log; log(loss=, lr=0.01) inside (a constant); log(loss=, lr=<the
scheduler's lr, read inside>) inside (changes every step: one recompile makes it dynamic, and
inductor splits the CUDA graph around the host value); log(loss=) inside and log(lr=) eagerly
after the compiled call. Per variant: µs per step, graphs compiled, cudagraph skips and
partitions, and whether every logged lr equals that step's.
"""
import argparse
import time

import torch

import syncless
from torch._dynamo.utils import counters

VARIANTS = ("no log", "constant inside", "changing inside", "changing outside")


class Rows:
    def __init__(self):
        self.rows = []

    def write(self, rows):
        self.rows.extend(rows)


def run(how: str, device: str, steps: int) -> str:
    """One variant: `steps` steps, the first 100 untimed (compiles, warm-up, recording)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sink = Rows()
    log = syncless.Logger(every=100, sinks=sink, capacity=400)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if how == "constant inside":
            log(loss=loss, lr=0.01)
        elif how == "changing inside":
            log(loss=loss, lr=opt.param_groups[0]["lr"])
        elif how == "changing outside":
            log(loss=loss)
        return loss

    fn = torch.compile(step, mode="reduce-overhead")
    x = torch.randn(256, 512, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    want = []
    with torch.no_grad():
        for i in range(steps):
            if i == 100:
                sync()
                t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            fn(x, y)
            lr = opt.param_groups[0]["lr"]
            if how == "changing outside":
                log(lr=lr)
            want.append(0.01 if how == "constant inside" else lr)
            opt.step()
            sched.step()
            if i % 100 == 99:
                log.flush(wait=False)
        sync()
        dt = (time.perf_counter() - t0) / (steps - 100) * 1e6
    log.close()
    got = [r.values["lr"] for r in sink.rows if "lr" in r.values]
    inductor = counters["inductor"]
    return (f"{how}: {dt:.1f} us/step, graphs {counters['stats']['unique_graphs']}, skips "
            f"{inductor['cudagraph_skips']}, partitions {inductor.get('cudagraph_partitions')}, "
            f"rows {len(sink.rows)}, lr rows {len(got)}, "
            f"lr exact {got == (want if how != 'no log' else [])}, "
            f"distinct lr logged {len(set(got))}, lost {log.stats.lost}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=1100)
    args = p.parse_args()
    torch.set_float32_matmul_precision("high")
    for how in VARIANTS:
        print(run(how, args.device, args.steps), flush=True)


if __name__ == "__main__":
    main()
