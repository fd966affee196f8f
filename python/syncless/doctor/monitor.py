"""The always-on step monitor: where each step's time goes, measured without a single sync.

    for batch in syncless.watch(loader, log=log):
        train_step(batch)

Per step: the time blocked waiting for data (perf_counter around next()), the CPU time of the
step body (enqueue time), and the GPU time of the body's stream work (a pooled CUDA event pair,
read only once its end event completed: never a wait in the loop). Recording two events and
polling them costs ~8 µs of host time a step on an H200 host (benchmarks/doctor_overhead.py),
0.5% of a 1.7 ms step, so by default the GPU is timed on a sample of the steps chosen to keep
the measured cost under 0.25% of the step (every step once steps take ~10 ms; `gpu_every=1`
times them all). The rest of the monitor costs ~1 µs a step. Given a Logger(gpu_time=True), the
rows it logs carry the GPU clock, so the report also has the GPU's pace and lag for every step
at no cost (doctor/_gpuclock.py).

StepMonitor is the same thing for loops that don't iterate a loader:

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
import math
import statistics
from dataclasses import dataclass, field
from time import perf_counter, process_time
from typing import Any, Callable, Collection, Iterable, Iterator

import torch

from ._gpuclock import GpuClock, gpu_clock
from ._load import Load, LoadMeter
from ._loader import loader_settings
from ._sweep import Sweep, recipe, sweeper
from .findings import Finding, is_minor, starvation_finding
from .report import ReportText, render_watch, watch_html

__all__ = ["StepMonitor", "watch", "Watch", "MonitorSummary"]

_MAX_PENDING = 64            # event pairs in flight; beyond that a step goes untimed, never waits
GPU_BUDGET = 0.0025         # adaptive sampling keeps the event calls under 0.25% of step time
_MAX_EVERY = 64             # ... but times at least one step in 64


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
    loader: dict[str, Any] = field(default_factory=dict)
    data_cpu: float | None = None    # CPU share of the training thread's data wait (None: untimed)
    # CPU time of this process (all its threads: torch's intra-op ones too) in the step body,
    # its data loading out: how many CPUs a CPU loop's step keeps busy. None: a loop on the GPU
    # (its host thread is one CPU) or unmeasured.
    body_cpu_ms: float | None = None
    gpu_clock: GpuClock | None = None    # the GPU's pace and lag, from a Logger(gpu_time=True)

    @property
    def data_share(self) -> float:
        return self.data_ms / self.step_ms if self.step_ms > 0 else 0.0

    def findings(self, sweeper: Callable[[float], Sweep | None] | None = None
                 ) -> list[Finding]:
        """Data starvation, if fixing it wins back >= 1% of the step (the GPU span bounds it:
        a step can get no faster than its GPU work); `sweeper`: the loader's workers measured
        (findings.starvation_finding)."""
        f = starvation_finding(self.data_ms, self.step_ms, self.gpu_ms, self.loader,
                               cuda=self.gpu_ms is not None, sweeper=sweeper,
                               body_cpu_ms=self.body_cpu_ms,
                               trainer_cpus=1 if self.body_cpu_ms is None else
                               torch.get_num_threads())
        return [f] if f and not is_minor(f, self.step_ms) else []


def sampling_interval(cost_s: float, wall_s: float) -> int:
    """Time the GPU every n-th step, n chosen so the event calls (`cost_s` per timed step) stay
    under GPU_BUDGET of the step time (`wall_s`)."""
    if wall_s <= 0:
        return _MAX_EVERY
    return max(1, min(_MAX_EVERY, math.ceil(cost_s / (GPU_BUDGET * wall_s))))


class _GpuTiming:
    """GPU time of the steps a StepMonitor times: a pooled CUDA event pair around each, read once
    its end event completed (never a wait in the loop), on a sample of the steps chosen to keep
    the event calls under GPU_BUDGET of the step (gpu_every=None) or every n-th step."""

    def __init__(self, gpu: bool | None, gpu_every: int | None) -> None:
        self.gpu_every = gpu_every
        self._wanted = gpu
        self._state = 0                       # 0: undecided, 1: timing on, -1: off
        self._device = 0
        self._free: list[Any] = []
        self._pending: collections.deque[tuple[int, Any]] = collections.deque()
        self._EventPair: Any = None
        self.gpu_ms: dict[int, float] = {}
        self.untimed = 0                      # steps meant to be GPU-timed that were not
        self._pair: Any = None
        self.latest: tuple[int, float] | None = None   # newest reading not yet logged
        self._every = gpu_every or 1          # the sampling interval in force
        self._next_timed = 0                  # the next step to GPU-time
        # Adaptive sampling: a "cycle" runs from one timed step's start to the next one's.
        self._event_s = 0.0                   # host time in event calls this cycle
        self._cycle_wall = 0.0                # step wall time this cycle
        self._cycle_steps = 0
        self._created = False                 # this cycle created a pair (a one-off cost)
        # Event time of the recent cycles; their minimum is the cost estimate, because a record
        # made while the launch queue is full blocks until the GPU frees a slot, and that wait
        # is the GPU's pace (the next kernel launch would pay it), not the monitor's cost.
        self._costs: collections.deque[float] = collections.deque(maxlen=16)

    def begin(self, step: int) -> bool:
        """Start the step's GPU timing where it is due; whether the loop's GPU is timed (it has
        initialised CUDA, and gpu=False was not asked; until then, and on a host without CUDA,
        the loop runs on the CPU)."""
        if self._state == 0:
            self._decide()
        if self._state != 1:
            return False
        if step >= self._next_timed:
            self._start(step)
        return True

    def end(self, step: int, wall: float) -> None:
        if self._pair is not None or self._pending:
            self._stop(step)
        self._cycle_wall += wall
        self._cycle_steps += 1

    def _decide(self) -> None:
        # Never initialise CUDA for the monitor's sake: time the GPU only once the loop uses it.
        if self._wanted is False or not torch.cuda.is_available():
            self._state = -1
        # (torch.cuda.is_initialized() has no annotations in torch)
        elif torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # else: ask next step
            from .._torch import _C
            self._EventPair = _C.EventPair
            self._device = torch.cuda.current_device()
            self._state = 1

    def _start(self, step: int) -> None:
        t = perf_counter()
        if self.gpu_every is None and self._cycle_steps and not self._created:
            self._costs.append(self._event_s)
            wall = self._cycle_wall / self._cycle_steps
            # Shrink at once, grow by doubling: the first steps of a loop run ahead of the GPU
            # and look shorter than they will be once the launch queue is full.
            self._every = min(sampling_interval(min(self._costs), wall), 2 * self._every)
        self._event_s = self._cycle_wall = 0.0
        self._cycle_steps = 0
        self._created = False
        self._next_timed = step + self._every
        if self._free:
            pair = self._free.pop()
        elif len(self._pending) < _MAX_PENDING:
            pair = self._EventPair(self._device)
            self._created = True
        else:
            pair = None
        if pair is not None:
            try:
                pair.start()
            except RuntimeError:              # inside graph capture: this step goes untimed
                self._free.append(pair)
                pair = None
        if pair is None:
            self.untimed += 1
        self._pair = pair
        self._event_s += perf_counter() - t

    def _stop(self, step: int) -> None:
        t = perf_counter()
        pair, self._pair = self._pair, None
        if pair is not None:
            try:
                pair.stop()
                self._pending.append((step, pair))
            except RuntimeError:
                self._free.append(pair)
                self.untimed += 1
        if self._pending:
            self._poll()
        self._event_s += perf_counter() - t

    def _poll(self) -> None:
        pending = self._pending
        while pending:
            step, pair = pending[0]
            ms = pair.poll()
            if ms is None:
                return
            pending.popleft()
            self.gpu_ms[step] = ms
            self.latest = (step, ms)
            self._free.append(pair)        # start() clears its reading: reused as is

    def drain(self) -> None:
        while self._pending:
            step, pair = self._pending.popleft()
            self.gpu_ms[step] = pair.elapsed()
            self._free.append(pair)        # start() clears its reading: reused as is

    def close(self) -> None:
        self.drain()
        self._free.clear()


class StepMonitor:
    """Per-step data wait, CPU time and GPU time, at the cost of a few microseconds a step.

    gpu_every: GPU-time every n-th step (1: every step); None (default) picks n from the measured
    cost of the event calls and the step time (see sampling_interval)."""

    def __init__(self, log: Any = None, *, loader: Any = None, gpu: bool | None = None,
                 gpu_every: int | None = None, history: int = 100_000):
        if gpu_every is not None and (isinstance(gpu_every, bool) or
                                      not isinstance(gpu_every, int) or gpu_every < 1):
            raise ValueError(f"gpu_every must be a positive int, or None to choose it from the "
                             f"step time; got {gpu_every!r}")
        self.log = log
        self.loader: dict[str, Any] = loader_settings(loader) if loader is not None else {}
        self.gpu_every = gpu_every
        self._gpu = _GpuTiming(gpu, gpu_every)
        self.gpu_ms = self._gpu.gpu_ms        # step -> GPU ms, as read
        self.steps = 0
        self.data_s: collections.deque[float] = collections.deque(maxlen=history)
        self.cpu_s: collections.deque[float] = collections.deque(maxlen=history)
        # Process CPU time of each step body, the data loading inside it out (NaN: unmeasured):
        # read only while the GPU is not timed (a CPU loop, even on a host with CUDA), at ~0.4
        # µs a read.
        self.body_cpu_s: collections.deque[float] = collections.deque(maxlen=history)
        self._c0: float | None = None         # process CPU time at the open step's start
        self._cpu_inside = 0.0                # data loading's CPU time inside the open step
        self._wait_before = 0.0               # waited for data before the open step
        self._data_wall = self._data_cpu = 0.0
        self._wait_inside = 0.0               # waited for data inside the open step
        self._t0: float | None = None         # start of the open step
        self._log_offset: int | None = None   # logger step minus monitor step, from the first row

    @property
    def untimed(self) -> int:
        """Steps meant to be GPU-timed that were not (graph capture, too many in flight)."""
        return self._gpu.untimed

    # ---- marks --------------------------------------------------------------------------------

    def add_data_cpu(self, wall: float, cpu: float, own: float | None = None) -> None:
        """CPU time spent making the batches of `wall` seconds of data wait (the doctor's
        DataLoader timing): tells a loader that computes from one that waits (for disk, network,
        a sleep). `own`: this process's CPU time over that wait, where the batch was made here
        (num_workers=0), left out of the step body's."""
        self._data_wall += wall
        self._data_cpu += cpu
        if self._t0 is not None and own is not None:
            self._cpu_inside += own

    def add_data_wait(self, seconds: float) -> None:
        """Time blocked waiting for data: before a step (counted to it) or inside one."""
        if self._t0 is None:
            self._wait_before += seconds
        else:
            self._wait_inside += seconds

    def begin(self) -> None:
        self._c0 = None if self._gpu.begin(self.steps) else process_time()
        self._t0 = perf_counter()             # after the event call: it is the monitor's cost

    def end(self) -> None:
        t1 = perf_counter()
        c1 = process_time() if self._c0 is not None else math.nan
        if self._t0 is None:
            return
        step = self.steps
        inside = self._wait_inside
        data = self._wait_before + inside
        cpu = max(0.0, t1 - self._t0 - inside)
        self.data_s.append(data)
        self.cpu_s.append(cpu)
        self.body_cpu_s.append(max(0.0, c1 - self._c0 - self._cpu_inside)
                               if self._c0 is not None else math.nan)
        self._c0, self._cpu_inside = None, 0.0
        self._gpu.end(step, data + cpu)
        self._t0 = None
        self._wait_before = self._wait_inside = 0.0
        self.steps = step + 1
        if self.log is not None:
            self._log(step, data, cpu)

    def _log(self, step: int, data: float, cpu: float) -> None:
        values = {"data_wait_ms": data * 1e3, "cpu_ms": cpu * 1e3, "step_ms": (data + cpu) * 1e3}
        if self._gpu.latest is not None:
            # GPU times arrive a few steps late; the row says which step they measured.
            values["gpu_ms"] = self._gpu.latest[1]
            values["gpu_step"] = float(self._gpu.latest[0])
            self._gpu.latest = None
        at = max(step, getattr(self.log, "last_step", -1))
        if self._log_offset is None:
            self._log_offset = at - step
        self.log.log(values, step=at)

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        t = perf_counter()
        try:
            yield
        finally:
            self.add_data_wait(perf_counter() - t)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    # ---- results ------------------------------------------------------------------------------

    def drain(self) -> None:
        """Read every GPU time still in flight (waits for the GPU: call after the loop)."""
        self._gpu.drain()

    def close(self) -> None:
        self._gpu.close()

    def summary(self, skip: int = 0, exclude: Collection[int] = frozenset()) -> MonitorSummary:
        """Means over the steps recorded (after `skip` warm-up steps, without the steps in
        `exclude`: the doctor's stalls, periodic work it reports apart). Call drain() first for
        every GPU time; without it only the completed ones count."""
        first = self.steps - len(self.data_s)
        lo = max(skip - first, 0)
        kept = [s for s in range(first + lo, self.steps) if s not in exclude] or \
            list(range(first + lo, self.steps))
        data = [self.data_s[s - first] for s in kept]
        cpu = [self.cpu_s[s - first] for s in kept]
        body_cpu = [c for c in (self.body_cpu_s[s - first] for s in kept) if not math.isnan(c)]
        n = len(data)
        if n == 0:
            return MonitorSummary(0, 0.0, 0.0, 0.0, None, 0, None, 0.0, self.loader)
        walls = [d + c for d, c in zip(data, cpu)]
        gpu = [(self.gpu_ms[s], walls[j]) for j, s in enumerate(kept) if s in self.gpu_ms]
        gpu_ms = statistics.fmean(g for g, _ in gpu) if gpu else None
        idle = None
        if gpu:
            wall_ms = sum(w for _, w in gpu) * 1e3
            idle = min(1.0, max(0.0, 1.0 - sum(g for g, _ in gpu) / wall_ms)) if wall_ms else 0.0
        data_sorted = sorted(data)
        clock = None
        if self.log is not None and self._log_offset is not None:
            clock = gpu_clock(self.log, self._log_offset + first + lo)
        return MonitorSummary(
            steps=n, data_ms=statistics.fmean(data) * 1e3, cpu_ms=statistics.fmean(cpu) * 1e3,
            step_ms=statistics.fmean(walls) * 1e3, gpu_ms=gpu_ms, gpu_steps=len(gpu), idle=idle,
            data_p90_ms=data_sorted[min(n - 1, int(0.9 * n))] * 1e3, loader=self.loader,
            data_cpu=self._data_cpu / self._data_wall if self._data_wall > 0 else None,
            gpu_clock=clock,
            body_cpu_ms=statistics.fmean(body_cpu) * 1e3 if len(body_cpu) * 2 > n else None)


