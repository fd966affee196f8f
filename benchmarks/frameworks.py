"""Lightning and the Hugging Face Trainer, native against syncless: syncs per step, step time,
and whether the logged values are the same.

    python -m benchmarks.frameworks                  # CUDA; about 4 minutes on an H200
    python -m benchmarks.frameworks --quick          # 2 rounds, fewer steps
    python -m benchmarks.frameworks --device cpu     # the script's logic on CPU (no syncs exist)
    python -m benchmarks.frameworks --only hf --rounds 12 --keep benchmarks/results/frameworks.json
                                                     # one framework again, more rounds; the
                                                     # other's rows kept (and marked) from before

For each framework, two models: a small one (the host's per-step work dominates, where a sync
costs most) and a GPU-bound one. Data lives on the GPU already (pre-built batches), so that the
syncs counted are the logging's, not the batch copies'.

- Lightning: `self.log("loss", loss, prog_bar=True)` and `self.log("acc", acc, prog_bar=True)`,
  the default TQDM bar, CSVLogger, default `log_every_n_steps` (50); syncless adds
  `callbacks=[SynclessLogging()]`.
- Hugging Face: `Trainer` with default arguments (logging_steps=500, logging_nan_inf_filter on)
  except the data's `dataloader_pin_memory=False` (GPU tensors cannot be pinned); syncless uses
  `SynclessTrainer`.

Syncs: one run per variant with torch.cuda.set_sync_debug_mode("warn") over a window of
steady-state steps (after warm-up, before the end), counting the warnings and where they came
from; `stats.waits` of the syncless Logger counts any wait of the training thread on delivery.
The same runs give the logged values: Lightning's CSV file and the Trainer's log_history must be
identical (wall-clock keys aside). An extra counted configuration logs every step
(Lightning `log_every_n_steps=1`; HF `logging_steps=1` and `include_num_input_tokens_seen`).
When they differ, a second native run tells whether the native run itself is reproducible, the
table gives the largest relative difference of each pair, and (on CUDA) a child process runs the
three again under torch.use_deterministic_algorithms(True) and the math attention backend:
identical there means syncless changes no value, and the difference is the GPU kernels' own
nondeterminism.
Step time: the median ms/step of each variant over rounds, and the median of the per-round
ratios syncless/native with its 95% confidence interval (6 rounds at least), the training
thread's CPU time per step beside it. Every timed window, native and syncless alike, starts
after a full gc.collect() (outside the clock: a gen-2 collection is owed every so many surviving
objects, the runs before leave them, and left alone it fell in one run or another; on CPU 160 ms
inside one 1.2 s window, +14% for that run; the collections the steps cause still run inside
the clock, and are counted) with the threads pinned (Pinning.choose(); --no-pin to leave them):
the training thread(s) on one core, every other thread (CUDA's, the autograd engine's device
thread, syncless's delivery thread) on three others, so that no run pays for a migration or a
shared core that the other did not.

The small models' step is the host's work (about 200 kernels of a few µs, the GPU busy under a
tenth of it), and the H200 host runs the same code at two speeds, ~3.0 and ~4.2 ms/step for the
Lightning MLP, switching every second or so, in every process alike (measured with separate
runs: 12-15% between runs; pinning, gc.collect(), longer windows and the median of 50-step
pieces did not narrow it). So a round of a small model is a Lockstep: the native and the
syncless run at once, in two threads of this process that take turns of 25 steps (75-200 ms),
each turn between two device synchronizes, over 300 timed steps after 30 of warm-up; both see
the host in the same state, and a round's ms/step is each run's mean over its turns (12 each).
Syncless's delivery thread may run during a native turn (it then competes for the GIL); its CPU
time is measured, and the cross-check column adds all of it to syncless's time (an upper
bound). --separate times the small models by separate runs instead. The GPU-bound models are
timed by separate interleaved runs (a shuffled order each round), one window each between two
device synchronizes.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import io
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, ROOT)

from benchmarks._common import (SyncCount, env_info, interleave, md_table,  # noqa: E402
                                median_ci, num, paired_ratios, pct, pct_ci, summarize,
                                write_json)


# ---- counting and timing windows -------------------------------------------------------------

class Window:
    """Steps `start` to `stop` of one run (framework callbacks call begin(i) / end(i) at every
    step): either count sync-debug warnings, or time them.

    Timing, the same for both variants: a full gc.collect() before the clock starts (so that a
    gen-2 collection owed by earlier runs' garbage does not land in whichever run happens to be
    going; collections the steps themselves cause still run, and are counted in `gc`), then
    `pieces` equal sub-windows, each between two device synchronizes, each giving ms/step and the
    training thread's CPU ms/step; `pin` (a Pinning) is applied before the clock starts.
    """

    def __init__(self, start: int, stop: int, count: bool, cuda: bool, pieces: int = 1,
                 pin: "Pinning | None" = None):
        self.start, self.stop, self.count, self.cuda = start, stop, count, cuda
        self.syncs = SyncCount(_short)
        self.pin = pin
        n = stop - start + 1
        pieces = max(1, min(pieces, n))
        # The steps at which a piece begins, and the one after the last.
        self._bounds = [start + n * k // pieces for k in range(pieces)] + [stop + 1]
        self.piece_ms: list[float] = []
        self.piece_cpu_ms: list[float] = []
        self.seconds = None
        self.cpu_seconds = None              # the training thread's CPU time in the window
        self.gc = {"collections": [0, 0, 0], "ms": 0.0}
        self._gc_t0 = None
        self._in = False

    @property
    def steps(self) -> int:
        return self.stop - self.start + 1

    def _gc_event(self, phase: str, info: dict) -> None:
        # Any thread's collection: one holds the GIL, so the training thread waits for it too.
        if not self._in:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc["ms"] += (time.perf_counter() - self._gc_t0) * 1e3
            self.gc["collections"][info["generation"]] += 1
            self._gc_t0 = None

    def _mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.thread_time()
        if self._marks:
            t0, c0 = self._marks[-1]
            k = len(self._marks)
            steps = self._bounds[k] - self._bounds[k - 1]
            self.piece_ms.append((t - t0) / steps * 1e3)
            self.piece_cpu_ms.append((c - c0) / steps * 1e3)
        self._marks.append((t, c))

    def begin(self, i: int) -> None:
        if i == self.start:
            if self.count:
                if self.cuda:
                    self.syncs.start()
                return
            if self.pin is not None:
                self.pin.apply()
            gc.collect()
            gc.callbacks.append(self._gc_event)
            self._in = True
            self._marks: list = []
            self._mark()
        elif self._in and i in self._bounds[1:-1]:
            self._mark()

    def end(self, i: int) -> None:
        if i != self.stop:
            return
        if self.count:
            self.syncs.stop()
            return
        if not self._in:
            return
        self._mark()
        self._in = False
        gc.callbacks.remove(self._gc_event)
        (t0, c0), (t1, c1) = self._marks[0], self._marks[-1]
        self.seconds, self.cpu_seconds = t1 - t0, c1 - c0


class Pinning:
    """Fixed cores for the process's threads, the same for every run of both variants: the
    training thread alone on `main`, every other thread (the CUDA driver's, the autograd
    engine's device thread, syncless's delivery thread) on `others`. A thread inherits its
    creator's cores, so apply() runs at each window's start, after the run made its threads;
    it changes nothing the framework computes."""

    def __init__(self, main: set, others: set, allowed: set | None = None):
        self.main, self.others = set(main), set(others)
        self.allowed = set(allowed) if allowed else self.main | self.others

    @classmethod
    def choose(cls) -> "Pinning | None":
        """Core 1 for the training thread, cores 2-4 for the rest (core 0 takes most device
        interrupts); None where fewer than 5 cores are ours to use."""
        try:
            cores = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        if len(cores) < 5:
            return None
        return cls({cores[1]}, set(cores[2:5]), set(cores))

    @contextlib.contextmanager
    def released(self):
        """The calling thread on every core it had before pinning, inside the block: a child
        process started there inherits that, not the training thread's single core."""
        os.sched_setaffinity(0, self.allowed)
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.main)

    def apply(self, mains: set | None = None) -> None:
        """mains: the training threads' ids (default: the calling thread's)."""
        mains = mains or {threading.get_native_id()}
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            try:
                os.sched_setaffinity(tid, self.main if tid in mains else self.others)
            except OSError:                  # a thread that ended meanwhile
                pass

    def describe(self) -> str:
        return (f"training thread on core {sorted(self.main)}, other threads on cores "
                f"{sorted(self.others)}")


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for anchor in ("lightning", "transformers", "accelerate", "syncless", "torch"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor):])
    return parts[-1]


