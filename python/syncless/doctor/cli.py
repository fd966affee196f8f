"""python -m syncless doctor [options] script.py [args]: the doctor for a whole script.

A step ends at the strongest boundary the script shows: a `syncless.step()` marker, a line given
with --step-at FILE:LINE, optimizer.step() (the first optimizer's), backward(), a DataLoader's
next(), or the end of the outermost nn.Module call (inference); the report says which. Data wait is
the time spent in DataLoader iterators' next(). The script runs through these phases, one after
another, at its step boundaries:

  warm-up  --warmup steps, not measured (lazy loading, autotuning, allocator growth)
  monitor  --steps steps: data wait, CPU time and GPU time of every step (the GPU is drained at
           both ends, so wall time / steps is the real step time); a stack sampler (every 2 ms)
           finds the lines the host time goes to; optimizer.step() is timed
  probe    (CUDA) --probe-steps steps, each queued behind a GPU sleep kernel so that its kernels
           run back to back: the GPU work a step needs
  audit    --audit-steps steps under CUPTI: every sync with its line, kernels per step
  kernels  (CUDA, or --trace PATH) --trace-steps steps under torch.profiler: the kernels' GPU
           time (the GPU-work figure when the step syncs), the host's time blocked in syncs and
           the GPU idle they cause, and the trace written to PATH for
           https://ui.perfetto.dev; last, because torch.profiler takes CUPTI over

Then the script is stopped and the report printed (--json PATH: also as JSON). A script that ends
sooner gets the report of what was measured, with a note naming the phases that did not run, then
its own traceback (an error) and its exit code.
SYNCLESS_DOCTOR_KEEP_TRACE=PATH keeps a copy of the kernel trace the report read (diagnostics).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import shutil
import statistics
import sys
import tempfile
import threading
import traceback
import weakref
from time import perf_counter

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ._boundary import (ANY_OPTIMIZER, BACKWARD, LOADER, MARKER, MODULE, OPTIMIZER, STEP_AT,
                        Boundaries, parse_step_at)
from ._frames import short
from .findings import in_framework_words
from . import _verify
from ._loader import cpu_count, loader_settings, ready_batches, timed_dataloaders
from ._sampler import StackSampler
from ._series import Series, split
from .audit import Audit
from .diagnose import (Diagnosis, Measured, QueueProbe, assess, launch_cost_us, profiler,
                       trace_gpu)
from .monitor import StepMonitor

PHASES = ("warm-up", "plain", "monitor", "probe", "audit", "kernels")
WARMUP_EXTRA = 20        # warm-up steps past --warmup while steps settle or the prefetch lasts
SETTLED = 3.0            # a warm-up ends on a step at most this many times its fastest step
SETTLED_MS = 5.0         # ... plus 5 ms (a loaded host's hiccup; compiles take 100s of ms)
PLAIN_WALL_S = 60.0      # the unobserved window grows to see a stall again, for at most this long


class _Done(BaseException):
    """Stops the script once enough steps were seen (BaseException: `except Exception` in the
    script must not swallow it)."""


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class ScriptSession:
    """Runs a script, moving through the phases at its step boundaries."""

    def __init__(self, warmup: int = 3, steps: int = 30, probe_steps: int = 3,
                 audit_steps: int = 10, trace: str | None = None, trace_steps: int = 3,
                 step_at: tuple[str, int] | None = None, plain_steps: int | None = None):
        self.plan = {"warm-up": warmup, "plain": steps if plain_steps is None else plain_steps,
                     "monitor": steps, "probe": probe_steps, "audit": audit_steps,
                     "kernels": trace_steps}
        self.trace = trace
        self.traced = False
        self.step_at = step_at
        self.bounds = Boundaries(self.on_boundary, step_at)
        self._loader: dict = {}
        self.finished = False                    # every phase ran: the script is being stopped
        self.ended = "ended"                     # how the script ended, for the report's notes
        self._reset()

    def _reset(self) -> None:
        self.done = dict.fromkeys(PHASES, 0)     # finished steps per phase
        self.entered: list[str] = []
        self.phase: str | None = None
        self.monitor = StepMonitor(gpu_every=1)
        self.monitor.loader = self._loader
        self.audit = Audit()
        self.probe: QueueProbe | None = None
        self.sampler = StackSampler(threading.get_ident())
        self.step_ms: float | None = None        # drained wall / monitored steps
        self.gpu_pure_ms: float | None = None
        self.kernel_time = None
        self.optimizer_s = 0.0
        self._opt_t0 = None
        self._profile = None
        self._trace_path = None
        self._t0 = 0.0
        self._seen_monitor: tuple[dict, dict | None] | None = None   # boundary counts at its ends
        # Per dataset, over the monitored steps: [dataset, next() calls, wait s, settings,
        # data wall s, data CPU s]; in the order first seen.
        self._loaders: dict = {}
        self._last_loader: list | None = None
        # Every step's duration per phase (ms), from the doctor's callback returning to its next
        # call: its own time is not the step's.
        self.durations: dict = {p: [] for p in PHASES}
        self._t_out: float | None = None
        self._own_s = 0.0                        # the doctor's time inside the unobserved window
        self._plain_t0 = 0.0
        self.plain_total_ms: float | None = None
        self.plain: Series | None = None         # the unobserved steps, split
        self.observed: Series | None = None      # the monitored steps, split
        # Per step and phase: (start, end, forward-only model calls, epochs started, data wait ms)
        self.contexts: dict = {p: [] for p in PHASES}
        self._ctx0 = (0, 0)
        self._wait_s = 0.0                       # time in DataLoader next() this step
        self._step_nexts: dict = {}              # id(dataset) -> next() calls this step
        self._step_waits: dict = {}              # id(dataset) -> seconds in them (monitored)
        self._names: dict = {}                   # id(dataset) -> its type's name
        self.epoch_starts = 0                    # DataLoader iterators started (or reset)
        self._iterator = None                    # weakref to the iterator next()'d last
        self.why: list = []                      # why the verdict is provisional
        self.plain_done_s: float | None = None   # when the unobserved window ended
        self._ready: list = []                   # the loader's ready batches, warm-up steps

    # ---- the data-wait side of timed_dataloaders ------------------------------------------------

    def add_data_wait(self, seconds: float) -> None:
        self._wait_s += seconds
        if self.phase != "plain":
            self.monitor.add_data_wait(seconds)

    @property
    def observing(self) -> bool:
        """False in the unobserved window: the DataLoader's next() is not timed there."""
        return self.phase != "plain"

    def loader_next(self, iterator) -> None:
        """Before each next() of a DataLoader iterator: a new epoch when it has yielded nothing
        yet (a new iterator, or a persistent one reset); the last one is the one whose initial
        prefetch the warm-up uses up."""
        if getattr(iterator, "_num_yielded", 1) == 0:
            self.epoch_starts += 1
        dataset = getattr(iterator, "_dataset", iterator)
        self._step_nexts[id(dataset)] = self._step_nexts.get(id(dataset), 0) + 1
        if id(dataset) not in self._names:
            self._names[id(dataset)] = type(dataset).__name__
        if self._iterator is None or self._iterator() is not iterator:
            self._iterator = weakref.ref(iterator)

    def loader_wait(self, iterator, seconds: float) -> None:
        """One next() of a DataLoader iterator: which loader (its dataset) and how long."""
        if self.phase != "monitor":
            self._last_loader = None
            return
        dataset = getattr(iterator, "_dataset", iterator)
        rec = self._loaders.get(id(dataset))
        if rec is None:
            rec = self._loaders[id(dataset)] = [dataset, 0, 0.0, loader_settings(iterator),
                                                0.0, 0.0]
        rec[1] += 1
        rec[2] += seconds
        self._last_loader = rec
        self._step_waits[id(dataset)] = self._step_waits.get(id(dataset), 0.0) + seconds

    def add_data_cpu(self, wall: float, cpu: float) -> None:
        # The monitored steps' only: in the warm-up, spawned workers still import torch (CPU
        # they spend once, not per batch).
        if self.phase == "monitor":
            self.monitor.add_data_cpu(wall, cpu)
            if self._last_loader is not None:
                self._last_loader[4] += wall
                self._last_loader[5] += cpu

    @property
    def loader(self) -> dict:
        return self._loader

    @loader.setter
    def loader(self, settings: dict) -> None:
        self._loader = settings
        self.monitor.loader = settings

    # ---- running --------------------------------------------------------------------------------

    def run(self, path: str, args: list[str]) -> None:
        """Run the script as __main__ until the last phase is done or the script ends."""
        saved_argv, saved_path = sys.argv, sys.path[:]
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        pre = register_optimizer_step_pre_hook(self._optimizer_begins)
        post = register_optimizer_step_post_hook(self._optimizer_ends)
        self.bounds.install()
        try:
            self._enter(self._after(None))
            self._open_step()
            self._t_out = perf_counter()
            with timed_dataloaders(self, on_next=self.bounds.loader_next):
                runpy.run_path(path, run_name="__main__")
        except _Done:
            pass
        finally:
            self.bounds.remove()
            pre.remove()
            post.remove()
            sys.argv, sys.path[:] = saved_argv, saved_path
            if self.phase is not None:
                self._leave(finished=False)

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        if self.phase == "monitor" and threading.get_ident() == self.sampler.thread_id:
            self._opt_t0 = perf_counter()

    def _optimizer_ends(self, optimizer, args, kwargs) -> None:
        if self._opt_t0 is not None:
            self.optimizer_s += perf_counter() - self._opt_t0
            self._opt_t0 = None

    def on_boundary(self, kind: str, restart: bool) -> None:
        t_in = perf_counter()
        if self.finished:
            # The script caught _Done (a bare `except:`, `except BaseException`) and went on:
            # stop it again, or it would run to its end unmeasured.
            raise _Done
        if restart:
            # A stronger boundary appeared (the first optimizer.step() after the first
            # backward()): what ran so far measured other steps; start over at this one.
            if self.phase is not None:
                self._leave(finished=False)
            self._reset()
            self._enter(self._after(None))
            self._open_step()
            self._t_out = perf_counter()
            return
        if self.phase is None:
            return
        self._close_step()
        phase = self.phase
        if self._t_out is not None:
            self.durations[phase].append((t_in - self._t_out) * 1e3)
            self.contexts[phase].append((self._t_out, t_in,
                                         self.bounds.forward_only - self._ctx0[0],
                                         self.epoch_starts - self._ctx0[1], self._wait_s * 1e3,
                                         self._step_nexts, self._step_waits))
        self.done[phase] += 1
        if not self._complete(phase):
            self._open_step()
            self._mark(phase, t_in)
            return
        self._leave(finished=True)
        following = self._after(self.entered[-1])
        if following is None:
            self.finished = True
            raise _Done
        self._enter(following)
        self._open_step()
        self._mark(following, t_in)

    def _mark(self, phase: str, t_in: float) -> None:
        self._ctx0 = (self.bounds.forward_only, self.epoch_starts)
        self._wait_s = 0.0
        self._step_nexts, self._step_waits = {}, {}
        self._t_out = perf_counter()
        if phase == "plain":
            self._own_s += self._t_out - t_in

    # ---- when a phase is done: an honest window ------------------------------------------------

    def _complete(self, phase: str) -> bool:
        n, plan = self.done[phase], self.plan[phase]
        if phase == "warm-up":
            return self._warm(n, plan)
        if n < plan:
            return False
        if phase == "plain":
            return not self._plain_grows(n, plan)
        if phase == "monitor":
            # Long enough to see the periodic work the unobserved steps showed (what it is).
            period = max((s.every_steps or 0 for s in self.plain.stalls), default=0) \
                if self.plain else 0
            return n >= min(period + 1, 3 * plan)
        return True

    def evaluation_only(self) -> bool:
        """Steps that end at a model call or next(), while an optimizer exists that never
        stepped: an evaluation before training (nanoGPT's estimate_loss() at iteration 0), not
        the training step, which ends at backward() or optimizer.step() once it comes."""
        return self.bounds.kind in (MODULE, LOADER) and self.bounds.optimizer_made

    def _queue(self) -> tuple:
        """The last DataLoader iterator next()'d: (its workers, the batches its initial prefetch
        queues: num_workers x prefetch_factor, batches it has yielded)."""
        it = self._iterator() if self._iterator is not None else None
        workers = (getattr(it, "_num_workers", 0) or 0) if it is not None else 0
        if not workers:
            return it, 0, 0, 0
        return (it, workers, workers * (getattr(it, "_prefetch_factor", None) or 2),
                getattr(it, "_num_yielded", 0))

    def _drained(self) -> bool | None:
        """Whether the loader's initial prefetch is used up: its queued batches taken, and then
        its queue down to what the workers keep making (at most one batch a worker), or no
        longer shrinking over 10 steps (the loader keeps up: its queue stays full). While the
        steps take batches faster than the workers make them, the queue shrinks by the
        difference only: a queue of 20 took 28 steps to empty. None: it cannot say."""
        it, workers, queued, yielded = self._queue()
        if not workers:
            return True
        if yielded < queued:
            return False
        ready = ready_batches(it)
        if ready is None:
            return None
        self._ready.append(ready)
        return ready <= workers or (len(self._ready) > 10 and ready >= self._ready[-11])

    def _warm(self, n: int, plan: int) -> bool:
        """The warm-up ends after `plan` steps once the loader's initial prefetch is used up and
        the last step is not a warm-up's (compile, autotune: over SETTLED x the fastest)."""
        if self.evaluation_only():
            return False
        drained = self._drained()
        if n < plan:
            return False
        d = self.durations["warm-up"]
        settled = len(d) < 2 or d[-1] <= SETTLED * min(d) + SETTLED_MS
        if settled and drained is not False:
            return True
        _, workers, queued, _ = self._queue()
        if n < plan + WARMUP_EXTRA + 3 * queued:
            return False
        if drained is False:
            self.why.append(f"the loader's queue ({queued} batches made in advance) did not run "
                            f"down in {n} warm-up steps: the measured steps may have taken "
                            "batches made before they asked")
        return True

    def _split(self, phase: str) -> Series:
        """The phase's steps split into the steady step and its stalls. A step that waited for
        its batch, past the median wait by at least half its extra time, and started no epoch,
        is no stall: a loader too slow for the step makes steps wait in turn (two workers in
        step with each other: a long wait every other step), and that is the steady step."""
        d, ctx = self.durations[phase], self.contexts[phase]
        if not d or len(ctx) != len(d):
            return split(d)
        median_d = statistics.median(d)
        median_wait = statistics.median(c[4] for c in ctx)
        steady = {i for i, c in enumerate(ctx) if c[3] == 0 and
                  c[4] - median_wait >= 0.5 * (d[i] - median_d)}
        return split(d, steady)

    def _plain_grows(self, n: int, plan: int) -> bool:
        """The unobserved window grows (up to 3x its plan, PLAIN_WALL_S) while a stall was seen
        once only: a second sighting gives its period."""
        self.plain = self._split("plain")
        if n >= 3 * plan or sum(self.durations["plain"]) >= PLAIN_WALL_S * 1e3:
            return False
        return any(len(st.steps) == 1 for st in self.plain.stalls)

    def _after(self, phase: str | None) -> str | None:
        rest = PHASES[PHASES.index(phase) + 1:] if phase else PHASES
        return next((p for p in rest if self._planned(p) > 0), None)

    def _planned(self, phase: str) -> int:
        if phase == "probe" and not _cuda():
            return 0
        if phase == "kernels" and not (_cuda() or self.trace):
            return 0
        return self.plan[phase]

    def _open_step(self) -> None:
        if self.phase in ("warm-up", "monitor"):
            self.monitor.begin()
        elif self.phase == "probe":
            self.probe.begin()

    def _close_step(self) -> None:
        if self.phase in ("warm-up", "monitor"):
            self.monitor.end()
        elif self.phase == "probe":
            self.probe.end()

    def _drained_clock(self) -> float:
        if _cuda():
            torch.cuda.synchronize()
        return perf_counter()

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.entered.append(phase)
        if phase == "plain":
            self._own_s = 0.0
            self._plain_t0 = self._drained_clock()
        elif phase == "monitor":
            self.optimizer_s = 0.0
            self.sampler.start()                 # before the clock: its thread's start is ours
            self._seen_monitor = (dict(self.bounds.seen), None)
            self._t0 = self._drained_clock()
        elif phase == "probe":
            self.probe = QueueProbe(self.step_ms)
        elif phase == "audit":
            self.audit.__enter__()
            # torch iterates the global hooks while it calls this one, and removing a hook it has
            # not reached yet raises "OrderedDict mutated during iteration": keep ours the last
            # one, since the audit's __exit__ (called from ours) removes the audit's hook.
            self.bounds.reinstall_optimizer_hook()
        elif phase == "kernels":
            if _cuda():
                torch.cuda.synchronize()
            self._trace_path = self.trace or os.path.join(
                tempfile.mkdtemp(prefix="syncless-doctor-"), "trace.json")
            self._profile = profiler(_cuda(), cpu=bool(self.trace))
            self._profile.__enter__()

    def _leave(self, finished: bool) -> None:
        phase, self.phase = self.phase, None
        if phase == "plain":
            self.plain_done_s = perf_counter()
            d = self.durations["plain"]
            self.plain = self._split("plain")
            if d:
                self.plain_total_ms = max(sum(d), (self._drained_clock() - self._plain_t0 -
                                                   self._own_s) * 1e3)
        elif phase == "monitor":
            if finished:
                self.observed = self._split("monitor")
                n = self.done["monitor"]
                wall = (self._drained_clock() - self._t0) * 1e3
                stalled = self.observed.stalled
                # The steady step: the stalls' steps out (periodic work, reported apart).
                out = sum(self.durations["monitor"][i] for i in stalled)
                self.step_ms = (wall - out) / (n - len(stalled)) if n > len(stalled) else \
                    wall / n
            self.sampler.stop()                  # after the clock: joining it is ours
            self._seen_monitor = (self._seen_monitor[0], dict(self.bounds.seen))
        elif phase == "probe":
            self.gpu_pure_ms = self.probe.median_ms()
        elif phase == "audit":
            self.audit.__exit__(None, None, None)
            self.audit.steps = max(1, self.done["audit"])
        elif phase == "kernels":
            gpu = _cuda()
            if gpu:
                torch.cuda.synchronize()
            self._profile.__exit__(None, None, None)
            self._profile.export_chrome_trace(self._trace_path)
            if gpu and self.done["kernels"]:
                self.kernel_time = trace_gpu(self._trace_path, self.done["kernels"])
            keep = os.environ.get("SYNCLESS_DOCTOR_KEEP_TRACE")
            if keep and not self.trace:      # a copy of the trace the report read (diagnostics)
                shutil.copyfile(self._trace_path, keep)
            if self.trace:
                self.traced = True
            else:
                os.remove(self._trace_path)
                os.rmdir(os.path.dirname(self._trace_path))

    # ---- the report -----------------------------------------------------------------------------

    def per_step(self, kind: str) -> float | None:
        """How many times `kind` fired per monitored step (None: no monitored step)."""
        steps = self.done["monitor"]
        if not steps or self._seen_monitor is None:
            return None
        first, last = self._seen_monitor
        return ((last or self.bounds.seen)[kind] - first[kind]) / steps

    def boundary_text(self) -> str:
        kind = self.bounds.kind
        if kind == OPTIMIZER and self.bounds.optimizer is not None:
            text = f"{kind} ({type(self.bounds.optimizer).__name__})"
            others = len(self.bounds.optimizers) - 1
            if others:
                names = ", ".join(type(o).__name__ for o in self.bounds.optimizers[1:])
                text = (f"{kind} of the first optimizer stepped ("
                        f"{type(self.bounds.optimizer).__name__}; {others} other"
                        f"{'s' if others > 1 else ''} stepped too: {names})")
            backward = self.per_step(BACKWARD)
            if backward is not None and backward != 1:
                # Gradient accumulation (or a step with several losses): say what a step is.
                text += f", {backward:g} backward() calls per step"
            return text
        if kind in (MARKER, STEP_AT):
            text = (f"pass over {short(self.step_at[0])}:{self.step_at[1]} (--step-at)"
                    if kind == STEP_AT else kind)
            # What the user's boundary holds: a line that runs more often than once a step
            # (a loop header) or a marker in the wrong loop shows here.
            counts = [(self.per_step(k), name) for k, name in
                      ((ANY_OPTIMIZER, "optimizer.step()"), (BACKWARD, "backward()"))]
            counts = [f"{n:.3g} × {name}" for n, name in counts if n]
            return text + (f" (per step: {', '.join(counts)})" if counts else "")
        if kind == MODULE and self.bounds.model is not None:
            return f"end of {kind} ({type(self.bounds.model).__name__})"
        return kind or ""

    def diagnosis(self) -> Diagnosis:
        """The Diagnosis of what was measured (call after run())."""
        self.monitor.drain()
        warmup = self.done["warm-up"]
        observed = self.observed or self._split("monitor")
        m = self.monitor.summary(skip=warmup,
                                 exclude=frozenset(warmup + i for i in observed.stalled))
        gpu = _cuda()
        kind = self.bounds.kind
        seen = self.bounds.seen.get(kind, 0) if kind else 0
        notes = []
        if kind is None and self.ended != "ended":
            notes.append(f"the script {self.ended} before its first step boundary (an "
                         "optimizer.step(), backward(), DataLoader next() or nn.Module call): "
                         "nothing was measured")
        elif kind is None:
            notes.append("no step boundary was seen (no optimizer.step(), backward(), DataLoader "
                         "next() or nn.Module call): mark the end of each step with "
                         "syncless.step(), or name its line with --step-at FILE:LINE")
        else:
            missed = self._missed()
            if missed:
                total = sum(self._planned(p) for p in PHASES)
                notes.append(f"the script {self.ended} after {seen} step"
                             f"{'' if seen == 1 else 's'}: {missed}; all phases take {total} "
                             "steps (lower --steps or --audit-steps, or let the script run "
                             "longer)")
            elif self.ended != "ended" and not self.finished:
                notes.append(f"the script {self.ended} after {seen} step"
                             f"{'' if seen == 1 else 's'}")
        if kind is not None and self.evaluation_only():
            notes.append(f"only forward-only steps ran ({self.bounds.forward_only} model calls "
                         "with autograd off), while an optimizer was made that never stepped: an "
                         "evaluation before training, not measured as the training step")
        if self.step_at and kind != STEP_AT:
            notes.insert(0, f"--step-at {short(self.step_at[0])}:{self.step_at[1]} never ran"
                            + (f": the steps end at each {kind} instead" if kind else ""))
        if self.probe is not None and self.probe.uncovered:
            notes.append(f"{self.probe.uncovered} of the probed steps took the host longer than "
                         "the GPU sleep that held their kernels back (a slow batch?): not timed"
                         + ("" if self.probe.steps else "; the GPU work is the trace's"))
        if "audit" not in self.entered:
            self.audit.reason = "the script ended before the audit"
        m = self._feeding_loader_only(m, notes, observed.stalled)
        step_ms = self.step_ms if self.step_ms is not None else m.step_ms
        monitored = max(1, self.done["monitor"])
        d = assess(Measured(
            m, self.audit, self.done["warm-up"], step_ms, gpu, m.gpu_ms, self.gpu_pure_ms,
            self.probe.steps if self.probe else 0, notes, kernel_time=self.kernel_time,
            launch_us=launch_cost_us() if gpu else None, sampler=self.sampler,
            boundary=self.boundary_text(),
            optimizer_ms=self.optimizer_s * 1e3 / monitored if self.optimizer_s else None,
            model=self.bounds.model, autocast=self.bounds.autocast))
        if self.traced:
            d.trace = self.trace
        if d.summary.steps:                      # every monitored step, stalls or not
            d.summary = dataclasses.replace(d.summary, steps=self.done["monitor"])
        self._honest(d, observed)
        in_framework_words(d.findings + d.minor, self.bounds.framework, gpu)
        return d

    # ---- the unobserved step, the periodic work, how honest the window was ----------------------

    def _honest(self, d: Diagnosis, observed: Series) -> None:
        d.warmup = self.done["warm-up"]
        d.plain_steps = self.done["plain"]
        plain = self.plain
        d.plain_step_ms = self.plain_step_ms()
        if d.plain_step_ms and d.step_ms:
            d.overhead = d.step_ms / d.plain_step_ms
        d.periodic = self._periodic(plain, observed)
        why = list(self.why)
        if self.evaluation_only():
            why.append("only an evaluation (forward-only steps) ran; the training step never came")
        elif plain is None or not plain.steps:
            why.append("the script ended before its steps were timed unobserved")
        elif not self.finished and self._missed():
            why.append(f"the script {self.ended} before every phase ran ({self._missed()})")
        for st in d.periodic:
            if st.every_steps is None and len(st.steps) == 1 and st.share >= 0.05:
                why.append(f"a stall of {st.ms_each:.0f} ms came once in "
                           f"{(plain if plain is not None else observed).steps} steps "
                           "(work with a longer period, or a one-off?)")
        d.provisional = bool(why)
        d.provisional_why = "; ".join(why)

    def plain_step_ms(self) -> float | None:
        """The steady step timed unobserved: the window's wall (drained) less its stalls."""
        plain = self.plain
        if plain is None or not plain.steps or self.plain_total_ms is None:
            return None
        stalled = sum(self.durations["plain"][i] for i in plain.stalled)
        kept = plain.steps - len(plain.stalled)
        return (self.plain_total_ms - stalled) / kept if kept else \
            self.plain_total_ms / plain.steps

    def _periodic(self, plain: Series | None, observed: Series) -> list:
        """The unobserved steps' stalls (their true size), each named by what the monitored
        steps' stalls of about its size did; the monitored ones alone when no step ran
        unobserved."""
        stalls = list(plain.stalls) if plain is not None and plain.steps else \
            list(observed.stalls)
        for st in stalls:
            match = [o for o in observed.stalls if o.ms_each and st.ms_each and
                     1 / 3 <= o.ms_each / st.ms_each <= 3]
            st.what = self._what(match[0].steps, observed) if match else \
                "not seen again while observed: unknown"
        return stalls

    def _what(self, steps: list, observed: Series) -> str:
        """What the monitored steps at `steps` did beyond a steady step: waited for a new epoch's
        first batches, ran forward-only model calls (an evaluation), or host work at a line."""
        warm = self.done["warm-up"]
        data = list(self.monitor.data_s)
        first = self.monitor.steps - len(data)

        def wait(i: int) -> float:
            j = warm + i - first
            return data[j] * 1e3 if 0 <= j < len(data) else 0.0

        contexts = self.contexts["monitor"]
        ctx = [contexts[i] for i in steps if i < len(contexts)]
        if not ctx:
            return "unknown"
        rest = [wait(i) for i in range(len(contexts)) if i not in observed.stalled]
        feeding = self._feeding()
        other: dict = {}
        for c in ctx:
            for k, n in c[5].items():
                if k != feeding:
                    other[k] = other.get(k, 0) + n
        forward = sum(c[2] for c in ctx) / len(ctx)
        if other:
            names = ", ".join(f"{n / len(ctx):g} next() of {self._names.get(k, '?')}"
                              for k, n in other.items())
            return (f"an evaluation (another DataLoader: {names}"
                    + (f"; {forward:g} forward-only model calls" if forward else "") + ")")
        extra = sum(self.durations["monitor"][i] for i in steps) / len(steps) - \
            observed.steady_ms
        waited = sum(wait(i) for i in steps) / len(steps) - \
            (sum(rest) / len(rest) if rest else 0.0)
        # A new epoch: the loader's workers start in iter(), before the first next() (the
        # script's `for` line, not data wait); its first batches are waited for in next().
        if sum(c[3] for c in ctx) >= 0.5 * len(ctx):
            loader = self._loader or {}
            workers = loader.get("num_workers") or 0
            if workers and not loader.get("persistent_workers"):
                return (f"a new epoch: the DataLoader starts its {workers} workers again "
                        "(persistent_workers=True keeps them)")
            return "a new epoch: the DataLoader's first batch"
        if extra > 0 and waited >= 0.5 * extra:
            return "the DataLoader makes the step wait (slow batches now and then)"
        if forward >= 1:
            return (f"an evaluation: {forward:g} forward-only model calls (autograd off) "
                    "inside the step")
        line, n = self.sampler.line_between([(c[0], c[1]) for c in ctx])
        if line is not None and n:
            return f"host work, mostly at {line.where} `{line.code}`"
        return "host work in the step"

    def _feeding(self) -> int | None:
        """id() of the dataset whose loader feeds the steps: the most next() calls."""
        calls: dict = {}
        for c in self.contexts["monitor"] + self.contexts["plain"]:
            for k, n in c[5].items():
                calls[k] = calls.get(k, 0) + n
        return max(calls, key=calls.get) if calls else None

    def _feeding_loader_only(self, m, notes: list, stalled: set = frozenset()):
        """The data wait of the loader that feeds the steps (the most next() calls), not of
        others (an evaluation loader every N steps): more workers for the training loader
        would not shorten those; their waits count to the step body, with a note."""
        if len(self._loaders) < 2 or not m.steps:
            return m
        recs = sorted(self._loaders.values(), key=lambda r: -r[1])   # stable: first seen wins
        feeding, others = recs[0], recs[1:]
        # Their waits in the steady steps only: those in stalls are periodic work, apart.
        ids = {id(r[0]) for r in others}
        moved = sum(w for i, c in enumerate(self.contexts["monitor"]) if i not in stalled
                    for k, w in c[6].items() if k in ids) * 1e3 / m.steps
        if moved == 0:
            return m
        name = (lambda r: type(r[0]).__name__)
        notes.append(
            f"{len(others)} other DataLoader{'s' if len(others) > 1 else ''} ("
            + ", ".join(f"{name(r)}: {r[1] / m.steps:.3g} next()/step" for r in others)
            + f") blocked {moved:.3f} ms/step (an evaluation loop?): counted to the step body; "
            f"the data wait is that of the loader feeding the steps ({name(feeding)}, "
            f"{feeding[1] / m.steps:.3g} next()/step)")
        data_cpu = feeding[5] / feeding[4] if feeding[4] > 0 else None
        loader = m.loader if feeding is next(iter(self._loaders.values())) else feeding[3]
        return dataclasses.replace(m, data_ms=max(0.0, m.data_ms - moved),
                                   cpu_ms=m.cpu_ms + moved, data_cpu=data_cpu, loader=loader)

    def _missed(self) -> str:
        parts = []
        for phase in PHASES:
            want, got = self._planned(phase), self.done[phase]
            if phase == "kernels" and not self.trace:
                continue                       # an internal phase: only --trace asks for it
            if got < want:
                name = "trace" if phase == "kernels" else phase
                parts.append(f"the {name} ran {got} of {want} steps" if phase in self.entered
                             else f"the {name} did not run")
        return ", ".join(parts)


