"""A changing Python number logged inside a reduce-overhead step: graphs, partitions, values, cost.

    python -m benchmarks.compile_numbers_probe        (CUDA)

A probe, not an interleaved benchmark: one run of 1,100 steps per variant, one after another,
timing steps 100-1,099 of each (MLP 3x512, batch 256, no_grad, flush(wait=False) every 100
steps). Variants: no log; log(loss=, lr=0.01) inside (a constant); log(loss=, lr=<the
scheduler's lr, read inside>) inside (changes every step: one recompile makes it dynamic, and
inductor splits the CUDA graph around the host value); log(loss=) inside and log(lr=) eagerly
after the compiled call. Per variant: µs per step, graphs compiled, cudagraph skips and
partitions, and whether every logged lr equals that step's.
"""
import time, torch, syncless
from torch._dynamo.utils import counters
torch.set_float32_matmul_precision("high")
rows = []
class S:
    def write(self, r): rows.extend(r)
res = {}
for how in ("no log", "constant inside", "changing inside", "changing outside"):
    torch._dynamo.reset(); counters.clear(); rows.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    log = syncless.Logger(every=100, sinks=S(), capacity=400)
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
    x = torch.randn(256, 512, device="cuda"); y = torch.randint(0, 10, (256,), device="cuda")
    want = []
    with torch.no_grad():
        for i in range(1100):
            if i == 100: torch.cuda.synchronize(); t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            fn(x, y)
            lr = opt.param_groups[0]["lr"]
            if how == "changing outside":
                log(lr=lr)
            want.append(0.01 if how == "constant inside" else lr)
            opt.step(); sched.step()
            if i % 100 == 99: log.flush(wait=False)
        torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / 1000 * 1e6
    log.close()
    got = [r.values["lr"] for r in rows if "lr" in r.values]
    print(f"{how}: {dt:.1f} us/step, graphs {counters['stats']['unique_graphs']}, skips "
          f"{counters['inductor']['cudagraph_skips']}, partitions {counters['inductor'].get('cudagraph_partitions')}, "
          f"rows {len(rows)}, lr rows {len(got)}, lr exact {got == (want if how != 'no log' else [])}, "
          f"distinct lr logged {len(set(got))}, lost {log.stats.lost}", flush=True)