_quiet_lock = threading.Lock()
_quiet_users = 0
_quiet_stack: contextlib.ExitStack | None = None


@contextlib.contextmanager
def _quiet():
    """Progress bars and framework chatter go nowhere (they still run: users have them on).
    Shared by threads (the two fits of a lockstep round run at once): the first user silences,
    the last one restores."""
    global _quiet_users, _quiet_stack
    with _quiet_lock:
        _quiet_users += 1
        if _quiet_users == 1:
            stack = contextlib.ExitStack()
            devnull = stack.enter_context(open(os.devnull, "w"))
            stack.enter_context(contextlib.redirect_stderr(devnull))
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            _quiet_stack = stack
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users -= 1
            if _quiet_users == 0 and _quiet_stack is not None:
                _quiet_stack.close()
                _quiet_stack = None


class Lockstep:
    """One round of a small model: the native and the syncless run at once, in two threads that
    take turns every `slice_steps` steps over the window `start`..`stop`, so that both see the
    host in the same state (the H200 host's speed changes by up to 40% for a second or more at a
    time, for every process alike, which no amount of separate runs pairs away).

    The baton: the thread whose turn it is runs its steps; the other waits on a condition (its
    GIL released). Each turn lies between two device synchronizes and is timed (wall and the
    thread's CPU time); the GPU is idle when a turn starts, so no run pays for the other's
    kernels. The second run's setup starts once the first reached its first step, where the
    first waits until the second got there too (setting up a Trainer resets accelerate's process
    state, which a stepping Trainer reads); warm-up steps before `start` run concurrently and
    are not timed; both wait for each other at `start` (a gc.collect() and the
    pinning there) and after `stop`, so that neither's setup or teardown overlaps a timed turn.
    Syncless's delivery thread may run during a native turn (it competes for the GIL then): its
    CPU time in the window is measured and reported beside, and added to syncless's time in
    the conservative ratio.
    """

    ORDER = ("native", "syncless")

    def __init__(self, start: int, stop: int, slice_steps: int, cuda: bool,
                 first: str = "native", pin: "Pinning | None" = None, timeout: float = 120.0):
        self.start, self.stop, self.cuda, self.pin = start, stop, cuda, pin
        self.bounds = list(range(start, stop + 1, slice_steps)) + [stop + 1]
        self.cond = threading.Condition()
        self.first = first
        self.turn = first
        self.done: set = set()
        self.arrived: set = set()
        self.ready: dict = {v: threading.Event() for v in self.ORDER}
        self.tids: dict = {}
        self.failed: str | None = None
        self.deadline = time.monotonic() + timeout
        self.slice_ms: dict = {v: [] for v in self.ORDER}
        self.slice_cpu_ms: dict = {v: [] for v in self.ORDER}
        self.gc = {v: {"collections": [0, 0, 0], "ms": 0.0} for v in self.ORDER}
        self.delivery_cpu_ms = 0.0
        self._open: dict = {}
        self._gc_t0 = None
        self._timing = False

    @property
    def steps(self) -> int:
        return self.stop - self.start + 1

    def view(self, variant: str) -> "_LockstepView":
        return _LockstepView(self, variant)

    # ---- the baton --------------------------------------------------------------------------

    def _wait(self, until) -> None:
        """Wait on the condition (held) until `until()`; raise if the other run failed."""
        while not until():
            if self.failed:
                raise RuntimeError(f"lockstep: the other run failed: {self.failed}")
            if time.monotonic() > self.deadline:
                self.failed = "timed out"
                self.cond.notify_all()
                raise RuntimeError("lockstep: timed out waiting for the other run")
            self.cond.wait(0.5)

    def fail(self, why: str) -> None:
        with self.cond:
            self.failed = self.failed or why
            self.cond.notify_all()

    def _other(self, variant: str) -> str:
        return self.ORDER[1 - self.ORDER.index(variant)]

    def _mark(self) -> tuple:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter(), time.thread_time()

    def _close(self, variant: str) -> None:
        t0, c0, steps = self._open.pop(variant)
        t, c = self._mark()
        self.slice_ms[variant].append((t - t0) / steps * 1e3)
        self.slice_cpu_ms[variant].append((c - c0) / steps * 1e3)

    def _begin_slice(self, variant: str, k: int) -> None:
        steps = self.bounds[k + 1] - self.bounds[k]
        t, c = self._mark()
        self._open[variant] = (t, c, steps)

    def begin(self, variant: str, i: int) -> None:
        if i == 0:
            # The first run waits here until the second's setup is done: setting up a Trainer
            # resets accelerate's shared state (TrainingArguments._setup_devices), which a
            # Trainer that is stepping meanwhile reads.
            self.ready[variant].set()
            with self.cond:
                self.cond.notify_all()
                self._wait(lambda: all(e.is_set() for e in self.ready.values()))
        if i not in self.bounds[:-1]:
            return
        k = self.bounds.index(i)
        with self.cond:
            if k == 0:                       # both at the window: collect, pin, then go
                self.tids[variant] = threading.get_native_id()
                self.arrived.add(variant)
                self.cond.notify_all()
                self._wait(lambda: len(self.arrived) == 2)
                if variant == self.first:
                    gc.collect()
                    if self.pin is not None:
                        self.pin.apply(set(self.tids.values()))
                    self._delivery0 = _delivery_cpu()
                    gc.callbacks.append(self._gc_event)
                    self._timing = True
            else:                            # hand the baton over
                self._close(variant)
                self.turn = self._other(variant)
                self.cond.notify_all()
            self._wait(lambda: self.turn == variant or self._other(variant) in self.done)
        self._begin_slice(variant, k)

    def end(self, variant: str, i: int) -> None:
        if i != self.stop:
            return
        with self.cond:
            self._close(variant)
            self.done.add(variant)
            self.turn = self._other(variant)
            self.cond.notify_all()
            if len(self.done) == 2:
                self._timing = False
                gc.callbacks.remove(self._gc_event)
                self.delivery_cpu_ms = (_delivery_cpu() - self._delivery0) * 1e3
            self._wait(lambda: len(self.done) == 2)

    def _gc_event(self, phase: str, info: dict) -> None:
        if not self._timing:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            g = self.gc[self.turn]           # the collection stopped whoever had the turn
            g["ms"] += (time.perf_counter() - self._gc_t0) * 1e3
            g["collections"][info["generation"]] += 1
            self._gc_t0 = None

    # ---- a round ----------------------------------------------------------------------------

    def run(self, fits: dict) -> None:
        """fits: variant -> a callable taking this round's view for that variant. The first
        mover starts first; the other once the first reached its first step."""
        errors: dict = {}

        def go(variant: str) -> None:
            try:
                fits[variant](self.view(variant))
            except BaseException as exc:     # the other thread must not wait forever
                errors[variant] = exc
                self.fail(f"{variant}: {type(exc).__name__}: {exc}")
            finally:
                self.ready[variant].set()

        threads = {}
        for variant in (self.first, self._other(self.first)):
            threads[variant] = threading.Thread(target=go, args=(variant,),
                                                name=f"lockstep-{variant}")
            threads[variant].start()
            while not self.ready[variant].wait(0.5):
                if self.failed or time.monotonic() > self.deadline:
                    break
        for t in threads.values():
            t.join(max(1.0, self.deadline - time.monotonic()))
        if errors:
            raise next(iter(errors.values()))
        if any(t.is_alive() for t in threads.values()):
            raise RuntimeError("lockstep: a run did not finish in time")


