"""ScriptSession: runs code (a script, or a loop the doctor writes around a step function) and
moves through the phases (_phases.py) at its step boundaries."""
from __future__ import annotations

import os
import runpy
import sys
import threading
from time import perf_counter
from typing import Callable

from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ._boundary import LOADER, MODULE, Boundaries
from ._feed import Feed, StepContext, split_steps
from ._load import LoadMeter
from ._loader import timed_dataloaders
from ._phases import (AuditPhase, Monitor, Phase, Plain, Probe, Trace, WarmUp, cuda)
from ._sampler import StackSampler
from ._series import Series
from .audit import Audit
from .monitor import StepMonitor

__all__ = ["ScriptSession", "PHASES", "Done"]

PHASES = ("warm-up", "plain", "monitor", "probe", "audit", "kernels")


class Done(BaseException):
    """Stops the script once enough steps were seen (BaseException: `except Exception` in the
    script must not swallow it)."""


class ScriptSession:
    """Runs a script (or syncless.doctor()'s loop), moving through the phases at its steps."""

    def __init__(self, warmup: int = 3, steps: int = 30, probe_steps: int = 3,
                 audit_steps: int = 10, trace: str | None = None, trace_steps: int = 3,
                 step_at: tuple[str, int] | None = None, plain_steps: int | None = None):
        self.plan = {"warm-up": warmup, "plain": steps if plain_steps is None else plain_steps,
                     "monitor": steps, "probe": probe_steps, "audit": audit_steps,
                     "kernels": trace_steps}
        self.trace = trace
        self.step_at = step_at
        self.bounds = Boundaries(self.on_boundary, step_at)
        self.finished = False                    # every phase ran: the script is being stopped
        self.ended = "ended"                     # how the script ended, for the report's notes
        self.feed = Feed(self)
        self.load: LoadMeter | None = None       # started with the run
        self._reset()

    def _reset(self) -> None:
        self.done = dict.fromkeys(PHASES, 0)     # finished steps per phase
        self.entered: list[str] = []
        self.phase: str | None = None
        self.monitor = StepMonitor(gpu_every=1)
        self.monitor.loader = self.feed.loader
        self.feed.reset()
        self.audit = Audit()
        self.sampler = StackSampler(threading.get_ident())
        self.warming, self.plain, self.watching = WarmUp(self), Plain(self), Monitor(self)
        self.probing, self.auditing, self.tracing = Probe(self), AuditPhase(self), Trace(self)
        self.phases: dict[str, Phase] = {p.name: p for p in (
            self.warming, self.plain, self.watching, self.probing, self.auditing, self.tracing)}
        # Every step's duration per phase (ms), from the doctor's callback returning to its next
        # call: its own time is not the step's; and what each step did beside it.
        self.durations: dict[str, list[float]] = {p: [] for p in PHASES}
        self.contexts: dict[str, list[StepContext]] = {p: [] for p in PHASES}
        self._t_out: float | None = None
        self._ctx0 = (0, 0)                      # (forward-only calls, epochs) at a step's start
        self.why: list[str] = []                 # why the verdict is provisional

    # ---- running --------------------------------------------------------------------------------

    def run(self, path: str, args: list[str]) -> None:
        """Run the script as __main__ until the last phase is done or the script ends."""
        saved_argv, saved_path = sys.argv, sys.path[:]
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        try:
            self.drive(lambda: runpy.run_path(path, run_name="__main__"))
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path

    def drive(self, body: Callable[[], object]) -> None:
        """Run `body` with the boundaries and the DataLoader timing installed, until the last
        phase is done (it raises Done, caught here) or `body` returns or raises."""
        pre = register_optimizer_step_pre_hook(lambda *a: self.watching.optimizer_begins(*a))
        post = register_optimizer_step_post_hook(lambda *a: self.watching.optimizer_ends(*a))
        self.bounds.install()
        self.load = LoadMeter()                  # other processes' load, until the report
        try:
            self._enter(self._after(None))
            self._t_out = perf_counter()
            with timed_dataloaders(self.feed, on_next=self.bounds.loader_next):
                body()
        except Done:
            pass
        finally:
            self.bounds.remove()
            pre.remove()
            post.remove()
            if self.phase is not None:
                self._leave(finished=False)

    def on_boundary(self, kind: str, restart: bool) -> None:
        t_in = perf_counter()
        if self.finished:
            # The script caught Done (a bare `except:`, `except BaseException`) and went on:
            # stop it again, or it would run to its end unmeasured.
            raise Done
        if restart:
            # A stronger boundary appeared (the first optimizer.step() after the first
            # backward()): what ran so far measured other steps; start over at this one.
            if self.phase is not None:
                self._leave(finished=False)
            self._reset()
            self._enter(self._after(None))
            self._t_out = perf_counter()
            return
        if self.phase is None:
            return
        phase = self.phases[self.phase]
        phase.close_step()
        if self._t_out is not None:
            self.durations[phase.name].append((t_in - self._t_out) * 1e3)
            self.contexts[phase.name].append(StepContext(
                self._t_out, t_in, self.bounds.forward_only - self._ctx0[0],
                self.feed.epoch_starts - self._ctx0[1], self.feed.wait_s * 1e3,
                self.feed.step_nexts, self.feed.step_waits))
        self.done[phase.name] += 1
        if not phase.complete(self.done[phase.name], self.plan[phase.name]):
            phase.open_step()
        else:
            self._leave(finished=True)
            following = self._after(phase.name)
            if following is None:
                self.finished = True
                raise Done
            self._enter(following)
        self._mark(t_in)

    def _mark(self, t_in: float) -> None:
        """A step begins (the doctor returns to the code)."""
        self._ctx0 = (self.bounds.forward_only, self.feed.epoch_starts)
        self.feed.new_step()
        self._t_out = perf_counter()
        if self.phase == self.plain.name:
            self.plain.own_s += self._t_out - t_in

    def _after(self, phase: str | None) -> str | None:
        rest = PHASES[PHASES.index(phase) + 1:] if phase else PHASES
        return next((p for p in rest if self.planned(p) > 0), None)

    def planned(self, phase: str) -> int:
        if phase == "probe" and not cuda():
            return 0
        if phase == "kernels" and not (cuda() or self.trace):
            return 0
        return self.plan[phase]

    def _enter(self, phase: str | None) -> None:
        if phase is None:
            return
        self.phase = phase
        self.entered.append(phase)
        self.phases[phase].enter()
        self.phases[phase].open_step()

    def _leave(self, finished: bool) -> None:
        if self.phase is None:
            return
        phase, self.phase = self.phases[self.phase], None
        phase.leave(finished)

    # ---- what the phases and the report ask ------------------------------------------------

    def evaluation_only(self) -> bool:
        """Steps that end at a model call or next(), while an optimizer exists that never
        stepped: an evaluation before training (nanoGPT's estimate_loss() at iteration 0), not
        the training step, which ends at backward() or optimizer.step() once it comes."""
        return self.bounds.kind in (MODULE, LOADER) and self.bounds.optimizer_made

    def split(self, phase: str) -> Series:
        return split_steps(self.durations[phase], self.contexts[phase])
