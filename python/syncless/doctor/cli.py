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
import json
import os
import sys
import traceback
from time import perf_counter
from typing import Callable

from . import _verify
from ._boundary import parse_step_at
from ._isolate import Watch
from ._load import LoadMeter, process_age_s
from ._scratch import Scratch
from ._loader import cpu_count
from ._session import ScriptSession
from ._session_report import diagnosis
from .diagnose import Diagnosis


def _count(least: int) -> Callable[[str], int]:
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
REPORT_S = 5.0            # of it, kept for the report after the runs and the exit
PROBE_OVER = 4.0          # ... and up to this many times more, one run is timed to decide
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
                        "torch.compile, TF32; an HF Trainer's as TrainingArguments) in fresh "
                        "paired runs of the script, and keep it "
                        "only if its 95%% interval on the step-time ratio wins (default: on "
                        "when those runs are estimated to fit the doctor's "
                        f"{VERIFY_BUDGET_S:.0f} s in all, and stopped there)")
    p.add_argument("--verify-pairs", type=_count(2), default=3, metavar="N",
                   help="paired runs (with and without the fix) per fix before the comparison "
                        "decides (default 3; more while it is unclear, up to 8)")
    p.add_argument("--measure", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--apply", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--exit-when-measured", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("script", help="the training script, run as __main__")
    # Optional (argparse calls every REMAINDER positional required, and says so when the script
    # is missing: "required: script, args").
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="the script's own arguments").required = False
    # The command line's own run (not a call inside a longer-lived process): the 120 s of the
    # default verification count from the interpreter's start.
    p.set_defaults(from_start=False)


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


def quick_skipped(ns: argparse.Namespace) -> str:
    """What --quick left out, against the default run: the report's note."""
    names = {"warmup": "at least {} warm-up steps", "steps": "{} monitored steps",
             "audit_steps": "{} audited steps"}
    fewer = [what.format(getattr(ns, k)) + f" (default {DEFAULT[k]})"
             for k, what in names.items() if getattr(ns, k) < DEFAULT[k]]
    plain = ns.plain_steps if ns.plain_steps is not None else ns.steps
    return ("--quick: " + ", ".join(fewer) + f", {plain} steps timed unobserved (default "
            f"{DEFAULT['steps']}): a stall that comes less often than that is seen as a one-off; "
            "the window still starts past the loader's prefetch and the warm-up")


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
        json.dump({"plain_step_ms": session.plain.step_ms(), "steps": session.done["plain"],
                   "warmup_steps": session.done["warm-up"], "why": session.why}, f)
    if ns.exit_when_measured:
        # A verifying run's answer is written: what is left is the script's teardown (its
        # loader workers joined, its CUDA context), which measures nothing; the runner ends
        # the workers with the run's process group.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _verify_fixes(ns: argparse.Namespace, session: "ScriptSession", d: Diagnosis,
                  cwd: str, elapsed_s: float, watch: Watch | None, born: float) -> None:
    """--verify (or its default): the setting fixes measured in fresh paired runs, each in a
    scratch copy of the working directory with the trackers off (see _isolate). By default
    they run when they fit what is left of VERIFY_BUDGET_S since the process was `born` (a
    perf_counter() time: the user's clock starts with the interpreter), and stop there: a
    compiled run can take many times the plain one."""
    fixes = _verify.setting_fixes(d)
    if not fixes or ns.verify is False:
        return
    cpus = cpu_count()
    loader = d.summary.loader or {}
    per = _verify.fix_runs(fixes, ns.verify_pairs, loader.get("num_workers") or 0, cpus)
    runs = sum(per)
    # A measured run takes about what the doctor took to reach the end of its unobserved window
    # (the interpreter's start, the script's setup, warm-up and the window).
    estimate = runs * elapsed_s
    end = born + VERIFY_BUDGET_S - REPORT_S         # where the default stops them
    budget = end - perf_counter()
    why = watch.why_not() if watch is not None else None
    if ns.verify is None and why is not None:
        d.verify_lines = [f"off: {why}; pass --verify to run them anyway"]
        return
    if ns.verify is None and per[0] * elapsed_s > PROBE_OVER * budget:
        d.verify_lines = [_over_budget(runs, estimate, budget)]
        return
    if why is not None:
        print(f"\nsyncless doctor: --verify runs the script again although {why}",
              file=sys.stderr, flush=True)
    scratch = Scratch(cwd, watch)
    v = _verify.Verifier(os.path.abspath(ns.script), ns.args, session.done["warm-up"],
                         max(session.plan["plain"], 5), ns.verify_pairs,
                         timeout_s=max(120.0, 10 * elapsed_s), cwd=cwd, scratch=scratch,
                         deadline=end if ns.verify is None else None)
    upto, why_not = None, ""
    try:
        if ns.verify is None and estimate > budget:
            # The doctor's own run paid imports a measured run does not (forks of a server
            # that has them): one run, timed, says what the others will take.
            v.measure_baseline()
            # That run is the first pair's without the fix, unless a sweep of the loop comes
            # first (imagenet -j 4 on an H100: 6 runs of 9.8 s, 72 s left: 5 more fit).
            sweeps = per[0] > 2 * ns.verify_pairs       # its runs beyond the pairs: a sweep
            spare = 1 if v.has_spare and not sweeps else 0
            # The fixes in the report's order, as many as fit (HF Trainer on an H100: three
            # findings, each a setting and the drop-in, 30 runs of ~17 s: none was measured).
            # A loader fix's runs with the fix take its shorter step (imagenet -j 4 on an
            # H100: 6 runs of 10.0 s, 69 s, with 64 s left; those with 16 workers ~4.6 s).
            current = loader.get("num_workers") or 0
            upto, spent, total = 0, v.seconds, v.seconds
            for i, (n, fix) in enumerate(zip(per, fixes)):
                fixed = ns.verify_pairs if n else 0           # its runs with the fix
                with_s = v.with_fix_s(_verify.fix_ratio(d, fix, current, cpus))
                total += (n - fixed - (spare if i == 0 else 0)) * v.last_s + fixed * with_s
                if total <= budget and upto == i:
                    upto, spent = i + 1, total
            if upto == 0:
                d.verify_lines = [_over_budget(runs, total, budget, v.last_s)]
                return
            if upto < len(per):
                rest = sum(per[upto:])
                why_not = (f"by default verification ends at {VERIFY_BUDGET_S:.0f} s; its "
                           f"{rest} runs would take about {total - spent:.0f} s more: "
                           "python -m syncless doctor --verify measures every fix")
            else:
                upto = None
        meter = LoadMeter()
        d.verify_lines = _verify.verify(d, v, loader, cpus, upto, why_not)
        d.verify_load = meter.read()
        d.verify_runs = (v.runs, v.seconds)
        d.verify_where = (f"each in a fresh copy of the working directory under {scratch.root} "
                          "(removed), trackers off" + (f"; not isolated: {why}" if why else ""))
    finally:
        d.verify_log = {"server_s": round(v.server_s, 2), "runs": v.log}
        v.close()
        scratch.close()