class Watch:
    """Iterate `iterable` like the original, timing each step; `.monitor` holds the numbers."""

    def __init__(self, iterable: Iterable[Any], log: Any = None,
                 monitor: StepMonitor | None = None,
                 **kw: Any):
        self.iterable = iterable
        self.monitor = monitor or StepMonitor(log=log, loader=iterable, **kw)
        self._sweeper: Callable[[float], Sweep | None] | None = None
        self._meter: LoadMeter | None = None   # from the first step: other processes' load
        self._load: Load | None = None         # ... read when the iteration ended

    def __len__(self) -> int:
        # An iterable without len() raises TypeError here, as len() of it would.
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        mon = self.monitor
        it = iter(self.iterable)
        if not mon.loader:
            mon.loader = loader_settings(it)
        begin, end = mon.begin, mon.end
        if self._meter is None:
            self._meter = LoadMeter()
        try:
            while True:
                t = perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                mon._wait_before += perf_counter() - t    # between steps: counted to the next
                begin()
                try:
                    yield item
                finally:
                    end()
        finally:                                  # the loop ended, or broke out (closed)
            self._load = self._meter.read()

    def load(self) -> Load | None:
        """Other processes' load on this process's CPUs over the steps (Linux; None elsewhere):
        from the first step to the end of the iteration, or until now while it goes on."""
        if self._meter is None:
            return None
        return self._load or self._meter.read()

    def summary(self, skip: int = 0) -> MonitorSummary:
        return self.monitor.summary(skip)

    def findings(self, m: MonitorSummary) -> list[Finding]:
        """The findings of summary `m`. Where the loader starves the step, the worker count is
        measured: side loaders of the DataLoader's own dataset, sampler and collate, with 1, 2,
        4 ... workers (seconds, once per Watch: later reports reuse it; _sweep.py)."""
        if self._sweeper is None:
            self._sweeper = sweeper(recipe(self.iterable))
        return m.findings(self._sweeper)

    def report(self) -> ReportText:
        """What the monitor measured so far and the loader fix it implies (no GPU wait; the
        first report that finds the loader starving the step measures its workers first)."""
        return ReportText(render_watch(self))

    __str__ = report

    def __repr__(self) -> str:
        return self.report()

    def _repr_html_(self) -> str:
        return watch_html(self)


def watch(iterable: Iterable[Any], log: Any = None, **kw: Any) -> Watch:
    """`for batch in syncless.watch(loader, log=log):` — per-step data wait, CPU and GPU time,
    logged as data_wait_ms / cpu_ms / step_ms / gpu_ms when a Logger is given. A
    Logger(gpu_time=True) also gives the report the GPU's pace and how far it trails the host,
    every step, from the GPU clock in the rows (no event, no launch). Keywords go to
    StepMonitor (gpu=False: no GPU timing; gpu_every=n: GPU-time every n-th step)."""
    return Watch(iterable, log=log, **kw)
