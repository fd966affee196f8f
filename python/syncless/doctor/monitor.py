"""The always-on step monitor: where each step's time goes, measured without a single sync.

    for batch in syncless.watch(loader, log=log):
        train_step(batch)

Per step: the time blocked waiting for data (perf_counter around next()), the CPU time of the
step body (enqueue time), and the GPU time of the body's stream work (a pooled CUDA event pair,
read only once its end event completed: never a wait in the loop). StepMonitor is the same thing
for loops that don't iterate a loader:

    mon = StepMonitor(log=log)
    for ...:
        with mon.data():
            batch = next(it)
        with mon.step():
            train_step(batch)
"""
from __future__ import annotations

import collections
import contextlib
import os
import statistics
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Iterable, Iterator

import torch

__all__ = ["StepMonitor", "watch", "Watch", "MonitorSummary", "loader_settings"]

_MAX_PENDING = 64            # event pairs in flight; beyond that a step goes untimed, never waits


@dataclass
class MonitorSummary:
    steps: int
    data_ms: float               # mean time blocked waiting for data, per step
    cpu_ms: float                # mean CPU time of the step body (enqueue, incl. any syncs)
    step_ms: float               # mean host wall time per step (data + body)
    gpu_ms: float | None         # mean GPU time of the body's stream span (None: no CUDA timing)
    gpu_steps: int               # steps whose GPU time was read
    idle: float | None           # estimated GPU idle fraction: 1 - GPU time / wall time
    data_p90_ms: float = 0.0
    loader: dict = field(default_factory=dict)

    @property
    def data_share(self) -> float:
        return self.data_ms / self.step_ms if self.step_ms > 0 else 0.0

    def findings(self) -> list:
        from .report import starvation_finding
        f = starvation_finding(self.data_ms, self.step_ms, self.idle, self.loader)
        return [f] if f else []


