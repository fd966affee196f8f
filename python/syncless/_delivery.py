"""The delivery stage: what happens to a row after the training thread let it go.

One `Delivery` per Logger, run by one of the two drivers of `_handover` (a thread of its own,
or the training thread at its flushes); it does not know which. For each job a driver hands it
(a `WindowJob`: a pinned copy of the device ring; a `RowsJob`: host rows; a `ReducedJob`: rows
reduced across ranks; a `LateJob`: a value that becomes known later) it:

    decodes a window (waiting, GIL released, for its copy event)
    counts NaN/Inf per metric and keeps `latest` (both in C: decode, _C.tally)
    merges late values into the rows of their steps
    adds the GPU timestamps' metrics (gpu/step_ms, gpu/lag_ms) when asked
    gives every sink its own copy of the rows, in step order
    reports each failing sink once and goes on with the others, whatever it raised
      (these two, the calls of the user's code, are its base class's: _sinkcalls.SinkCalls)

Once late values are in use, rows of the newest step in a batch are held back until the next
batch (or a drain), so a late value for the step a flush just closed (the usual case: a timer
around a step that logs inside it) still joins that step's row instead of arriving as a row of
its own.

Interrupts. Nothing here blocks a signal or changes a handler: the thread starts with its
creator's signal mask, and so does every process a sink starts. Python runs signal handlers
(Ctrl-C's KeyboardInterrupt, a preemption handler that flushes) only on the main thread, at a
function's start, after a call returns and at a loop's jump back; never inside a run of plain
assignments. So every change of state a delivery makes is computed first and then committed by
such a run (`_emit`), and a batch remembers how many sinks already have it: on the training
thread an interrupt anywhere leaves a state the next delivery resumes from, each row going to
each sink once. A handler may also deliver itself (its flush() or close()) while the delivery
it interrupted waits below it: each commit counts (`epoch`), and one planned before another
committed is dropped, so the interrupted delivery, when it goes on, repeats nothing. The user's
code (a sink's write(), flush() and close()) runs whole: on the main thread, where handlers run,
on a helper thread (`_whole`), claimed once and then made, whatever interrupts the wait for it.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import NamedTuple, Protocol, Union

from ._late import Late
from ._ring import DeviceRing, Window
from ._signals import by_signal
from ._torch import _C
from ._sinkcalls import SinkCalls
from .rows import Row

__all__ = ["Delivery", "DeliveryStats", "Job", "WindowJob", "RowsJob", "ReducedJob", "LateJob", "Exchange"]

_log = logging.getLogger("syncless")

GPU_STEP = "gpu/step_ms"
GPU_LAG = "gpu/lag_ms"
GPU_STEPS_KEPT = 8192                 # steps whose GPU clock Logger.gpu_steps() can return

# ---- the jobs a driver hands over (its own markers are its own) ------------------------------

class WindowJob(NamedTuple):
    """A copy of `ring` that lands in `window`, made at `flushed_at` (time.time(): the time of
    the rows a graph replay wrote), with the hand-over's ticket (see _handover.Pool)."""
    ring: DeviceRing
    window: Window
    flushed_at: float
    ticket: int


class RowsJob(NamedTuple):
    """Host rows: `rows` is the list the training thread handed over (the same list handed over
    again after an interrupt gives only the rows not delivered yet), `n` how many, `out` them or
    their reduction (reduce_on="device"), with the hand-over's ticket."""
    rows: list[Row]
    n: int
    out: list[Row]
    ticket: int


class ReducedJob(NamedTuple):
    """Rows reduced across ranks by the exchange (_ranks), delivered like host rows; no ticket:
    they hold no window."""
    rows: list[Row]


class LateJob(NamedTuple):
    """A value that becomes known later (attach(), timers), kept until its row comes."""
    late: Late


Job = Union[WindowJob, RowsJob, ReducedJob, LateJob]


class _Advance(NamedTuple):
    """Where a committed job's rows end: the ring's serial (-1: none), its counter and the rows
    lost, or the host-row list and how many of its rows."""
    ring: int = -1
    counter: int = 0
    lost: int = 0
    src: list[Row] | None = None
    n: int = 0


class _Decoded(NamedTuple):
    rows: list[Row]
    latest_done: bool                 # the decode already put their values in `latest`
    counter: int                      # the ring's write counter in the copy


