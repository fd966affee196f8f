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
import sys
import tempfile
import threading
import traceback
from time import perf_counter

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ._boundary import (ANY_OPTIMIZER, BACKWARD, MARKER, MODULE, OPTIMIZER, STEP_AT, Boundaries,
                        parse_step_at)
from ._frames import short
from ._loader import loader_settings, timed_dataloaders
from ._sampler import StackSampler
from .audit import Audit
from .diagnose import Diagnosis, QueueProbe, assess, launch_cost_us, profiler, trace_gpu
from .monitor import StepMonitor

PHASES = ("warm-up", "monitor", "probe", "audit", "kernels")


class _Done(BaseException):
    """Stops the script once enough steps were seen (BaseException: `except Exception` in the
    script must not swallow it)."""


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class ScriptSession:
    """Runs a script, moving through the phases at its step boundaries."""

    def __init__(self, warmup: int = 3, steps: int = 30, probe_steps: int = 3,
                 audit_steps: int = 10, trace: str | None = None, trace_steps: int = 3,
                 step_at: tuple[str, int] | None = None):
        self.plan = {"warm-up": warmup, "monitor": steps, "probe": probe_steps,
                     "audit": audit_steps, "kernels": trace_steps}
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

    # ---- the data-wait side of timed_dataloaders ------------------------------------------------

    def add_data_wait(self, seconds: float) -> None:
        self.monitor.add_data_wait(seconds)

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
            return
        if self.phase is None:
            return
        self._close_step()
        self.done[self.phase] += 1
        if self.done[self.phase] < self.plan[self.phase]:
            self._open_step()
            return
        self._leave(finished=True)
        following = self._after(self.entered[-1])
        if following is None:
            self.finished = True
            raise _Done
        self._enter(following)
        self._open_step()

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
        if phase == "monitor":
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
        if phase == "monitor":
            if finished:
                self.step_ms = (self._drained_clock() - self._t0) * 1e3 / self.done["monitor"]
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
        warmup = self.plan["warm-up"]
        m = self.monitor.summary(skip=warmup)
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
        if self.step_at and kind != STEP_AT:
            notes.insert(0, f"--step-at {short(self.step_at[0])}:{self.step_at[1]} never ran"
                            + (f": the steps end at each {kind} instead" if kind else ""))
        if self.probe is not None and self.probe.uncovered:
            notes.append(f"{self.probe.uncovered} of the probed steps took the host longer than "
                         "the GPU sleep that held their kernels back (a slow batch?): not timed"
                         + ("" if self.probe.steps else "; the GPU work is the trace's"))
        if "audit" not in self.entered:
            self.audit.reason = "the script ended before the audit"
        m = self._feeding_loader_only(m, notes)
        step_ms = self.step_ms if self.step_ms is not None else m.step_ms
        monitored = max(1, self.done["monitor"])
        d = assess(m, self.audit, self.done["warm-up"], step_ms, gpu, m.gpu_ms, self.gpu_pure_ms,
                   self.probe.steps if self.probe else 0, notes,
                   kernel_time=self.kernel_time,
                   launch_us=launch_cost_us() if gpu else None, sampler=self.sampler,
                   boundary=self.boundary_text(),
                   optimizer_ms=self.optimizer_s * 1e3 / monitored if self.optimizer_s else None,
                   model=self.bounds.model, autocast=self.bounds.autocast)
        if self.traced:
            d.trace = self.trace
        return d

    def _feeding_loader_only(self, m, notes: list):
        """The data wait of the loader that feeds the steps (the most next() calls), not of
        others (an evaluation loader every N steps): more workers for the training loader
        would not shorten those; their waits count to the step body, with a note."""
        if len(self._loaders) < 2 or not m.steps:
            return m
        recs = sorted(self._loaders.values(), key=lambda r: -r[1])   # stable: first seen wins
        feeding, others = recs[0], recs[1:]
        moved = sum(r[2] for r in others) * 1e3 / m.steps
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


def parse_args(argv: list[str] | None,
               prog: str = "python -m syncless doctor") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return checked(p, p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The doctor's options (`syncless doctor` is a subcommand built from them)."""
    p.add_argument("--warmup", type=_count(0), default=None, metavar="N",
                   help="unmeasured first steps (default 3)")
    p.add_argument("--steps", type=_count(1), default=None, metavar="N",
                   help="monitored steps (default 30)")
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
                   help="fewer steps: --warmup 2 --steps 15 --audit-steps 5 --trace-steps 4")
    p.add_argument("--json", metavar="PATH", help="also write the diagnosis as JSON to PATH")
    p.add_argument("script", help="the training script, run as __main__")
    # Optional (argparse calls every REMAINDER positional required, and says so when the script
    # is missing: "required: script, args").
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="the script's own arguments").required = False


def checked(p: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.Namespace:
    """The defaults --quick changes, and the paths checked before the script starts."""
    defaults = QUICK if ns.quick else {"warmup": 3, "steps": 30, "probe_steps": 3,
                                       "audit_steps": 10, "trace_steps": 3}
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


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(ns: argparse.Namespace) -> int:
    """Run the script of parsed arguments through the phases and print the report."""
    session = ScriptSession(ns.warmup, ns.steps, ns.probe_steps, ns.audit_steps, ns.trace,
                            ns.trace_steps, ns.step_at)
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