class _LockstepView:
    """What a fit's hooks see of a Lockstep round: begin(i) / end(i), as a Window."""

    def __init__(self, lock: Lockstep, variant: str):
        self.lock, self.variant = lock, variant

    def begin(self, i: int) -> None:
        self.lock.begin(self.variant, i)

    def end(self, i: int) -> None:
        self.lock.end(self.variant, i)


def _delivery_cpu() -> float:
    """CPU seconds used so far by syncless's delivery threads (those alive now)."""
    total = 0.0
    for t in threading.enumerate():
        if t.name == "syncless-delivery" and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, AttributeError):
                pass
    return total


# ---- Lightning -------------------------------------------------------------------------------

LIGHTNING_MODELS = {
    "small": dict(width=256, depth=3, batch=64, precision="32-true"),
    "gpu-bound": dict(width=4096, depth=4, batch=8192, precision="bf16-mixed"),
}


def _lightning_fit(device: str, model_cfg: dict, syncless: bool, steps: int, window: Window,
                   log_every: int = 50, *, tmp: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger
    from syncless.lightning import SynclessLogging

    class MLP(pl.LightningModule):
        def __init__(self, width: int, depth: int):
            super().__init__()
            layers: list = []
            for _ in range(depth):
                layers += [nn.Linear(width, width), nn.ReLU()]
            self.net = nn.Sequential(*layers, nn.Linear(width, 10))

        def training_step(self, batch, i):
            x, y = batch
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits, y)
            acc = (logits.argmax(-1) == y).float().mean()
            self.log("loss", loss, prog_bar=True)
            self.log("acc", acc, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Hooks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            window.begin(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window.end(batch_idx)

    pl.seed_everything(0, verbose=False)
    w, b = model_cfg["width"], model_cfg["batch"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, b, w, generator=g).to(device)
    y = torch.randint(0, 10, (8, b), generator=g).to(device)
    batches = [(x[i % 8], y[i % 8]) for i in range(steps)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    # TQDM named: with rich installed Lightning would pick its rich bar, whose one global
    # console two fits at once (a lockstep round) cannot share.
    cbs = ([SynclessLogging()] if syncless else []) + [Hooks(), TQDMProgressBar()]
    logger = CSVLogger(tmp, name="csv")
    with torch.device(device):               # initialised on the device: fast, and seeded there
        model = MLP(w, model_cfg["depth"])
    trainer = pl.Trainer(max_steps=steps, callbacks=cbs, logger=logger,
                         log_every_n_steps=log_every, enable_checkpointing=False,
                         enable_model_summary=False, accelerator="gpu" if device == "cuda"
                         else "cpu", devices=1, precision=model_cfg["precision"])
    with _quiet():
        trainer.fit(model, loader)
    out = {"waits": 0}
    if syncless:
        out["waits"] = cbs[0].syncless.stats.waits
    path = os.path.join(trainer.logger.log_dir, "metrics.csv")
    out["values"] = []                       # no file when no step was a logging step
    if os.path.exists(path):
        with open(path) as f:
            out["values"] = list(csv.reader(f))
    return out


# ---- Hugging Face ----------------------------------------------------------------------------

HF_MODELS = {
    "small": dict(n_layer=2, n_embd=128, n_head=4, vocab=1000, seq=64, batch=8, bf16=False),
    "gpu-bound": dict(n_layer=8, n_embd=1024, n_head=16, vocab=8192, seq=512, batch=16,
                      bf16=True),
}


def _hf_train(device: str, model_cfg: dict, syncless: bool, steps: int, window: Window,
              extra: dict | None = None, *, tmp: str) -> dict:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback
    from syncless.hf import SynclessTrainer

    transformers.logging.set_verbosity_error()

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            window.begin(state.global_step)

        def on_step_end(self, args, state, control, **kw):
            window.end(state.global_step - 1)

    cfg = model_cfg
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (64, cfg["seq"]), generator=g).to(device)
    examples = [{"input_ids": ids[i % 64], "labels": ids[i % 64]}
                for i in range(cfg["batch"] * steps)]           # one epoch: no epoch end inside
    with torch.device(device):               # initialised on the device: fast, and seeded there
        model = GPT2LMHeadModel(GPT2Config(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"],
                                           n_head=cfg["n_head"], vocab_size=cfg["vocab"],
                                           n_positions=cfg["seq"]))
    args = transformers.TrainingArguments(
        output_dir=tmp, max_steps=steps, report_to=[],
        per_device_train_batch_size=cfg["batch"], save_strategy="no", seed=0,
        dataloader_pin_memory=False, bf16=cfg["bf16"], use_cpu=device == "cpu",
        **(extra or {}))
    cls = SynclessTrainer if syncless else Trainer
    trainer = cls(model=model, args=args, train_dataset=examples, callbacks=[Hooks()])
    with _quiet():
        trainer.train()
    out = {"waits": trainer.syncless.stats.waits if syncless else 0}
    out["values"] = [{k: v for k, v in d.items() if not k.endswith(("_runtime", "_per_second"))}
                     for d in trainer.state.log_history]
    return out


# ---- the suite -------------------------------------------------------------------------------

def _steps(quick: bool, model: str) -> tuple[int, int, int]:
    """(total steps, window start, window stop) of one run."""
    if model == "small":
        return (40, 10, 34) if quick else (200, 30, 179)
    return (24, 6, 19) if quick else (60, 10, 49)


def _lockstep_steps(quick: bool) -> tuple[int, int, int]:
    """(window start, window stop, steps per turn) of a lockstep round; the run ends with the
    window. 25-step turns: each is 75-200 ms on the H200, shorter than the host's slow spells."""
    return (10, 59, 10) if quick else (30, 329, 25)


def _timed_steps(quick: bool, model: str) -> tuple[int, int, int, int]:
    """(total steps, window start, window stop, pieces) of one timed run. The small models'
    window is 300 steps in 6 pieces of 50 (a multiple of HF's per-step copy, every 50 steps;
    Lightning's `log_every_n_steps`, 50, puts one logging step in each)."""
    if model == "small":
        return (70, 10, 69, 2) if quick else (330, 30, 329, 6)
    return (24, 6, 19, 1) if quick else (60, 10, 49, 1)


def _cells(values: list) -> list:
    """The logged values as one flat list: HF log_history dicts (sorted keys) or CSV rows."""
    out: list = []
    for r in values:
        out += [r[k] for k in sorted(r)] if isinstance(r, dict) else list(r)
    return out


def max_rel_diff(a: list, b: list) -> float | None:
    """The largest relative difference between two runs' numeric cells (0.0: identical); None
    when they do not line up (different rows, keys or non-numeric cells)."""
    ca, cb = _cells(a), _cells(b)
    if len(ca) != len(cb) or [sorted(r) for r in a if isinstance(r, dict)] != \
            [sorted(r) for r in b if isinstance(r, dict)]:
        return None
    worst = 0.0
    for x, y in zip(ca, cb):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except (TypeError, ValueError):
            return None
        if fx != fy:
            worst = max(worst, abs(fx - fy) / max(abs(fx), abs(fy), 1e-30))
    return worst


def run(device: str, quick: bool, rounds: int, results: dict, save, only: set | None = None,
        deterministic_check: bool = True, small_rounds: int | None = None,
        pin: "Pinning | None" = None, lockstep: bool = True) -> dict:
    """Fills results["sections"], calling save() after each one (a cut run keeps what it has).
    only: the frameworks to run ({"lightning", "hf"}; None: both); small_rounds: rounds for the
    small models (the noisiest: the host's speed is their step time), default `rounds`."""
    cuda = device == "cuda"
    results.setdefault("sections", [])
    rng = random.Random(0)
    frameworks = {
        "lightning": (LIGHTNING_MODELS, _lightning_fit, {"log_every_n_steps=1": dict(log_every=1)}),
        "hf": (HF_MODELS, _hf_train,
               {"logging_steps=1 + tokens": dict(extra=dict(
                   logging_steps=1, include_num_input_tokens_seen="all"))}),
    }
    for fw, (models, fit, extra_configs) in frameworks.items():
        if only is not None and fw not in only:
            continue
        for model_name, cfg in models.items():
            if device == "cpu" and model_name != "small":
                continue                      # the CPU run checks the logic, not GPU-bound steps
            total, start, stop = _steps(quick, model_name)
            section = {"framework": fw, "model": model_name, "config": cfg, "steps": total,
                       "window": [start, stop], "rounds": rounds, "counts": {}}
            print(f"{fw} / {model_name}: counting syncs and comparing values", flush=True)
            configs = {"default": {}}
            if model_name == "small":
                configs.update(extra_configs)
            for cname, ckw in configs.items():
                values = {}
                for variant in ("native", "syncless"):
                    win = Window(start, stop, count=True, cuda=cuda)
                    with tempfile.TemporaryDirectory() as tmp:
                        out = fit(device, cfg, variant == "syncless", total, win, tmp=tmp, **ckw)
                    values[variant] = out["values"]
                    top = sorted(win.syncs.sites.items(), key=lambda kv: -kv[1])[:4]
                    section["counts"].setdefault(cname, {})[variant] = {
                        "syncs_per_step": win.syncs.count / win.steps if cuda else None,
                        "sites": {k: v / win.steps for k, v in top}, "waits": out["waits"]}
                    print(f"  {cname:28s} {variant:9s} syncs/step "
                          f"{num(win.syncs.count / win.steps) if cuda else 'n/a (cpu)'}  "
                          f"{', '.join(f'{k} {v / win.steps:.2f}' for k, v in top)}", flush=True)
                same = values["native"] == values["syncless"]
                c = section["counts"][cname]
                if not same:
                    # Is the native run itself reproducible? (GPU kernels with atomics, e.g.
                    # attention backward, are not bitwise deterministic.) A second native run,
                    # and how far each pair is apart.
                    win = Window(start, stop, count=False, cuda=cuda)
                    with tempfile.TemporaryDirectory() as tmp:
                        again = fit(device, cfg, False, total, win, tmp=tmp, **ckw)["values"]
                    c["native_reproducible"] = again == values["native"]
                    c["max_rel_diff"] = {"native_vs_syncless": max_rel_diff(values["native"],
                                                                            values["syncless"]),
                                         "native_vs_native": max_rel_diff(values["native"], again)}
                    if not c["native_reproducible"] and deterministic_check and cuda:
                        with pin.released() if pin else contextlib.nullcontext():
                            c["deterministic"] = _deterministic_values(fw, model_name, cname,
                                                                       quick)
                n_values = len(_cells(values["native"]))
                c["identical"] = same
                c["values_compared"] = n_values
                print(f"  {cname:28s} logged values identical: {_same(c)} ({n_values} cells)",
                      flush=True)

            n_rounds = small_rounds if (small_rounds and model_name == "small") else rounds
            section["rounds"] = n_rounds
            if model_name == "small" and lockstep:
                _time_lockstep(section, device, cfg, fit, quick, n_rounds, rng, pin)
                if len(section["raw_ms"]["native"]) < 2:     # no lockstep: separate runs
                    failed = section.pop("errors", [])
                    _time_separate(section, device, cfg, fit, quick, n_rounds, rng, pin)
                    section["lockstep_errors"] = failed
            else:
                _time_separate(section, device, cfg, fit, quick, n_rounds, rng, pin)
            for variant in ("native", "syncless"):
                print(f"  {variant:9s} ms/step per round: "
                      f"{' '.join(f'{x:.3f}' for x in section['raw_ms'][variant])}", flush=True)
            print(f"  step time native {num(section['ms_per_step']['native']['median'])} ms, "
                  f"syncless {num(section['ms_per_step']['syncless']['median'])} ms, "
                  f"syncless/native {pct(section['ratio']['median'])} "
                  f"CI {pct_ci(section['ratio_ci'])} ({n_rounds} rounds); thread CPU "
                  f"{num(section['cpu_ms_per_step']['native']['median'])} -> "
                  f"{num(section['cpu_ms_per_step']['syncless']['median'])} ms, CI "
                  f"{pct_ci(section['cpu_ratio_ci'])}", flush=True)
            results["sections"].append(section)
            save()
    return results


def _ratios(section: dict, times: dict, cpu_ms: dict) -> None:
    ratios = paired_ratios(times, "syncless", "native")
    section["ms_per_step"] = {k: summarize(v) for k, v in times.items()}
    section["raw_ms"] = times
    section["ratio"] = summarize(ratios)
    section["ratio_ci"] = median_ci(ratios)
    # The training thread's CPU time per step: the host's work, sync waits included (CUDA spins
    # while it waits), time the thread did not run excluded.
    section["raw_cpu_ms"] = cpu_ms
    section["cpu_ms_per_step"] = {k: summarize(v) for k, v in cpu_ms.items()}
    section["cpu_ratio_ci"] = median_ci(paired_ratios(cpu_ms, "syncless", "native"))


def _time_separate(section: dict, device: str, cfg: dict, fit, quick: bool, n_rounds: int,
                   rng: random.Random, pin: "Pinning | None") -> None:
    """Interleaved rounds of separate runs, one Window each."""
    cuda = device == "cuda"
    t_total, t_start, t_stop, n_pieces = _timed_steps(quick, section["model"])
    cpu_ms: dict = {"native": [], "syncless": []}
    pieces_ms: dict = {"native": [], "syncless": []}
    window_ms: dict = {"native": [], "syncless": []}
    gc_seen: dict = {"native": [], "syncless": []}

    def timed(variant: str):
        def go() -> float:
            win = Window(t_start, t_stop, count=False, cuda=cuda, pieces=n_pieces, pin=pin)
            with tempfile.TemporaryDirectory() as tmp:
                fit(device, cfg, variant == "syncless", t_total, win, tmp=tmp)
            # A run's number: the median of its pieces (one piece: the window).
            cpu_ms[variant].append(statistics.median(win.piece_cpu_ms))
            pieces_ms[variant].append(win.piece_ms)
            window_ms[variant].append(win.seconds / win.steps * 1e3)
            gc_seen[variant].append(win.gc)
            return statistics.median(win.piece_ms)
        return go
    section["timing"] = {"method": "separate runs", "steps": t_total,
                         "window": [t_start, t_stop], "pieces": n_pieces,
                         "gc_collect_first": True, "pinning": pin.describe() if pin else None}
    times = interleave({"native": timed("native"), "syncless": timed("syncless")}, n_rounds,
                       rng)
    _ratios(section, times, cpu_ms)
    section["raw_piece_ms"] = pieces_ms
    section["raw_window_ms"] = window_ms      # the whole window's mean, stalls and all
    section["window_ratio"] = summarize(paired_ratios(window_ms, "syncless", "native"))
    section["window_ratio_ci"] = median_ci(paired_ratios(window_ms, "syncless", "native"))
    section["gc_in_window"] = gc_seen


def _time_lockstep(section: dict, device: str, cfg: dict, fit, quick: bool, n_rounds: int,
                   rng: random.Random, pin: "Pinning | None") -> None:
    """One Lockstep per round: native and syncless at once, taking turns."""
    cuda = device == "cuda"
    start, stop, slice_steps = _lockstep_steps(quick)
    times: dict = {"native": [], "syncless": []}
    cpu_ms: dict = {"native": [], "syncless": []}
    slices: dict = {"native": [], "syncless": []}
    gc_seen: dict = {"native": [], "syncless": []}
    delivery: list = []
    conservative: list = []
    for r in range(n_rounds):
        first = rng.choice(Lockstep.ORDER)
        lock = Lockstep(start, stop, slice_steps, cuda, first=first, pin=pin)
        with tempfile.TemporaryDirectory() as tmp:
            def fit_one(variant: str):
                return lambda view: fit(device, cfg, variant == "syncless", stop + 1, view,
                                        tmp=os.path.join(tmp, variant))
            try:
                lock.run({v: fit_one(v) for v in Lockstep.ORDER})
            except Exception as exc:         # the round is lost, not the benchmark
                print(f"  ! lockstep round {r} failed: {type(exc).__name__}: {exc}", flush=True)
                section.setdefault("errors", []).append(f"round {r}: {exc}")
                continue
        for v in Lockstep.ORDER:
            times[v].append(statistics.fmean(lock.slice_ms[v]))
            cpu_ms[v].append(statistics.fmean(lock.slice_cpu_ms[v]))
            slices[v].append(lock.slice_ms[v])
            gc_seen[v].append(lock.gc[v])
        per_step = lock.delivery_cpu_ms / lock.steps
        delivery.append(per_step)
        conservative.append((times["syncless"][-1] + per_step) / times["native"][-1])
    section["timing"] = {"method": "lockstep", "steps": stop + 1, "window": [start, stop],
                         "slice_steps": slice_steps, "gc_collect_first": True,
                         "pinning": pin.describe() if pin else None}
    _ratios(section, times, cpu_ms)
    section["raw_slice_ms"] = slices
    section["gc_in_window"] = gc_seen
    section["delivery_cpu_ms_per_step"] = delivery
    section["conservative_ratio"] = summarize(conservative)
    section["conservative_ratio_ci"] = median_ci(conservative)


def _deterministic_values(fw: str, model: str, cname: str, quick: bool) -> dict:
    """The value comparison again in a fresh process with torch's deterministic algorithms
    (CUBLAS_WORKSPACE_CONFIG must be set before cuBLAS starts, hence the process): native,
    native again, syncless."""
    import json
    import subprocess
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "benchmarks.frameworks", "--values-only",
           f"{fw}:{model}:{cname}"] + (["--quick"] if quick else [])
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("VALUES ")]
        if out.returncode != 0 or not line:
            return {"error": (out.stderr or out.stdout)[-400:]}
        return json.loads(line[-1][len("VALUES "):])
    except Exception as exc:                 # the benchmark goes on; the table says why
        return {"error": f"{type(exc).__name__}: {exc}"}


