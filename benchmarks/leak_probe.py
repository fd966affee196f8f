"""Where does RSS grow per log() call on CUDA? Each probe runs 300k calls and prints KiB per
100k calls after a 100k warm-up. Used to chase the growth seen by the leak test on torch 2.11."""
import gc
import time

import torch

import syncless
from syncless import _C


def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def probe(name, fn, n=300_000):
    for _ in range(100_000):
        fn()
    gc.collect()
    r0, t0 = rss(), time.perf_counter()
    for _ in range(n):
        fn()
    gc.collect()
    print(f"{name:40s} {(rss() - r0) / (n / 100_000):8.1f} KiB per 100k calls "
          f"({(time.perf_counter() - t0) / n * 1e6:.2f} µs/call)", flush=True)


x = torch.tensor(1.5, device="cuda")
y = torch.tensor(7, device="cuda")
xc, yc = torch.tensor(1.5), torch.tensor(7)
probe("_C.read_host_values (2 CPU tensors)", lambda: _C.read_host_values({"a": xc, "b": yc}))
probe("_C.read_host_values (2 CUDA tensors)", lambda: _C.read_host_values({"a": x, "b": y}))
probe("_C.read_host_values (2 floats)", lambda: _C.read_host_values({"a": 1.0, "b": 2.0}))
log = syncless.Logger(every=1000, device="cuda")
log(a=x, b=y)
ring, cols = log._ring, log._columns
probe("ring.gather, no flush", lambda: ring.gather({"a": x, "b": y}, cols, 0, 0, 0.0))
probe("ring.gather floats, no flush", lambda: ring.gather({"a": 1.0, "b": 2.0}, cols, 0, 0, 0.0))
probe("Logger.log with flushes", lambda: log(a=x, b=y))
log.close()