def _over_budget(runs: int, estimate: float, budget: float, one: float | None = None) -> str:
    took = f" (one, timed in a scratch copy of the working directory, took {one:.1f} s)" \
        if one is not None else ""
    return (f"off: its {runs} runs would take about {estimate:.0f} s{took}, and by default the "
            f"doctor takes {VERIFY_BUDGET_S:.0f} s in all ({max(0.0, budget):.0f} s were left); "
            "pass --verify to check the fixes")


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(ns: argparse.Namespace) -> int:
    """Run the script of parsed arguments through the phases and print the report."""
    if ns.measure:
        return _measure(ns)
    started, cwd = perf_counter(), os.getcwd()
    # The 120 s count from the interpreter's start where the doctor is the command line's (an
    # HF Trainer's doctor on an H100 took 121.4 s by the user's clock, its imports included).
    born = started - (process_age_s() if ns.from_start else 0.0)
    session = ScriptSession(ns.warmup, ns.steps, ns.probe_steps, ns.audit_steps, ns.trace,
                            ns.trace_steps, ns.step_at, ns.plain_steps)
    exit_, error = None, None
    script = os.path.abspath(ns.script)          # now: the script may chdir
    # What the script writes and where it connects, for --verify's runs of it.
    watch = Watch(cwd, script) if ns.verify is not False else None
    try:
        if watch is not None:
            with watch:
                session.run(ns.script, ns.args)
        else:
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
        d = diagnosis(session)
        if ns.quick:
            d.notes.append(quick_skipped(ns))
        text = d.report()
    except Exception:
        print("\nsyncless doctor: the report failed (a bug in syncless: please report it):",
              file=sys.stderr)
        traceback.print_exc()
    else:
        if error is None and session.plain.done_s is not None:
            try:
                _verify_fixes(ns, session, d, cwd, session.plain.done_s - started + 2.0,
                              watch, born)
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


def _print_script_error(error: BaseException, script: tuple[str, str]) -> None:
    """The script's traceback as `python script.py` prints it: from the script's own frame, not
    through the doctor's and runpy's (all of it when the script's frame is not on it). `script`:
    its path as given (runpy's code filename) and as an absolute path."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename not in script and \
            os.path.abspath(tb.tb_frame.f_code.co_filename) != script[1]:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)
