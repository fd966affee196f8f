"""--verify: each fix that is a setting, applied from outside the script and measured.

A fix is measured in fresh runs of the script (`python -m syncless doctor --measure`), each timing
its steps unobserved after an honest warm-up (past the loader's prefetch, past compiles), with the
setting applied from outside the code:

  loader    DataLoader.__init__'s arguments replaced (num_workers, pin_memory,
            persistent_workers, prefetch_factor) for every DataLoader the script makes
  compile   the outermost model compiled in place (nn.Module.compile) at its first call
  tf32      TF32 matmuls and convolutions (torch.backends ... allow_tf32 = True)
  hf        transformers.TrainingArguments fields replaced before its __post_init__ (the
            Trainer's dataloader_num_workers, dataloader_pin_memory,
            dataloader_persistent_workers, torch_compile, torch_compile_mode,
            accelerator_config={"non_blocking": True}): the fix as an HF Trainer user writes it
  lightning lightning.pytorch / pytorch_lightning Trainer arguments replaced for every Trainer
            the script makes (enable_progress_bar=False)
  dropin    syncless's drop-in for the framework's loop: "transformers" makes the script's
            `Trainer` (transformers.Trainer, transformers.trainer.Trainer) a
            syncless.hf.SynclessTrainer; "lightning" appends SynclessLogging() to the callbacks
            of every lightning.pytorch / pytorch_lightning Trainer the script makes

A Lightning Trainer runs the user's own DataLoader and model: its loader fix is the DataLoader's
arguments (loader), its compile the model's (compile).

A framework's sync can have two fixes: its own setting (logging_nan_inf_filter=False,
enable_progress_bar=False) and syncless's drop-in. Each is measured; the finding's `verified` holds
the setting's result and `dropin_verified` the drop-in's (`verified` the drop-in's when the sync has
no setting with one value to apply).

Runs are paired and interleaved (A B, B A, A B ...: drifts of the host hit both sides alike) and
compared on the log of their ratio (_stats.py says why, and how one outlier run is kept from
flipping the verdict); pairs are added while the comparison is unclear, and the fix is kept when
it wins. The worker count is the one the finding's side loaders measured; where they measured
none, a sweep times each candidate count once, and the fastest is verified in pairs."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import tempfile
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable

from . import _stats
from ._frameworks import DROPINS, applied_label
from ._forkserver import PRELOAD, Runner
from ._isolate import TRACKERS_OFF
from ._scratch import Scratch

if TYPE_CHECKING:
    from .diagnose import Diagnosis
    from .findings import Finding

__all__ = ["apply", "Verifier"]

ENV = "SYNCLESS_DOCTOR_APPLY"


# ---- in the measured run: the settings, applied from outside the code ---------------------------

def apply(settings: dict[str, Any]) -> Callable[[], None]:
    """Apply `settings` (what --apply carries) to this process before the script runs; returns
    the function that undoes it."""
    import torch
    dropin = settings.get("dropin") or ()
    dropins = [dropin] if isinstance(dropin, str) else list(dropin)
    unknown = [n for n in dropins if n not in DROPINS]
    if unknown:                  # before anything is applied: nothing is left to undo
        raise ValueError(f"--apply: no syncless drop-in for {unknown[0]!r} (one of "
                         f"{', '.join(map(repr, DROPINS))})")
    undo: list[Callable[[], None]] = []
    loader = settings.get("loader")
    if loader:
        undo.append(_patch_dataloader(loader))
    if settings.get("tf32"):
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

        def tf32_off() -> None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        undo.append(tf32_off)
    mode = settings.get("compile")
    if mode:
        undo.append(_compile_first_model(mode))
    hf = settings.get("hf")
    if hf:
        undo.append(_patch_training_arguments(hf))
    trainer_args = settings.get("lightning")
    if trainer_args:
        undo.append(_lightning_trainers(lambda kwargs, _: kwargs.update(trainer_args)))
    for name in dropins:
        undo.append(_trainer_dropin() if name == "transformers" else _logging_dropin())

    def undo_all() -> None:
        for u in reversed(undo):
            u()
    return undo_all


def _patch_dataloader(overrides: dict[str, Any]) -> Callable[[], None]:
    from torch.utils.data import DataLoader
    original = DataLoader.__init__
    signature = inspect.signature(original)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        workers = overrides.get("num_workers", bound.arguments.get("num_workers", 0))
        for key, value in overrides.items():
            if key in ("prefetch_factor", "persistent_workers") and not workers:
                continue                    # only valid with workers
            bound.arguments[key] = value
        original(*bound.args, **bound.kwargs)

    setattr(DataLoader, "__init__", init)

    def restore() -> None:
        setattr(DataLoader, "__init__", original)
    return restore


def _patch_training_arguments(overrides: dict[str, Any]) -> Callable[[], None]:
    from transformers import TrainingArguments
    original = TrainingArguments.__post_init__

    def post_init(self: Any) -> None:
        workers = overrides.get("dataloader_num_workers", self.dataloader_num_workers)
        for key, value in overrides.items():
            if key in ("dataloader_persistent_workers", "dataloader_prefetch_factor") and \
                    not workers:
                continue                    # only valid with workers
            current = getattr(self, key, None)
            if key == "accelerator_config" and current is not None:
                if isinstance(current, dict):
                    value = {**current, **value}
                elif not isinstance(current, str):   # an AcceleratorConfig: its fields
                    for k, v in value.items():
                        setattr(current, k, v)
                    continue
            setattr(self, key, value)
        original(self)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated

    setattr(TrainingArguments, "__post_init__", post_init)

    def restore() -> None:
        setattr(TrainingArguments, "__post_init__", original)
    return restore


def _trainer_dropin() -> Callable[[], None]:
    """The script's `Trainer` is syncless.hf.SynclessTrainer: set where `from transformers import
    Trainer` and `transformers.trainer.Trainer` find it, before the script imports it."""
    import transformers
    import transformers.trainer
    from .. import hf
    trainer = transformers.trainer.Trainer
    syncless = hf.SynclessTrainer
    setattr(transformers, "Trainer", syncless)
    setattr(transformers.trainer, "Trainer", syncless)

    def restore() -> None:
        setattr(transformers, "Trainer", trainer)
        setattr(transformers.trainer, "Trainer", trainer)
    return restore


def _logging_dropin() -> Callable[[], None]:
    """Every Lightning Trainer the script makes gets a SynclessLogging() after its own callbacks
    (none when it has one already)."""
    from .. import lightning

    def with_callback(kwargs: dict[str, Any], package: str) -> None:
        callback = lightning.SynclessLogging if package == "lightning.pytorch" else \
            lightning.SynclessLoggingPL
        given = kwargs.get("callbacks") or []
        given = [given] if not isinstance(given, (list, tuple)) else list(given)
        if not any(isinstance(c, callback) for c in given):
            kwargs["callbacks"] = [*given, callback()]
    return _lightning_trainers(with_callback)


def _lightning_trainers(edit: Callable[[dict[str, Any], str], None]) -> Callable[[], None]:
    """Every Lightning Trainer the script makes (lightning.pytorch's and pytorch_lightning's, those
    installed) has its keyword arguments passed through `edit(kwargs, package)` first."""
    undo = [_edit_init(importlib.import_module(package).Trainer, package, edit)
            for package in ("lightning.pytorch", "pytorch_lightning")
            if importlib.util.find_spec(package.split(".")[0]) is not None]

    def restore() -> None:
        for u in undo:
            u()
    return restore


def _edit_init(trainer: type, package: str,
               edit: Callable[[dict[str, Any], str], None]) -> Callable[[], None]:
    original = vars(trainer)["__init__"]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        edit(kwargs, package)
        original(self, *args, **kwargs)

    setattr(trainer, "__init__", init)

    def restore() -> None:
        setattr(trainer, "__init__", original)
    return restore


def _compile_first_model(mode: str) -> Callable[[], None]:
    import torch
    call = torch.nn.Module.__call__

    def first_call(module: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(torch.nn.Module, "__call__", call)
        module.compile(mode=None if mode == "default" else mode)
        return call(module, *args, **kwargs)

    setattr(torch.nn.Module, "__call__", first_call)

    def restore() -> None:
        if torch.nn.Module.__call__ is first_call:
            setattr(torch.nn.Module, "__call__", call)
    return restore


# ---- in the doctor: run, pair, decide ------------------------------------------------------------

def run_env() -> dict[str, str]:
    """The environment of a measured run: the doctor's, with the experiment trackers off, and the
    compile caches those of the doctor's own run (torch.compile's cache is found by the user's
    name under the temp folder: set here, so that every run finds the same one, whatever TMPDIR
    a script's launcher sets)."""
    env = dict(os.environ, **TRACKERS_OFF)
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        user = re.sub(r'[\\/:*?"<>|]', "_", _user())    # as torch names it
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                      f"torchinductor_{user}")
    return env


def preloads(limit: int = 100_000) -> tuple[str, ...]:
    """The modules of PRELOAD's frameworks that this process imported (the doctor's own run of
    the script), in the order it imported them, for the server to import once: an HF Trainer's
    verifying run took 2.4 s with none, 1.8 s with the top packages, 0.4 s with its 238 modules
    (this 2-core host). Only the top packages when the names would make an environment
    variable over `limit` characters."""
    names = tuple(m for m in list(sys.modules) if m.partition(".")[0] in PRELOAD)
    if sum(len(m) + 1 for m in names) > limit:
        names = tuple(m for m in names if "." not in m)
    return names


def _user() -> str:
    import getpass
    try:
        return getpass.getuser()
    except Exception:                       # no user name (a container without one)
        return "unknown"


MIN_RUN_S = 1.0      # no run starts with less time than this left before the deadline


class Verifier:
    """Fresh measured runs of `script args`, each `warmup` + `steps` unobserved steps."""

    def __init__(self, script: str, args: list[str], warmup: int, steps: int, pairs: int = 3,
                 timeout_s: float = 600.0, cwd: str | None = None,
                 scratch: Scratch | None = None, deadline: float | None = None) -> None:
        self.script, self.args = script, args
        self.warmup, self.steps, self.pairs = warmup, steps, pairs
        self.timeout_s = timeout_s
        # perf_counter() past which no run goes on (None: none): a run that would end after it
        # is not started, one under way is stopped there, and out_of_time is set.
        self.deadline = deadline
        self.out_of_time = False
        self.cwd = cwd or os.getcwd()
        self.scratch = scratch
        self.runner = Runner(run_env(), preloads())
        self.runs = 0
        self.seconds = 0.0          # all of it: the runs and the server's start
        self.last_s = 0.0           # the last run's
        # Each run: its settings, seconds, step (ms; None: measured nothing), whether it ended
        # by itself and was a fork of the server; and the server's start (the doctor's JSON).
        self.log: list[dict[str, Any]] = []
        self.server_s = 0.0
        self._spare: tuple[int, float] | None = None    # (runs made by then, its step ms)

    def close(self) -> None:
        self.runner.close()

    def measure(self, settings: dict[str, Any]) -> float | None:
        """One run's steady step (ms) with `settings` applied; None if it measured nothing. The
        first run that measures nothing as a fork of the server is run again as a fresh
        interpreter; if that one measures, every later run is one too."""
        ms, ended = self._measure(settings)
        if ms is None and ended and self.runner.forks:
            self.runner.fresh()
            ms, _ = self._measure(settings)
        return ms

    def measure_baseline(self) -> float | None:
        """One run without a fix, timed to estimate what the others take; the first pair's run
        without a fix when that pair comes next (no run between them), not one more."""
        ms = self.measure({})
        self._spare = (len(self.log), ms) if ms is not None else None
        return ms

    @property
    def has_spare(self) -> bool:
        """measure_baseline()'s run is there for the first pair (no run came since)."""
        return self._spare is not None and self._spare[0] == len(self.log)

    def with_fix_s(self, ratio: float | None) -> float:
        """What a run with a fix that makes the step `ratio` times today's should take: the
        timed baseline run's seconds, its window (warm-up and measured steps) at the shorter
        step. Where the ratio is not known or not below 1 (compile: a compiled run can take many
        times the plain one), the timed run's own seconds. imagenet -j 4 on an H100: a 10.0-s
        run, ~8 s of it 37 steps at 216 ms; with 16 workers a step of ~70 ms is predicted:
        ~4.6 s."""
        if ratio is None or not 0 < ratio < 1 or self._spare is None:
            return self.last_s
        window = min(self.last_s, (self.warmup + self.steps) * self._spare[1] / 1e3)
        return self.last_s - window * (1 - ratio)

    def _measure(self, settings: dict[str, Any]) -> tuple[float | None, bool]:
        """(the steady step, whether the run ended by itself: not timed out). The
        run starts in a fresh scratch working directory (the script through its copy there when
        it lives in the working directory, so that paths made from __file__ land there too),
        with the trackers off, and stops once its window is timed."""
        timeout = self.timeout_s
        if self.deadline is not None:
            left = self.deadline - perf_counter()
            if left < max(MIN_RUN_S, 0.8 * self.last_s):  # it would be stopped before it measures
                self.out_of_time = True
                return None, False
            timeout = min(timeout, left)
        here = self.scratch.make() if self.scratch is not None else self.cwd
        script = self.script
        if self.scratch is not None:
            inside = self.scratch.inside(script)
            if inside != script and os.path.lexists(os.path.join(here, inside)):
                script = os.path.join(here, inside)
        with tempfile.TemporaryDirectory(prefix="syncless-measure-") as tmp:
            out = os.path.join(tmp, "m.json")
            argv = ["--measure", out, "--exit-when-measured", "--apply", json.dumps(settings),
                    "--warmup", str(self.warmup), "--plain-steps", str(self.steps), script,
                    *self.args]
            t = perf_counter()
            self.runner.start()
            started = perf_counter()
            self.server_s += started - t
            fork = self.runner.forks
            ms: float | None = None
            ended = False
            try:
                if self.runner.run(argv, here, timeout) is None:
                    self.out_of_time |= timeout < self.timeout_s
                    return None, False          # timed out
                ended = True
                try:
                    with open(out) as f:
                        got = json.load(f).get("plain_step_ms")
                    ms = float(got) if got is not None else None
                except (OSError, ValueError):
                    pass
                return ms, True
            finally:
                self.runs += 1
                self.last_s = perf_counter() - started
                self.seconds += perf_counter() - t
                self.log.append({"apply": settings, "s": round(self.last_s, 2), "ms": ms,
                                 "ended": ended, "fork": fork})
                if self.scratch is not None:
                    self.scratch.drop(here)

    def paired(self, settings: dict[str, Any],
               base: dict[str, Any] | None = None,
               more_s: float | None = None) -> dict[str, Any] | None:
        """Interleaved pairs (A B, B A, ...) of the baseline and `settings`, compared on the log
        of their ratio (_stats.compare): `pairs` of them, then one more while the comparison is
        unclear, up to MAX_PAIRS pairs and `more_s` seconds more (default: the time the first
        `pairs` took)."""
        base = base or {}
        a_ms: list[float] = []
        b_ms: list[float] = []
        started, first_s = perf_counter(), None
        while True:
            i = len(a_ms)
            # A B, then B A: a pair counts once both of its runs measured.
            first, second = (base, settings) if i % 2 == 0 else (settings, base)
            spare, self._spare = self._spare, None
            if i == 0 and not first and spare is not None and spare[0] == len(self.log):
                ms1: float | None = spare[1]        # measure_baseline()'s run, just before
            else:
                ms1 = self.measure(first)
            ms2 = None if ms1 is None else self.measure(second)
            if ms1 is None or ms2 is None:
                if i >= self.pairs and self.out_of_time:
                    break                           # the pairs so far decide
                return None
            a_ms.append(ms1 if i % 2 == 0 else ms2)
            b_ms.append(ms2 if i % 2 == 0 else ms1)
            spent = perf_counter() - started
            if i + 1 == self.pairs:
                first_s = spent
            if i + 1 < self.pairs:
                continue
            c = _stats.compare(a_ms, b_ms)
            assert first_s is not None
            more = spent * (i + 2) / (i + 1) - first_s <= (first_s if more_s is None else more_s)
            if c.decided or i + 1 >= max(self.pairs, _stats.MAX_PAIRS) or not more:
                break
        return {"measured_ms": c.fix_ms, "baseline_ms": c.baseline_ms,
                "ci_low_ms": c.baseline_ms * c.low, "ci_high_ms": c.baseline_ms * c.high,
                "kept": c.kept, "win": c.text(), **c.as_dict(),
                "runs": {"without": a_ms, "with": b_ms}}

    def sweep_workers(self, candidates: list[int], extra: dict[str, Any],
                      framework: str = "") -> tuple[int | None, dict[int, float]]:
        """Each worker count once (with `extra` loader settings); the fastest and all readings."""
        seen: dict[int, float] = {}
        for k in candidates:
            if self.out_of_time:
                break
            ms = self.measure(loader_fix(k, extra, framework)[1])
            if ms is not None:
                seen[k] = ms
        best = min(seen, key=lambda k: seen[k]) if seen else None
        return best, seen


_NOT_KEPT = {"loss": "it loses", "no win": "the interval rules out a win of 3% or more",
             "unclear": "the interval does not say it wins"}


def loader_fix(workers: int, extra: dict[str, Any],
               framework: str = "") -> tuple[str, dict[str, Any]]:
    """(label, settings) of the loader fix with `workers` workers and the `extra` DataLoader
    settings (persistent_workers, pin_memory), in the framework's words: an HF Trainer makes its
    DataLoader from TrainingArguments; anything else, Lightning too, makes its own."""
    if framework == "transformers":
        args: dict[str, Any] = {"dataloader_num_workers": workers}
        if workers and extra.get("persistent_workers"):
            args["dataloader_persistent_workers"] = True
        if extra.get("pin_memory"):
            args["dataloader_pin_memory"] = True
            args["accelerator_config"] = {"non_blocking": True}
        label = "TrainingArguments(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
        return label, {"hf": args}
    loader = {"num_workers": workers, **(extra if workers else {})}
    return ", ".join(f"{k}={v}" for k, v in loader.items()), {"loader": loader}


def worker_candidates(current: int, needed: int | None, cpus: int) -> list[int]:
    """Worker counts to sweep: powers of two up to the CPUs (and the count the finding asks
    for), with the current count."""
    top = max(cpus, needed or 0, 1)
    ks = {current, 1, 2, 4, 8, 16, 32, needed or 1, cpus}
    return sorted(k for k in ks if 0 <= k <= min(top, 64))


def finding_candidates(finding: Finding, current: int, cpus: int) -> list[int]:
    """worker_candidates for a starvation finding; none where its side loaders measured the
    count it prescribes: the pairs then time the loop at the current count and at that one,
    which is all a sweep of the loop would add (imagenet on an H100: a sweep of the current
    count, the prescribed one and twice it made 9 runs of 9.4 s with 75 s left; the pairs
    alone, 6)."""
    needed = finding.extra.get("workers_needed")
    if (finding.extra.get("sweep") or {}).get("period_ms") and needed and needed != current:
        return []
    return worker_candidates(current, needed, cpus)


# (finding, label, settings, slot): `slot` is where the result goes, the finding's "verified" or
# its extra "dropin_verified".
Setting = tuple["Finding | None", str, "dict[str, Any] | None", str]


def setting_fixes(d: Diagnosis) -> list[Setting]:
    """(finding, label, settings, slot) for each fix --verify can apply from outside the code."""
    out: list[Setting] = []
    for f in d.findings:
        if f.kind == "starvation":
            out.append((f, "loader", None, "verified"))          # settings chosen by the sweep
        elif f.kind == "launch-bound" and d.framework == "transformers":
            out.append((f, 'TrainingArguments(torch_compile=True, torch_compile_mode='
                        '"reduce-overhead")', {"hf": {"torch_compile": True,
                                                      "torch_compile_mode": "reduce-overhead"}},
                        "verified"))
        elif f.kind == "launch-bound":
            out.append((f, "compile (reduce-overhead)", {"compile": "reduce-overhead"},
                        "verified"))
        elif f.kind == "framework":
            apply, name = f.extra.get("apply"), f.extra.get("dropin")
            if apply:
                out.append((f, applied_label(apply), apply, "verified"))
            if name in DROPINS:
                out.append((f, DROPINS[name], {"dropin": name},
                            "dropin_verified" if apply else "verified"))
    if d.gpu and d.verdict_kind == "GPU-bound" and any("TF32" in s or "tf32" in s
                                                      for s in d.speedups):
        out.append((None, "TF32", {"tf32": True}, "verified"))
    return out


def fix_runs(fixes: list[Setting], pairs: int, current: int, cpus: int) -> list[int]:
    """The runs each fix of `fixes` adds to verification at `pairs` pairs: a loader fix's sweep
    and pairs, a setting's pairs; none for a setting an earlier fix shares (it runs once)."""
    out, seen = [], set()
    for f, label, settings, _ in fixes:
        if label == "loader" and f is not None:
            out.append(2 * pairs + len(finding_candidates(f, current, cpus)))
            continue
        key = json.dumps(settings, sort_keys=True)
        out.append(0 if key in seen else 2 * pairs)
        seen.add(key)
    return out


def fix_ratio(d: Diagnosis, fix: Setting, current: int, cpus: int) -> float | None:
    """The step with a loader fix over today's, where the pairs alone time it (side loaders
    measured the count the finding prescribes); None for any other fix."""
    f, label = fix[0], fix[1]
    if f is None or label != "loader" or finding_candidates(f, current, cpus) or \
            f.predicted_ms is None or not d.step_ms:
        return None
    return f.predicted_ms / d.step_ms


def _record(finding: Finding | None, slot: str, result: dict[str, Any] | None) -> None:
    if finding is None:
        return
    if slot == "verified":
        finding.verified = result
    else:
        finding.extra[slot] = result


def verify(d: Diagnosis, verifier: Verifier, loader: dict[str, Any], cpus: int,
           upto: int | None = None, why_not: str = "") -> list[str]:
    """Measure each setting fix of diagnosis `d` (the first `upto` of them: the rest are not
    measured, `why_not`); set each finding's `verified`; returns lines for the report."""
    lines: list[str] = []
    fixes = setting_fixes(d)
    done: dict[str, dict[str, Any] | None] = {}    # a setting two findings share runs once
    skipped: set[str] = set()
    for i, (finding, label, settings, slot) in enumerate(fixes):
        if upto is not None and i >= upto:
            key = json.dumps(settings, sort_keys=True)
            if settings is None:                    # a loader fix (its sweep chooses)
                lines.append(f"{finding.title if finding else label}: its loader fix not "
                             f"measured ({why_not})")
            elif key in done:                       # measured already, for an earlier fix
                _record(finding, slot, done[key])
            elif key not in skipped:
                lines.append(f"{label}: not measured ({why_not})")
            skipped.add(key)
            continue
        if label == "loader" and finding is not None:
            current = loader.get("num_workers") or 0
            extra = {"persistent_workers": True}
            if d.gpu:
                extra["pin_memory"] = True
            ks = finding_candidates(finding, current, cpus)
            if ks:
                best, seen = verifier.sweep_workers(ks, extra, d.framework)
            else:                                   # the count its side loaders measured
                best, seen = finding.extra["workers_needed"], {}
            sweep = ", ".join(f"{k}: {ms:.2f}" for k, ms in sorted(seen.items()))
            if best is None or best == current:
                finding.verified = {"measured_ms": seen.get(current), "ci_low_ms": None,
                                    "ci_high_ms": None, "kept": False, "sweep": seen}
                lines.append(f"{finding.title}: the sweep (num_workers: ms/step) {sweep} found "
                             f"no count faster than the current {current}: no loader fix kept"
                             + (" (verification's time ran out before the sweep ended)"
                                if verifier.out_of_time else ""))
                continue
            label, settings = loader_fix(best, extra, d.framework)
            result = verifier.paired(settings)
            if result is not None:
                result["sweep"] = seen
        elif settings is not None:
            key = json.dumps(settings, sort_keys=True)
            if key in done:                         # its line is written already
                _record(finding, slot, done[key])
                continue
            result = done[key] = verifier.paired(settings)
        else:
            continue
        _record(finding, slot, result)
        if result is None:
            lines.append(f"{label}: not measured (" + (
                "verification's time ran out: python -m syncless doctor --verify gives it all "
                "it takes" if verifier.out_of_time else "a run failed or timed out") + ")")
            continue
        predicted = finding.checked_ms if finding is not None else None
        lines.append(
            f"{label}: {result['baseline_ms']:.2f} -> {result['measured_ms']:.2f} ms/step, "
            + (f"{result['win']} over {result['pairs']} pairs" if "win" in result else
               f"[95%: {result['ci_low_ms']:.2f}, {result['ci_high_ms']:.2f}]")
            + (f", predicted {predicted:.2f}" if predicted is not None else "")
            + (": kept" if result["kept"] else
               f": not kept ({_NOT_KEPT.get(result.get('verdict', ''), _NOT_KEPT['unclear'])})")
            + (f"; sweep {sweep}" if finding is not None and finding.kind == "starvation"
               and sweep else ""))
    checked = {id(f) for f, _, _, _ in fixes}
    for f in d.findings:
        if id(f) not in checked:
            lines.append(f"{f.title}: a change in the code, not applied from outside: its "
                         "prediction stands, unmeasured")
    return lines