class DeliveryStats(NamedTuple):
    """What the delivery side counted, for Logger.stats (each count read whole, no lock)."""
    delivered: int
    nonfinite: dict[str, int]        # a copy
    lost: int
    sink_errors: int
    late_errors: int
    missing: list[str]               # what close() stopped waiting for


class Exchange(Protocol):
    """The cross-rank exchange as the delivery side sees it (_ranks.Ranks)."""
    def wait_room(self) -> None: ...
    def put(self, rows: list[Row]) -> None: ...


class _GpuClock:
    """gpu/step_ms and gpu/lag_ms from each row's GPU timestamp (Logger(gpu_time=True))."""

    def __init__(self) -> None:
        self.last_ns: int | None = None
        self.offset: int | None = None       # min(gpu_ns - host_ns): the clocks' alignment
        # (step, gpu_ns, lag_ms) of the last row of each recent step
        self.steps: collections.deque[tuple[int, int, float | None]] = \
            collections.deque(maxlen=GPU_STEPS_KEPT)

    def add(self, row: Row, captured: bool) -> None:
        gpu = row.gpu_ns
        if gpu is None:
            return
        if self.last_ns is not None:
            row.values[GPU_STEP] = (gpu - self.last_ns) / 1e6
        self.last_ns = gpu
        lag = None
        if not captured:                     # a replayed row has no host call time to compare
            # The smallest (GPU write - host call) seen is the clocks' offset plus the launch
            # latency: the moment the GPU was idle, waiting for this very call. Lag above it is
            # queue depth: ~0 when the CPU is the bottleneck, growing when the GPU is.
            d = gpu - int(row.time * 1e9)
            if self.offset is None or d < self.offset:
                self.offset = d
            lag = row.values[GPU_LAG] = (d - self.offset) / 1e6
        steps = self.steps
        if steps and steps[-1][0] == row.step:
            steps[-1] = (row.step, gpu, lag)     # the step's last row stands for it
        else:
            steps.append((row.step, gpu, lag))

    def table(self) -> list[tuple[int, float | None, float | None]]:
        """[(step, gpu_ms, lag_ms)] of the recent steps (see Logger.gpu_steps)."""
        out: list[tuple[int, float | None, float | None]] = []
        prev: tuple[int, int] | None = None
        for step, ns, lag in list(self.steps):   # one C call: never torn
            gpu = None
            if prev is not None and step > prev[0]:
                gpu = (ns - prev[1]) / 1e6 / (step - prev[0])
            out.append((step, gpu, lag))
            prev = (step, ns)
        return out


