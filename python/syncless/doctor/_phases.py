"""The phases a ScriptSession moves a script's steps through, one class each:

  warm-up  not measured; ends once the loader's initial prefetch is used up and the steps settled
  plain    timed unobserved (boundary timestamps only): the step the user has, and its stalls
  monitor  data wait, CPU and GPU time per step, the stack sampler, optimizer.step() timed
  probe    (CUDA) each step queued behind a GPU sleep: the GPU work a step needs
  audit    under CUPTI: every sync with its line, kernels per step
  kernels  (CUDA, or --trace) under torch.profiler: kernel time, syncs' blocked time and idle

The session calls enter() when a phase begins, open_step() and close_step() around each of its
steps, complete() after each step, and leave() at its end (finished=False: cut short)."""
from __future__ import annotations

import os
import shutil
import threading
from time import perf_counter
from typing import Any, Protocol

import torch

from ._boundary import Boundaries
from ._feed import Feed
from ._loader import ready_batches
from ._sampler import StackSampler
from ._scratch import own_tempdir
from ._series import Series
from .audit import Audit
from .diagnose import KernelTime, QueueProbe, profiler, trace_gpu
from .monitor import StepMonitor

__all__ = ["Driver", "Phase", "WarmUp", "Plain", "Monitor", "Probe", "AuditPhase", "Trace", "cuda"]

WARMUP_EXTRA = 20        # warm-up steps past --warmup while steps settle or the prefetch lasts
SETTLED = 3.0            # a warm-up ends on a step at most this many times its fastest step
SETTLED_MS = 5.0         # ... plus 5 ms (a loaded host's hiccup; compiles take 100s of ms)
PLAIN_WALL_S = 60.0      # the unobserved window grows to see a stall again, for at most this long


def cuda() -> bool:
    # torch.cuda.is_initialized() has no annotations in torch
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return torch.cuda.is_available() and initialized


def drained_clock() -> float:
    """perf_counter() once the GPU has run everything queued."""
    if cuda():
        torch.cuda.synchronize()
    return perf_counter()


class Driver(Protocol):
    """What the phases read and write of the session that drives them (ScriptSession)."""
    phase: str | None
    trace: str | None
    bounds: Boundaries
    feed: Feed
    monitor: StepMonitor
    sampler: StackSampler
    audit: Audit
    done: dict[str, int]
    durations: dict[str, list[float]]
    why: list[str]
    plain: Plain
    watching: Monitor

    def split(self, phase: str) -> Series: ...

    def evaluation_only(self) -> bool: ...


class Phase:
    name = ""

    def __init__(self, session: Driver) -> None:
        self.s = session

    def enter(self) -> None:
        pass

    def open_step(self) -> None:
        pass

    def close_step(self) -> None:
        pass

    def complete(self, n: int, plan: int) -> bool:
        """Whether the phase is done after its `n`-th step (`plan`: the steps asked for)."""
        return n >= plan

    def leave(self, finished: bool) -> None:
        pass


class WarmUp(Phase):
    name = "warm-up"

    def __init__(self, session: Driver) -> None:
        super().__init__(session)
        self._ready: list[int] = []          # the loader's ready batches, warm-up steps

    def open_step(self) -> None:
        self.s.monitor.begin()

    def close_step(self) -> None:
        self.s.monitor.end()

    def complete(self, n: int, plan: int) -> bool:
        """The warm-up ends after `plan` steps once the loader's initial prefetch is used up and
        the last step is not a warm-up's (compile, autotune: over SETTLED x the fastest)."""
        if self.s.evaluation_only():
            return False
        drained = self._drained()
        if n < plan:
            return False
        d = self.s.durations[self.name]
        settled = len(d) < 2 or d[-1] <= SETTLED * min(d) + SETTLED_MS
        if settled and drained is not False:
            return True
        _, _, queued, _ = self.s.feed.queue()
        if n < plan + WARMUP_EXTRA + 3 * queued:
            return False
        if drained is False:
            self.s.why.append(f"the loader's queue ({queued} batches made in advance) did not "
                              f"run down in {n} warm-up steps: the measured steps may have "
                              "taken batches made before they asked")
        return True

    def _drained(self) -> bool | None:
        """Whether the loader's initial prefetch is used up: its queued batches taken, and then
        its queue down to what the workers keep making (at most one batch a worker), or no
        longer shrinking over 10 steps (the loader keeps up: its queue stays full). While the
        steps take batches faster than the workers make them, the queue shrinks by the
        difference only: a queue of 20 took 28 steps to empty. None: it cannot say."""
        it, workers, queued, yielded = self.s.feed.queue()
        if not workers:
            return True
        if yielded < queued:
            return False
        ready = ready_batches(it)
        if ready is None:
            return None
        self._ready.append(ready)
        return ready <= workers or (len(self._ready) > 10 and ready >= self._ready[-11])


class Plain(Phase):
    """The unobserved window: nothing but the boundary's two timestamps per step."""
    name = "plain"

    def __init__(self, session: Driver) -> None:
        super().__init__(session)
        self.own_s = 0.0                     # the doctor's time inside the window
        self._t0 = 0.0
        self.total_ms: float | None = None   # the window's drained wall, less the doctor's time
        self.series: Series | None = None    # its steps, split
        self.done_s: float | None = None     # when it ended (perf_counter)

    def enter(self) -> None:
        self.own_s = 0.0
        self._t0 = drained_clock()

    def complete(self, n: int, plan: int) -> bool:
        return n >= plan and not self._grows(n, plan)

    def _grows(self, n: int, plan: int) -> bool:
        """The window grows (up to 3x its plan, PLAIN_WALL_S) while a stall was seen once only:
        a second sighting gives its period."""
        self.series = self.s.split(self.name)
        if n >= 3 * plan or sum(self.s.durations[self.name]) >= PLAIN_WALL_S * 1e3:
            return False
        return any(len(st.steps) == 1 for st in self.series.stalls)

    def leave(self, finished: bool) -> None:
        self.done_s = perf_counter()
        d = self.s.durations[self.name]
        self.series = self.s.split(self.name)
        if d:
            self.total_ms = max(sum(d), (drained_clock() - self._t0 - self.own_s) * 1e3)

    def step_ms(self) -> float | None:
        """The steady step timed unobserved: the window's wall (drained) less its stalls."""
        plain = self.series
        if plain is None or not plain.steps or self.total_ms is None:
            return None
        stalled = sum(self.s.durations[self.name][i] for i in plain.stalled)
        kept = plain.steps - len(plain.stalled)
        return (self.total_ms - stalled) / kept if kept else self.total_ms / plain.steps