def _count(least: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        return n
    return parse


def _step_at(text: str) -> tuple[str, int]:
    try:
        return parse_step_at(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


QUICK = {"warmup": 2, "steps": 15, "probe_steps": 3, "audit_steps": 5, "trace_steps": 4}
VERIFY_BUDGET_S = 120.0   # --verify is on by default when its runs should take less than this
DEFAULT = {"warmup": 3, "steps": 30, "probe_steps": 3, "audit_steps": 10, "trace_steps": 3}


def parse_args(argv: list[str] | None,
               prog: str = "python -m syncless doctor") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return checked(p, p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The doctor's options (`syncless doctor` is a subcommand built from them)."""
    p.add_argument("--warmup", type=_count(0), default=None, metavar="N",
                   help="unmeasured first steps (default 3; more while the loader still serves "
                        "its initial prefetch or a step is still a warm-up's)")
    p.add_argument("--steps", type=_count(1), default=None, metavar="N",
                   help="monitored steps (default 30)")
    p.add_argument("--plain-steps", type=_count(0), default=None, metavar="N",
                   help="steps timed unobserved, before the monitor (default: --steps; more "
                        "while a stall was seen once, to find its period)")
    p.add_argument("--probe-steps", type=_count(1), default=None, metavar="N",
                   help="steps queued behind a GPU sleep, CUDA only (default 3)")
    p.add_argument("--audit-steps", type=_count(1), default=None, metavar="N",
                   help="audited steps (default 10)")
    p.add_argument("--trace", metavar="PATH",
                   help="write a torch.profiler trace (Chrome/Perfetto JSON) of the last steps")
    p.add_argument("--trace-steps", type=_count(1), default=None, metavar="N",
                   help="steps under torch.profiler at the end (CUDA or --trace; default 3)")
    p.add_argument("--step-at", type=_step_at, metavar="FILE:LINE",
                   help="a step ends each time this line runs (loops without optimizer.step())")
    p.add_argument("--quick", action="store_true",
                   help="fewer steps: --warmup 2 --steps 15 --audit-steps 5 --trace-steps 4 "
                        "(the window stays as honest: past the prefetch and the warm-up)")
    p.add_argument("--json", metavar="PATH", help="also write the diagnosis as JSON to PATH")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each fix that is a setting (loader workers by a sweep, "
                        "torch.compile, TF32) in fresh paired runs of the script, and keep it "
                        "only if its 95%% interval wins (default: on when those runs are "
                        f"estimated to take under {VERIFY_BUDGET_S:.0f} s)")
    p.add_argument("--verify-pairs", type=_count(2), default=3, metavar="N",
                   help="paired runs (with and without the fix) per fix (default 3)")
    p.add_argument("--measure", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--apply", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("script", help="the training script, run as __main__")
    # Optional (argparse calls every REMAINDER positional required, and says so when the script
    # is missing: "required: script, args").
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="the script's own arguments").required = False


def checked(p: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.Namespace:
    """The defaults --quick changes, and the paths checked before the script starts."""
    defaults = QUICK if ns.quick else DEFAULT
    for key, value in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    if not os.path.isfile(ns.script):
        p.error(f"script not found: {ns.script}")
    for option, path in (("--trace", ns.trace), ("--json", ns.json)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                p.error(f"{option}: folder {folder} does not exist")
    return ns


def _measure(ns: argparse.Namespace) -> int:
    """--measure PATH: time the script's steps unobserved (after an honest warm-up), with the
    --apply settings applied from outside the code; write {"plain_step_ms": ...} to PATH."""
    undo = _verify.apply(json.loads(ns.apply)) if ns.apply else (lambda: None)
    session = ScriptSession(ns.warmup, 0, 0, 0, None, 0, ns.step_at, ns.plain_steps)
    try:
        session.run(ns.script, ns.args)
    except BaseException as e:                   # its exit or error: what was timed counts
        session.ended = type(e).__name__
    finally:
        undo()
    with open(ns.measure, "w") as f:
        json.dump({"plain_step_ms": session.plain_step_ms(), "steps": session.done["plain"],
                   "warmup_steps": session.done["warm-up"], "why": session.why}, f)
    return 0


def _verify_fixes(ns: argparse.Namespace, session: "ScriptSession", d: Diagnosis,
                  cwd: str, elapsed_s: float) -> None:
    """--verify (or its default): the setting fixes measured in fresh paired runs."""
    fixes = _verify.setting_fixes(d)
    if not fixes or ns.verify is False:
        return
    cpus = cpu_count()
    loader = d.summary.loader or {}
    runs = sum(2 * ns.verify_pairs + (len(_verify.worker_candidates(
        loader.get("num_workers") or 0, f.extra.get("workers_needed"), cpus))
        if label == "loader" else 0) for f, label, _ in fixes)
    # A measured run takes about what the doctor took to reach the end of its unobserved window
    # (the interpreter's start, the script's setup, warm-up and the window).
    estimate = runs * elapsed_s
    if ns.verify is None and estimate > VERIFY_BUDGET_S:
        d.verify_lines = [f"off: its {runs} runs would take about {estimate:.0f} s (on by "
                          f"default under {VERIFY_BUDGET_S:.0f} s); pass --verify to check "
                          "the fixes"]
        return
    v = _verify.Verifier(os.path.abspath(ns.script), ns.args, session.done["warm-up"],
                         max(session.plan["plain"], 5), ns.verify_pairs,
                         timeout_s=max(120.0, 10 * elapsed_s), cwd=cwd)
    d.verify_lines = _verify.verify(d, v, loader, cpus)
    d.verify_runs = (v.runs, v.seconds)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(ns: argparse.Namespace) -> int:
    """Run the script of parsed arguments through the phases and print the report."""
    if ns.measure:
        return _measure(ns)
    started, cwd = perf_counter(), os.getcwd()
    session = ScriptSession(ns.warmup, ns.steps, ns.probe_steps, ns.audit_steps, ns.trace,
                            ns.trace_steps, ns.step_at, ns.plain_steps)
    exit_, error = None, None
    script = os.path.abspath(ns.script)          # now: the script may chdir
    try:
        session.run(ns.script, ns.args)
    except SystemExit as e:                      # sys.exit(), exit(), argparse's errors
        exit_ = e
        code = e.code if e.code is not None else 0
        session.ended = f"exited with code {code!r}" if code != 0 else "exited"
    except BaseException as e:                   # its error (KeyboardInterrupt too)
        error = e
        session.ended = f"stopped with {type(e).__name__}"
    # Also when the script fails or exits: the report of what was measured, then its error and
    # its exit code. A failure of the report itself must not hide either.
    try:
        d = session.diagnosis()
        text = d.report()
    except Exception:
        print("\nsyncless doctor: the report failed (a bug in syncless: please report it):",
              file=sys.stderr)
        traceback.print_exc()
    else:
        if error is None and session.plain_done_s is not None:
            try:
                _verify_fixes(ns, session, d, cwd, session.plain_done_s - started + 2.0)
                text = d.report()
            except Exception:
                print("\nsyncless doctor: --verify failed (a bug in syncless: please report it):",
                      file=sys.stderr)
                traceback.print_exc()
        _print_report(text)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(d.as_dict(), f, indent=1, default=str)
    if error is not None:
        sys.stdout.flush()
        _print_script_error(error, (ns.script, script))
        if isinstance(error, KeyboardInterrupt):
            _exit_by_sigint()
        return 1                                 # what python script.py exits with
    if exit_ is not None:
        raise exit_
    return 0


def _print_report(text: str) -> None:
    """To the doctor's own stdout, after the script's output: a script that set sys.stdout to a
    log file of its own (a tee) and left it so would otherwise swallow the report."""
    out = sys.__stdout__ or sys.stdout
    for stream in {id(sys.stdout): sys.stdout, id(out): out}.values():
        try:
            stream.flush()                       # the script's output first
        except (OSError, ValueError):            # closed by the script, or a gone reader
            pass
    try:
        # A newline first: the script's last output may not end its line (a progress bar).
        print("\n" + text, file=out, flush=True)
    except BrokenPipeError:                      # `... | head`: the reader has gone
        sys.stdout = open(os.devnull, "w")       # (and no second error at interpreter exit)
    except (OSError, ValueError):                # no stdout at all: the report is lost, not the
        pass                                     # script's exit code


def _exit_by_sigint() -> None:
    """Exit as python does after a Ctrl-C the script did not catch: killed by SIGINT (the shell
    sees 130), so a calling script knows it was interrupted."""
    import signal
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if hasattr(signal, "SIGINT") and hasattr(os, "kill"):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(130)                        # no signals (or the kill came back): the code


def _print_script_error(error: BaseException, script: tuple) -> None:
    """The script's traceback as `python script.py` prints it: from the script's own frame, not
    through the doctor's and runpy's (all of it when the script's frame is not on it). `script`:
    its path as given (runpy's code filename) and as an absolute path."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename not in script and \
            os.path.abspath(tb.tb_frame.f_code.co_filename) != script[1]:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)