class Delivery(SinkCalls):
    """Decode, merge, count and emit, for whichever driver runs it: `run(job)` a job (True if it
    committed it), `end(upto)` a drain, and SinkCalls' `write_batch()` to finish a batch an
    interrupt cut short, `call_sinks`, `close_sinks`. The Logger reads `sinks`, `latest`, `delivered_step`, `clock` and `stats()`."""

    def __init__(self, sinks: list[object], names: list[str], gpu_time: bool,
                 exchange: Exchange | None = None):
        super().__init__(sinks)              # sinks, whole, late and the sinks' state
        self._names = names                  # append-only, shared with the training thread
        self._gpu_time = gpu_time
        self.clock = _GpuClock()
        # Logger(reduce=...) on the host (_ranks.Ranks): this rank's rows go there instead of
        # to the sinks, and come back as "reduced" jobs.
        self.exchange = exchange
        # A thread that take_over() left behind commits nothing (see abandon). Re-entrant, as
        # is the thread driver's _claim: a signal handler's close() landing inside close()'s
        # own take_over() on the training thread would otherwise wait for its own thread.
        self._commit = threading.RLock()
        self._abandoned = -1
        # Changed only by whoever delivers, and only in _emit's commit.
        self.delivered = 0
        self.lost = 0
        self.nonfinite: dict[str, int] = {}
        self.delivered_step = -1
        self.latest: dict[str, float] = {}
        self.missing: list[str] = []         # late values close() stopped waiting for
        self._held: list[Row] = []           # rows of the newest step, waiting one batch
        self._src: list[Row] | None = None   # the host-row list delivered from last, and how
        self._src_done = 0                   # many of its rows (a repeated hand-over's are not)
        # The delivery side's read position in each device ring, by its serial: the first row
        # not delivered yet (where the next decode starts). Changed only in a commit.
        self._read: dict[int, int] = {}
        self.ran: Job | None = None          # the last job committed (see committed())
        self.epoch = 0                       # commits made (a plan older than the last is dropped)

    def forget(self) -> None:
        """In a forked child: drop the parent's unfinished state without touching it."""
        self._commit = threading.RLock()
        self._abandoned = -1
        self._held = []
        self.late.values = []
        self._batch = None
        self.whole.forget()

    def abandon(self, ident: int, grace: float) -> bool:
        """The thread `ident` (stuck) commits nothing from now on; the caller delivers in its
        place. False if a commit in progress did not end within `grace` seconds."""
        if not self._commit.acquire(timeout=grace):
            return False
        self._abandoned = ident
        self._commit.release()
        self.late.give_up_waiting()
        return True

    # ---- one job -----------------------------------------------------------------------------

    def run(self, job: Job, blocking: bool = True, epoch: int = -1) -> bool:
        """Keep a late value, or deliver host rows or a window's rows; True if this run committed
        the job (its window may be reused; `committed(job)` says so later too). blocking False:
        late values not known yet hold their rows back instead of being waited for. Nothing
        changes until _emit commits the job, so an interrupt before that leaves it to be run
        again. epoch: the commit count the caller saw when it found the job due (default: now);
        if a commit came since (a signal handler's delivery), the run is dropped."""
        if isinstance(job, LateJob):
            self.late.keep(job.late)
            return False
        if epoch < 0:
            epoch = self.epoch                   # before reading anything it plans from
        try:
            nonfinite = dict(self.nonfinite)
            if isinstance(job, WindowJob):
                exchange = self.exchange
                ring = job.ring
                rows, latest_done, counter = self._decode(job, nonfinite, epoch)
                if self.epoch != epoch:
                    return False                  # a handler delivered meanwhile: its plan
                start = self._read.get(ring.serial, 0)
                advance = _Advance(ring.serial, counter, max(start, counter - ring.capacity) - start)
            else:
                if isinstance(job, RowsJob):
                    exchange, src, n, out = self.exchange, job.rows, job.n, job.out
                else:                             # ReducedJob: back from the exchange
                    exchange, src, out = None, job.rows, job.rows
                    n = len(src)
                rows = out[self._src_done if src is self._src else 0:n]
                latest_done = False
                advance = _Advance(src=src, n=n)
                if exchange is None:
                    _C.tally(rows, None, nonfinite)
            if exchange is not None:
                return self._exchange(exchange, rows, job, advance, epoch)
            return self._emit(rows, None, latest_done, blocking, job, nonfinite, advance, epoch)
        except TimeoutError as exc:               # close()'s deadline: a copy never landed
            self.missing = self.missing + [f"the rows of a window ({exc})"]
            self.ran = job
            return True
        except Exception as exc:                  # delivery must never die silently
            _log.exception("syncless: delivery failed: %s", exc)
            self.ran = job                        # dropped: its window goes back
            return True
        except BaseException as exc:
            if by_signal(exc):                    # the training thread's own: it goes on up
                raise
            _log.exception("syncless: delivery failed: %s", exc)
            self.ran = job
            return True

    def stats(self) -> DeliveryStats:
        """The counts, for Logger.stats and close()'s report."""
        return DeliveryStats(self.delivered, dict(self.nonfinite), self.lost, self.sink_errors,
                             self.late.errors, self.missing)

    def committed(self, job: Job) -> bool:
        """Was `job` the last job committed? (A driver asks after an interrupt came out of the
        sinks' calls that follow a commit, and before running a job a handler may have run.)"""
        return self.ran is job

    def end(self, upto: float) -> None:
        """A drain: deliver held rows, and late values of steps up to `upto`."""
        self._emit([], upto=upto)

    def wait_copy(self, w: Window) -> None:
        """Wait for a window's copy (GIL released); after close()'s deadline, not at all."""
        deadline = self.late.deadline
        if deadline is None:
            w.win.wait()
            return
        while not w.win.ready():
            if time.monotonic() >= deadline:
                raise TimeoutError("a device-to-host copy of the logger's window did not "
                                   "complete within close()'s timeout (the stream is stuck)")
            time.sleep(0.001)

    def _decode(self, job: WindowJob, nonfinite: dict[str, int], epoch: int = -1) -> _Decoded:
        """The window's rows, whether `latest` already holds their values, and the counter."""
        self.wait_copy(job.window)
        start = self._read.get(job.ring.serial, 0)
        if epoch >= 0 and self.epoch != epoch:
            return _Decoded([], False, start)    # planned too late (see run): not decoded
        # The rows are made in C, `latest` updated there too (unless rows may be held back, be
        # merged with late values, gain GPU-clock metrics or be reduced across ranks): no Python
        # work per row, under the GIL the training thread needs. A graph replay's row takes
        # flushed_at as its time.
        latest = None if self.late.hold or self._gpu_time or self.exchange is not None \
            else self.latest
        clock: list[tuple[int, bool]] | None = [] if self._gpu_time else None
        counter, rows = job.window.win.decode(start, self._names, nonfinite, Row,
                                              job.flushed_at, latest, clock)
        for row, (gpu_ns, replayed) in zip(rows, clock or ()):
            row.gpu_ns = gpu_ns                  # an attribute costs each row a dict: opt-in
            self.clock.add(row, captured=replayed)
        return _Decoded(rows, latest is not None, counter)

    def _exchange(self, exchange: Exchange, rows: list[Row], job: Job, advance: _Advance,
                  epoch: int) -> bool:
        """This rank's rows go to the cross-rank exchange (reduce_on="host"), which hands them
        back reduced; the job is done here (its window may be reused). Committed like _emit."""
        exchange.wait_room()                 # the bound on rows waiting; changes nothing
        ring, counter, lost, src, n = advance
        with self._commit:
            if self._abandoned == threading.get_ident() or self.epoch != epoch:
                return False                   # as in _emit's commit
            self.epoch = epoch + 1
            if ring >= 0:
                self._read[ring] = counter
            if src is not None:
                self._src = src
                self._src_done = n
            self.lost += lost
            self.ran = job
            exchange.put(rows)
        return True

    # ---- the commit --------------------------------------------------------------------------

    def _emit(self, rows: list[Row], upto: float | None, latest_done: bool = False,
              blocking: bool = True, job: Job | None = None,
              nonfinite: dict[str, int] | None = None, advance: _Advance = _Advance(),
              epoch: int = -1) -> bool:
        """upto None: a batch (hold its newest step back); else a drain up to that step.
        latest_done: the decode already put these rows' values in `latest` (nothing held).
        blocking False: late values are not waited for (see LateValues.merge). job, nonfinite
        and advance: the job these rows come from, the NaN/Inf counts with them, and where its
        rows end (a ring's counter and rows lost, or a host-row list and how many). epoch:
        `epoch` when the plan began (its reads): a commit made since (a signal handler's
        delivery) drops this one. True if this call committed."""
        if epoch < 0:
            epoch = self.epoch
        if nonfinite is None:
            nonfinite = dict(self.nonfinite)
        late = self.late
        rows = self._held + rows
        held: list[Row] = []
        if rows and upto is None and late.hold:
            top = rows[-1].step
            cut = len(rows)
            while cut and rows[cut - 1].step == top:
                cut -= 1
            rows, held = rows[:cut], rows[cut:]
        rows, held_late, keep, missing = late.merge(rows, upto, blocking, nonfinite)
        held = held_late + held
        delivered = sum(1 for row in rows if not row.late) if late.hold else len(rows)
        if self.epoch != epoch:
            return False                           # stale: see the commit
        if rows and not latest_done:
            _C.tally(rows, self.latest, None)      # the same values again if planned again
        missing = self.missing + missing if missing else self.missing
        ring, counter, lost, src, n = advance
        with self._commit:
            if self._abandoned == threading.get_ident():
                return False                       # take_over() delivers in this one's place
            if self.epoch != epoch:
                return False                       # a signal handler's delivery committed
            # The commit: plain assignments, no call among them, so no signal handler can run
            # between them (see the module's docstring).
            self.epoch = epoch + 1
            if ring >= 0:
                self._read[ring] = counter
            if src is not None:
                self._src = src
                self._src_done = n
            self.lost += lost
            self.nonfinite = nonfinite
            self._held = held
            late.values = keep
            self.missing = missing
            self.delivered += delivered
            if rows:
                self.delivered_step = rows[-1].step
                self._batch = [rows, self.sinks, 0]
            if job is not None:
                self.ran = job
            self.write_batch()
        return True