class Monitor(Phase):
    name = "monitor"

    def __init__(self, session: Driver) -> None:
        super().__init__(session)
        self.optimizer_s = 0.0               # host time in optimizer.step()
        self._opt_t0: float | None = None
        self._t0 = 0.0
        # The boundary counts at its ends (the last: None while it runs).
        self.seen: tuple[dict[str, int], dict[str, int] | None] | None = None
        self.step_ms: float | None = None    # drained wall / monitored steps, stalls out
        self.observed: Series | None = None  # its steps, split

    def enter(self) -> None:
        self.optimizer_s = 0.0
        self.s.sampler.start(parts=cuda())   # before the clock: its thread's start is ours
        self.seen = (dict(self.s.bounds.seen), None)
        self._t0 = drained_clock()

    def open_step(self) -> None:
        self.s.monitor.begin()

    def close_step(self) -> None:
        self.s.monitor.end()

    def complete(self, n: int, plan: int) -> bool:
        # Long enough to see the periodic work the unobserved steps showed (what it is).
        plain = self.s.plain.series
        period = max((st.every_steps or 0 for st in plain.stalls), default=0) if plain else 0
        return n >= plan and n >= min(period + 1, 3 * plan)

    def leave(self, finished: bool) -> None:
        if finished:
            self.observed = self.s.split(self.name)
            n = self.s.done[self.name]
            wall = (drained_clock() - self._t0) * 1e3
            stalled = self.observed.stalled
            # The steady step: the stalls' steps out (periodic work, reported apart).
            out = sum(self.s.durations[self.name][i] for i in stalled)
            self.step_ms = (wall - out) / (n - len(stalled)) if n > len(stalled) else wall / n
        self.s.sampler.stop()                # after the clock: joining it is ours
        if self.seen is not None:
            self.seen = (self.seen[0], dict(self.s.bounds.seen))

    def per_step(self, kind: str) -> float | None:
        """How many times `kind` fired per monitored step (None: no monitored step)."""
        steps = self.s.done[self.name]
        if not steps or self.seen is None:
            return None
        first, last = self.seen
        return ((last or self.s.bounds.seen)[kind] - first[kind]) / steps

    def optimizer_begins(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.s.phase == self.name and threading.get_ident() == self.s.sampler.thread_id:
            self._opt_t0 = perf_counter()

    def optimizer_ends(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._opt_t0 is not None:
            self.optimizer_s += perf_counter() - self._opt_t0
            self._opt_t0 = None


class Probe(Phase):
    name = "probe"

    def __init__(self, session: Driver) -> None:
        super().__init__(session)
        self.probe: QueueProbe | None = None
        self.gpu_pure_ms: float | None = None

    def enter(self) -> None:
        self.probe = QueueProbe(self.s.watching.step_ms or 0.0)

    def open_step(self) -> None:
        if self.probe is not None:
            self.probe.begin()

    def close_step(self) -> None:
        if self.probe is not None:
            self.probe.end()

    def leave(self, finished: bool) -> None:
        if self.probe is not None:
            self.gpu_pure_ms = self.probe.median_ms()


class AuditPhase(Phase):
    name = "audit"

    def enter(self) -> None:
        self.s.audit.__enter__()
        # torch iterates the global hooks while it calls this one, and removing a hook it has
        # not reached yet raises "OrderedDict mutated during iteration": keep ours the last
        # one, since the audit's __exit__ (called from ours) removes the audit's hook.
        self.s.bounds.reinstall_optimizer_hook()

    def leave(self, finished: bool) -> None:
        self.s.audit.__exit__(None, None, None)
        self.s.audit.steps = max(1, self.s.done[self.name])


class Trace(Phase):
    """Last, because torch.profiler takes CUPTI over."""
    name = "kernels"

    def __init__(self, session: Driver) -> None:
        super().__init__(session)
        self.kernel_time: KernelTime | None = None
        self.traced = False                  # the trace --trace asked for was written
        self._profile: Any = None
        self._path = ""

    def enter(self) -> None:
        trace = self.s.trace
        if cuda():
            torch.cuda.synchronize()
        self._path = trace or os.path.join(own_tempdir("syncless-doctor-"), "trace.json")
        self._profile = profiler(cuda(), cpu=bool(trace))
        self._profile.__enter__()

    def leave(self, finished: bool) -> None:
        gpu, trace = cuda(), self.s.trace
        if gpu:
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        self._profile.export_chrome_trace(self._path)
        if gpu and self.s.done[self.name]:
            self.kernel_time = trace_gpu(self._path, self.s.done[self.name])
        keep = os.environ.get("SYNCLESS_DOCTOR_KEEP_TRACE")
        if keep and not trace:               # a copy of the trace the report read (diagnostics)
            shutil.copyfile(self._path, keep)
        if trace:
            self.traced = True
        else:
            os.remove(self._path)
            os.rmdir(os.path.dirname(self._path))