def values_only(spec: str, quick: bool) -> dict:
    """--values-only fw:model:config: native twice and syncless once under
    torch.use_deterministic_algorithms(True) with the math attention backend (flash and
    memory-efficient attention accumulate their backward with atomics); are they identical?
    An op with no deterministic version makes the strict mode raise: then warn_only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out: dict = {}
    for strict in (True, False):
        torch.use_deterministic_algorithms(True, warn_only=not strict)
        try:
            with sdpa_kernel(SDPBackend.MATH):
                out = _values_three_runs(spec, quick)
            out["strict"] = strict
            return out
        except RuntimeError as exc:
            if not strict or "determinis" not in str(exc):
                raise
            out["strict_error"] = str(exc)[:300]
    return out


def _values_three_runs(spec: str, quick: bool) -> dict:
    fw, model, cname = spec.split(":", 2)
    models, fit = (LIGHTNING_MODELS, _lightning_fit) if fw == "lightning" else (HF_MODELS,
                                                                                _hf_train)
    cfg = models[model]
    total, start, stop = _steps(quick, model)
    ckw: dict = {}
    if cname != "default":
        ckw = {"log_every_n_steps=1": dict(log_every=1),
               "logging_steps=1 + tokens": dict(extra=dict(
                   logging_steps=1, include_num_input_tokens_seen="all"))}[cname]
    runs = []
    for variant in (False, False, True):
        win = Window(start, stop, count=False, cuda=torch.cuda.is_available())
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(fit("cuda" if torch.cuda.is_available() else "cpu", cfg, variant, total,
                            win, tmp=tmp, **ckw)["values"])
    return {"native_reproducible": runs[0] == runs[1], "identical": runs[0] == runs[2],
            "max_rel_diff": {"native_vs_syncless": max_rel_diff(runs[0], runs[2]),
                             "native_vs_native": max_rel_diff(runs[0], runs[1])}}


def _same(c: dict) -> str:
    if c["identical"]:
        return "yes"
    det = c.get("deterministic") or {}
    if det.get("identical") and det.get("native_reproducible"):
        return "yes, deterministic mode (default mode: native runs differ from each other too)"
    if c.get("native_reproducible") is False:
        d = c.get("max_rel_diff") or {}
        return (f"no: two native runs differ too (max rel. diff native/native "
                f"{_sci(d.get('native_vs_native'))}, native/syncless "
                f"{_sci(d.get('native_vs_syncless'))})")
    d = c.get("max_rel_diff") or {}
    return f"NO (max rel. diff {_sci(d.get('native_vs_syncless'))})" if d else "NO"


def _sci(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def markdown(results: dict, env: dict) -> str:
    lines = [f"# Lightning and Hugging Face Trainer: native vs syncless ({env.get('gpu')})", "",
             f"torch {env.get('torch')}, lightning {env.get('lightning')}, transformers "
             f"{env.get('transformers')}; interleaved rounds (per row below); command: "
             f"`{env.get('command')}`", ""]
    rows = []
    for s in results["sections"]:
        c = s["counts"]["default"]
        ms = s["ms_per_step"]
        rounds = s.get("rounds", len(s.get("raw_ms", {}).get("native", [])))
        rows.append([s["framework"], s["model"], num(c["native"]["syncs_per_step"]),
                     num(c["syncless"]["syncs_per_step"]), num(ms["native"]["median"]),
                     num(ms["syncless"]["median"]), pct(s["ratio"]["median"]),
                     pct_ci(s["ratio_ci"]), rounds, _same(c)])
    lines.append(md_table(["framework", "model", "syncs/step native", "syncs/step syncless",
                           "ms/step native", "ms/step syncless", "syncless vs native",
                           "95% CI", "rounds", "values identical"], rows))
    lines += ["", "Step time, the same for both variants: a full `gc.collect()` before each timed "
                  "window, outside it (collections the steps cause run and are counted); threads "
                  f"pinned: {env.get('pinning') or 'no'}. Small models: lockstep rounds, the "
                  "native and the syncless run at once in two threads taking turns of a few "
                  "steps, each turn between two device synchronizes (so both see the host in the "
                  "same state); a round's ms/step is each run's mean over its turns. Otherwise "
                  "(GPU-bound models): separate interleaved runs, a run's ms/step the median of "
                  "its window's pieces, each between synchronizes (one piece: the window).", ""]
    rows = []
    for s in results["sections"]:
        t = s.get("timing")
        if not t:
            continue
        gcs = {v: sum(g["collections"][2] for g in s["gc_in_window"][v]) for v in
               ("native", "syncless")}
        gms = {v: summarize(g["ms"] for g in s["gc_in_window"][v])["max"] for v in
               ("native", "syncless")}
        if t.get("method") == "lockstep":
            how = f"lockstep, turns of {t['slice_steps']} steps"
            us = summarize(s["delivery_cpu_ms_per_step"])["median"]
            check = (f"{pct(s['conservative_ratio']['median'])} "
                     f"{pct_ci(s['conservative_ratio_ci'])} (delivery thread "
                     f"{num(us * 1e3 if us is not None else None)} µs/step added)")
        else:
            how = ("separate runs, one window" if t["pieces"] == 1 else
                   f"separate runs, {t['pieces']} pieces")
            check = (f"{pct(s['window_ratio']['median'])} {pct_ci(s['window_ratio_ci'])} "
                     "(whole windows' mean)")
        rows.append([s["framework"], s["model"], how, f"{t['window'][0]}-{t['window'][1]}",
                     f"{gcs['native']} / {gcs['syncless']}",
                     f"{num(gms['native'])} / {num(gms['syncless'])}", check])
    for s in results["sections"]:
        if s.get("lockstep_errors"):
            lines += [f"{s['framework']} {s['model']}: no lockstep round finished "
                      f"({s['lockstep_errors'][0][:160]}); timed by separate runs instead.", ""]
    if rows:
        lines.append(md_table(["framework", "model", "timing", "timed steps",
                               "gen-2 collections in windows (native / syncless)",
                               "most GC ms in one window", "cross-check: syncless vs native, "
                               "95% CI"], rows))
    kept: dict = {}
    for s in results["sections"]:
        if s.get("kept_from"):
            kept.setdefault(s["kept_from"], []).append(f"{s['framework']} {s['model']}")
    for src, names in kept.items():
        lines += ["", f"Rows kept from an earlier run ({src}): {', '.join(names)}."]
    rows = []
    for s in results["sections"]:
        cpu = s.get("cpu_ms_per_step")
        if cpu:
            ratio = summarize(paired_ratios(s["raw_cpu_ms"], "syncless", "native"))["median"]
            rows.append([s["framework"], s["model"], num(cpu["native"]["median"]),
                         num(cpu["syncless"]["median"]), pct(ratio), pct_ci(s["cpu_ratio_ci"])])
    if rows:
        lines += ["", "The training thread's CPU time per step in the same windows (the host's "
                      "work; a sync's wait spins, so it counts here too, while time the thread "
                      "was not running does not):",
                  "", md_table(["framework", "model", "CPU ms/step native",
                                "CPU ms/step syncless", "syncless vs native", "95% CI"], rows)]
    lines += ["", "Every-step logging (small model, counted window):", ""]
    rows = []
    for s in results["sections"]:
        for cname, c in s["counts"].items():
            if cname == "default":
                continue
            rows.append([s["framework"], cname, num(c["native"]["syncs_per_step"]),
                         num(c["syncless"]["syncs_per_step"]), c["syncless"]["waits"],
                         _same(c)])
    lines.append(md_table(["framework", "config", "syncs/step native", "syncs/step syncless",
                           "syncless waits", "values identical"], rows))
    lines += ["", "Where the native syncs are (per step, counted window):", ""]
    for s in results["sections"]:
        for cname, c in s["counts"].items():
            sites = ", ".join(f"`{k}` {v:.2f}" for k, v in c["native"]["sites"].items())
            lines.append(f"- {s['framework']} {s['model']} {cname}: {sites or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--small-rounds", type=int, default=None,
                   help="rounds for the small models (default 10; --rounds if given)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--only", choices=["lightning", "hf"], default=None,
                   help="run one framework's sections")
    p.add_argument("--keep", default=None, metavar="JSON",
                   help="with --only: keep the other framework's sections from this earlier "
                        "result file (the table says so, with their date and rounds)")
    p.add_argument("--separate", action="store_true",
                   help="time the small models by separate runs too (default: lockstep)")
    p.add_argument("--no-pin", action="store_true",
                   help="leave threads where the OS puts them (default: Pinning.choose())")
    p.add_argument("--values-only", default=None, metavar="FW:MODEL:CONFIG",
                   help=argparse.SUPPRESS)   # the deterministic re-check's child process
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rounds = args.rounds or (2 if args.quick else 7)     # 6: the fewest with a 95% CI
    small_rounds = args.small_rounds or (None if args.quick or args.rounds else 10)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.values_only:
        import json
        print("VALUES " + json.dumps(values_only(args.values_only, args.quick)), flush=True)
        return 0
    kept: list = []
    if args.keep:
        if args.only is None:
            p.error("--keep needs --only (the framework that is run again)")
        import json
        with open(args.keep) as f:
            earlier = json.load(f)
        e = earlier.get("env", {})
        for sec in earlier.get("sections", []):
            if sec["framework"] != args.only:
                sec["kept_from"] = (f"{e.get('time_utc', '?')}, git {e.get('git', '?')}, "
                                    f"{len(sec.get('raw_ms', {}).get('native', []))} rounds")
                kept.append(sec)
    t0 = time.time()
    import lightning
    import transformers
    env = env_info(torch.device(device), sys.argv[1:])
    env["command"] = "python -m benchmarks.frameworks " + " ".join(sys.argv[1:])
    env.update(lightning=lightning.__version__, transformers=transformers.__version__,
               rounds=rounds, quick=args.quick)
    results: dict = {"env": env, "sections": kept}
    os.makedirs(args.out, exist_ok=True)
    name = "frameworks" if device == "cuda" and not args.quick else f"frameworks-{device}" \
        + ("-quick" if args.quick else "")

    def save() -> str:
        env["seconds"] = round(time.time() - t0, 1)
        write_json(os.path.join(args.out, name + ".json"), results)
        text = markdown(results, env)
        with open(os.path.join(args.out, name + ".md"), "w") as f:
            f.write(text)
        return text

    pin = None if args.no_pin else Pinning.choose()
    env["pinning"] = pin.describe() if pin else None
    if pin is not None:
        pin.apply()
    run(device, args.quick, rounds, results, save, only={args.only} if args.only else None,
        small_rounds=small_rounds, pin=pin, lockstep=not args.separate)
    text = save()
    print()
    print(text)
    print(f"wrote {os.path.join(args.out, name)}.{{json,md}} in {env['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
