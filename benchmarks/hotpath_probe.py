"""Where the microseconds of log() and timer() go, piece by piece (CUDA only).

    python -m benchmarks.hotpath_probe

Each row: median over 20 blocks of 500 calls (_common.block_us: GPU idle at each block's start,
synchronize outside the clock). A diagnostic for tuning, not a comparison with peers (see
benchmarks/percall.py for that). It reaches into private attributes, so a row the build lacks
prints as unavailable.
"""
import statistics

import torch

import syncless
from syncless import _C
from syncless.timer import _auto_device

from ._common import block_us


def cost(fn, calls: int = 500, blocks: int = 20) -> float:
    return statistics.median(block_us(fn, calls, torch.cuda.synchronize)
                             for _ in range(blocks + 2))


def print_costs(rows: list, calls: int = 500) -> None:
    for name, fn in rows:
        try:
            print(f"{name:42s} {cost(fn, calls):7.2f} µs")
        except Exception as exc:                     # private API: it moves between builds
            print(f"{name:42s} unavailable ({type(exc).__name__}: {exc})")


def main() -> None:
    x = torch.zeros((), device="cuda")
    m4 = {f"m{i}": torch.randn((), device="cuda") for i in range(4)}
    m64 = {f"m{i}": torch.randn((), device="cuda") for i in range(64)}
    log = syncless.Logger(every=100, device="cuda")
    log.log(m64)
    ring, cols = log._ring, log._columns
    pair = _C.EventPair(0)

    def timed_block():
        with syncless.timer():
            pass
    rows = [
        ("torch x.zero_() (one torch launch)", lambda: x.zero_()),
        ("ring.gather, K=0 (bare gather launch)", lambda: ring.gather({}, cols, 0, 0, 0.0)),
        ("ring.gather, K=4", lambda: ring.gather(m4, cols, 0, 0, 0.0)),
        ("ring.gather, K=64", lambda: ring.gather(m64, cols, 0, 0, 0.0)),
        ("log.log(K=4)", lambda: log.log(m4)),
        ("log(**K=4)", lambda: log(**m4)),
        ("log.log(K=64)", lambda: log.log(m64)),
        ("_C.read_host_values(K=4 CUDA) (reads only)", lambda: _C.read_host_values(m4)),
        ("EventPair(0)", lambda: _C.EventPair(0)),
        ("pair.start()", pair.start),
        ("pair.start(); pair.stop()", lambda: (pair.start(), pair.stop())),
        ("_auto_device()", _auto_device),
        ("with syncless.timer(): pass", timed_block),
    ]
    print_costs(rows)
    log.close()
    for part in (flush_parts, delivery_rows):
        try:
            part()
        except Exception as exc:
            print(f"{part.__name__} unavailable ({type(exc).__name__}: {exc})")


def flush_parts() -> None:
    """log.flush(wait=False) after one row, whole (its delivery thread then decodes that row
    while the next calls run) and the pieces of its hand-over, each alone, on this thread."""
    import queue
    import time as _time

    from syncless import _handover as lg
    from syncless.rows import Row

    log = syncless.Logger(every=1000, capacity=1000, device="cuda")
    m4 = {f"m{i}": torch.randn((), device="cuda") for i in range(4)}
    log.log(m4)
    ring = log._ring
    jobs = queue.SimpleQueue()

    def log_and_flush():
        log.log(m4)
        log.flush(wait=False)

    def device_ctx():
        with torch.cuda.device(log._device):
            pass

    def copy_cycle():                # enqueue the copy; the wait and a decode of no rows free it
        ring.copy_to(w.win)
        w.win.wait()
        w.win.decode(1 << 62, log._names, {}, Row, 0.0)

    w = lg.Window(log._device, log._gen.nbytes)
    pieces = [
        ("log.log(K=4) + flush(wait=False)", log_and_flush),
        ("log.log(K=4) alone (same logger)", lambda: log.log(m4)),
        ("with torch.cuda.device(...)", device_ctx),
        ("ring.capturing()", ring.capturing),
        ("ring.copy_to + wait + empty decode", copy_cycle),
        ("Pool.reuse()", lambda: log._handover.pool.reuse(0)),
        ("SimpleQueue.put (no reader)", lambda: jobs.put(1)),
        ("time.time()", _time.time),
    ]
    print_costs(pieces, calls=200)
    log.close()


def delivery_rows(rows: int = 100) -> None:
    """The delivery thread's work per row of a 4-metric flush (run here, on this thread):
    decoding a window into Row objects (with the GPU clock of each: gpu_time=True), and the
    hand-over to one sink."""
    from syncless._handover import Window as _Window
    from syncless.rows import Row

    class Keep:                                      # compile_step's sink: steps only
        def write(self, batch):
            self.steps = [r.step for r in batch]

    log = syncless.Logger(every=10 * rows, capacity=10 * rows, device="cuda", sinks=[Keep()])
    m4 = {f"m{i}": torch.randn((), device="cuda") for i in range(4)}
    for _ in range(rows):
        log.log(m4)
    w = _Window(log._device, log._gen.nbytes)
    log._ring.copy_to(w.win)
    w.win.wait()
    names = log._names
    decoded = w.win.decode(0, names, {}, Row, 0.0)[1]
    delivery = log._delivery
    pieces = [
        ("Window.decode -> Row", lambda: w.win.decode(0, names, {}, Row, 0.0)),
        ("Window.decode -> Row, latest", lambda: w.win.decode(0, names, {}, Row, 0.0, {})),
        ("Window.decode -> Row, gpu clock",
         lambda: w.win.decode(0, names, {}, Row, 0.0, None, [])),
        ("Delivery._emit (latest, counts, one sink)", lambda: delivery._emit(decoded, None)),
        ("Delivery._emit, latest done in decode", lambda: delivery._emit(decoded, None, True)),
    ]
    for name, fn in pieces:
        name = f"{name}, per row of {rows}"
        try:
            us = statistics.median(block_us(fn, 20, lambda: None) for _ in range(52))
            print(f"{name:42s} {us / rows:7.3f} µs")
        except Exception as exc:                     # an older build lacks the argument
            print(f"{name:42s} unavailable ({type(exc).__name__}: {exc})")
    log.close()


if __name__ == "__main__":
    main()