def loader_settings(loader: Any) -> dict:
    """The DataLoader settings the starvation advice depends on, from a DataLoader or one of its
    iterators; {} for anything else."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    if isinstance(loader, DataLoader):
        return {"num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
                "persistent_workers": loader.persistent_workers,
                "prefetch_factor": loader.prefetch_factor, "batch_size": loader.batch_size}
    if isinstance(loader, _BaseDataLoaderIter):
        return {"num_workers": loader._num_workers, "pin_memory": loader._pin_memory,
                "persistent_workers": getattr(loader, "_persistent_workers", False),
                "prefetch_factor": getattr(loader, "_prefetch_factor", None),
                "batch_size": None}
    return {}


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class StepMonitor:
    """Per-step data wait, CPU time and GPU time, at the cost of a few microseconds a step."""

    def __init__(self, log: Any = None, *, loader: Any = None, gpu: bool | None = None,
                 history: int = 100_000):
        self.log = log
        self.loader = loader_settings(loader) if loader is not None else {}
        self._gpu_wanted = gpu
        self._gpu = 0                         # 0: undecided, 1: timing on, -1: off
        self._device = 0
        self._free: list = []
        self._pending: collections.deque = collections.deque()
        self._EventPair = None
        self.steps = 0
        self.data_s: collections.deque = collections.deque(maxlen=history)
        self.cpu_s: collections.deque = collections.deque(maxlen=history)
        self.gpu_ms: dict[int, float] = {}
        self.untimed = 0                      # steps not GPU-timed (too many pairs in flight)
        self._wait_before = 0.0               # waited for data before the open step
        self._wait_inside = 0.0               # waited for data inside the open step
        self._t0 = None                       # start of the open step
        self._pair = None
        self._latest_gpu = None               # (step, ms) newest GPU reading not yet logged

    # ---- marks --------------------------------------------------------------------------------

    def add_data_wait(self, seconds: float) -> None:
        """Time blocked waiting for data: before a step (counted to it) or inside one."""
        if self._t0 is None:
            self._wait_before += seconds
        else:
            self._wait_inside += seconds

    def begin(self) -> None:
        self._t0 = perf_counter()
        if self._gpu == 0:
            self._decide_gpu()
        if self._gpu == 1:
            if self._free:
                pair = self._free.pop()
            elif len(self._pending) < _MAX_PENDING:
                pair = self._EventPair(self._device)
            else:
                pair = None
            if pair is not None:
                try:
                    pair.start()
                except RuntimeError:          # inside graph capture: this step goes untimed
                    self._free.append(pair)
                    pair = None
            self._pair = pair

    def end(self) -> None:
        t1 = perf_counter()
        if self._t0 is None:
            return
        step = self.steps
        body = t1 - self._t0
        data = self._wait_before + self._wait_inside
        cpu = max(0.0, body - self._wait_inside)
        self.data_s.append(data)
        self.cpu_s.append(cpu)
        pair, self._pair = self._pair, None
        if pair is not None:
            try:
                pair.stop()
                self._pending.append((step, pair))
            except RuntimeError:
                self._free.append(pair)
                self.untimed += 1
        elif self._gpu == 1:
            self.untimed += 1
        if self._pending:
            self._poll()
        self._t0 = None
        self._wait_before = self._wait_inside = 0.0
        self.steps += 1
        if self.log is not None:
            self._log(step, data, cpu)

    def _decide_gpu(self) -> None:
        # Never initialise CUDA for the monitor's sake: time the GPU only once the loop uses it.
        if self._gpu_wanted is False or not torch.cuda.is_available():
            self._gpu = -1
        elif torch.cuda.is_initialized():          # else undecided: ask again next step
            from .. import _C
            self._EventPair = _C.EventPair
            self._device = torch.cuda.current_device()
            self._gpu = 1

    def _poll(self) -> None:
        pending = self._pending
        while pending:
            step, pair = pending[0]
            ms = pair.poll()
            if ms is None:
                return
            pending.popleft()
            self.gpu_ms[step] = ms
            self._latest_gpu = (step, ms)
            self._free.append(pair)

    def _log(self, step: int, data: float, cpu: float) -> None:
        values = {"data_wait_ms": data * 1e3, "cpu_ms": cpu * 1e3, "step_ms": (data + cpu) * 1e3}
        if self._latest_gpu is not None:
            # GPU times arrive a few steps late; the row says which step they measured.
            values["gpu_ms"] = self._latest_gpu[1]
            values["gpu_step"] = float(self._latest_gpu[0])
            self._latest_gpu = None
        self.log.log(values, step=max(step, getattr(self.log, "last_step", -1)))

    @contextlib.contextmanager
    def data(self):
        t = perf_counter()
        try:
            yield
        finally:
            self.add_data_wait(perf_counter() - t)

    @contextlib.contextmanager
    def step(self):
        self.begin()
        try:
            yield
        finally:
            self.end()

    # ---- results ------------------------------------------------------------------------------

    def drain(self) -> None:
        """Read every GPU time still in flight (waits for the GPU: call after the loop)."""
        while self._pending:
            step, pair = self._pending.popleft()
            self.gpu_ms[step] = pair.elapsed()
            self._free.append(pair)

    def close(self) -> None:
        self.drain()
        self._free.clear()

    def summary(self, skip: int = 0) -> MonitorSummary:
        """Means over the steps recorded (after `skip` warm-up steps). Call drain() first for
        every GPU time; without it only the completed ones count."""
        first = self.steps - len(self.data_s)
        lo = max(skip - first, 0)
        data = list(self.data_s)[lo:]
        cpu = list(self.cpu_s)[lo:]
        n = len(data)
        if n == 0:
            return MonitorSummary(0, 0.0, 0.0, 0.0, None, 0, None, 0.0, self.loader)
        walls = [d + c for d, c in zip(data, cpu)]
        gpu = [(self.gpu_ms[s], walls[s - first - lo]) for s in range(first + lo, self.steps)
               if s in self.gpu_ms]
        gpu_ms = statistics.fmean(g for g, _ in gpu) if gpu else None
        idle = None
        if gpu:
            wall_ms = sum(w for _, w in gpu) * 1e3
            idle = min(1.0, max(0.0, 1.0 - sum(g for g, _ in gpu) / wall_ms)) if wall_ms else 0.0
        data_sorted = sorted(data)
        return MonitorSummary(
            steps=n, data_ms=statistics.fmean(data) * 1e3, cpu_ms=statistics.fmean(cpu) * 1e3,
            step_ms=statistics.fmean(walls) * 1e3, gpu_ms=gpu_ms, gpu_steps=len(gpu), idle=idle,
            data_p90_ms=data_sorted[min(n - 1, int(0.9 * n))] * 1e3, loader=self.loader)


class Watch:
    """Iterate `iterable` like the original, timing each step; `.monitor` holds the numbers."""

    def __init__(self, iterable: Iterable, log: Any = None, monitor: StepMonitor | None = None,
                 **kw: Any):
        self.iterable = iterable
        self.monitor = monitor or StepMonitor(log=log, loader=iterable, **kw)

    def __len__(self) -> int:
        return len(self.iterable)

    def __iter__(self) -> Iterator:
        mon = self.monitor
        it = iter(self.iterable)
        if not mon.loader:
            mon.loader = loader_settings(it)
        while True:
            t = perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            mon.add_data_wait(perf_counter() - t)
            mon.begin()
            try:
                yield item
            finally:
                mon.end()

    def summary(self, skip: int = 0) -> MonitorSummary:
        return self.monitor.summary(skip)


def watch(iterable: Iterable, log: Any = None, **kw: Any) -> Watch:
    """`for batch in syncless.watch(loader, log=log):` — per-step data wait, CPU and GPU time,
    logged as data_wait_ms / cpu_ms / step_ms / gpu_ms when a Logger is given."""
    return Watch(iterable, log=log, **kw)
