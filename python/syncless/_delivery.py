"""The delivery stage: what happens to a row after the training thread let it go.

One `Delivery` per Logger, run by one of the two drivers of `_handover` (a thread of its own,
or the training thread at its flushes); it does not know which. For each job a driver hands it
(`window`: a pinned copy of the device ring; `rows`: host rows; `late`: a value that becomes
known later) it:

    decodes a window (waiting, GIL released, for its copy event)
    counts NaN/Inf per metric and keeps `latest` (both in C: decode, _C.tally)
    merges late values into the rows of their steps
    adds the GPU timestamps' metrics (gpu/step_ms, gpu/lag_ms) when asked
    gives every sink its own copy of the rows, in step order
    reports each failing sink once and goes on with the others, whatever it raised

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
import functools
import logging
import threading
import time
from typing import Any, Callable, Protocol

from ._late import LateValues
from ._signals import by_signal
from ._torch import _C
from ._whole import Whole, on_main
from .rows import Row

__all__ = ["Delivery", "Job", "Source"]

_log = logging.getLogger("syncless")

GPU_STEP = "gpu/step_ms"
GPU_LAG = "gpu/lag_ms"
GPU_STEPS_KEPT = 8192                 # steps whose GPU clock Logger.gpu_steps() can return

# A job: ("window", Source, window, flushed_at, ticket), ("rows", host rows, n, rows to
# deliver, ticket), ("reduced", rows, n, rows, 0) (rows reduced across ranks, see _ranks) or
# ("late", _late.Late); the drivers add their own ("marker", "stop").
Job = tuple[Any, ...]


class Source(Protocol):
    """A device ring as delivery sees it (logger._Generation)."""
    next_seq: int                     # the next row to deliver; changed only by _emit's commit
    capacity: int


class _GpuClock:
    """gpu/step_ms and gpu/lag_ms from each row's GPU timestamp (Logger(gpu_time=True))."""

    def __init__(self) -> None:
        self.last_ns: int | None = None
        self.offset: int | None = None       # min(gpu_ns - host_ns): the clocks' alignment
        # [step, gpu_ns, lag_ms] of the last row of each recent step
        self.steps: collections.deque[list[Any]] = collections.deque(maxlen=GPU_STEPS_KEPT)

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
            steps[-1][1:] = gpu, lag         # the step's last row stands for it
        else:
            steps.append([row.step, gpu, lag])

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


class Delivery:
    """Decode, merge, count and emit, for whichever driver runs it: `run(job)` a job, `end(upto)`
    a drain, `write_batch()` to finish a batch an interrupt cut short, `call_sinks`,
    `close_sinks`. Read by the Logger: sinks, latest, delivered, delivered_step, nonfinite,
    lost, sink_errors, missing, late.errors, clock."""

    def __init__(self, sinks: list[Any], names: list[str], gpu_time: bool):
        self.sinks = sinks
        self._names = names                  # append-only, shared with the training thread
        self._gpu_time = gpu_time
        self.whole = Whole()                 # runs the sinks' calls made on the main thread
        self.late = LateValues(self.whole)
        self.clock = _GpuClock()
        # Logger(reduce=...) on the host (_ranks.Ranks): this rank's rows go there instead of
        # to the sinks, and come back as "reduced" jobs.
        self.exchange: Any = None
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
        self.ran: Job | None = None          # the last job committed
        self.epoch = 0                       # commits made (a plan older than the last is dropped)
        self._batch: list[Any] | None = None  # [rows, sinks, how many of them have the rows]
        self.sink_errors = 0
        self._failed: set[int] = set()
        self.raised: BaseException | None = None   # the first BaseException a sink raised
        self._closed_sinks = [0]             # sinks closed: close_sinks() is resumable
        self._closing = 0                    # the thread inside a sink's close() (not main)

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

    def run(self, job: Job, blocking: bool = True, epoch: int = -1) -> None:
        """Keep a late value, or deliver host rows or a window's rows (then `ran` is the job:
        its window may be reused). blocking False: late values not known yet hold their rows
        back instead of being waited for. Nothing changes until _emit commits the job, so an
        interrupt before that leaves it to be run again. epoch: the commit count the caller saw
        when it found the job due (default: now); if a commit came since (a signal handler's
        delivery), the run is dropped."""
        kind = job[0]
        if kind == "late":
            self.late.keep(job[1])
            return
        if epoch < 0:
            epoch = self.epoch                   # before reading anything it plans from
        try:
            nonfinite = dict(self.nonfinite)
            exchange = self.exchange if kind != "reduced" else None
            if kind == "rows" or kind == "reduced":
                src, n, out = job[1], job[2], job[3]
                rows = out[self._src_done if src is self._src else 0:n]
                if exchange is not None:
                    self._exchange(exchange, rows, job, (None, 0, 0, src, n), epoch)
                    return
                _C.tally(rows, None, nonfinite)
                self._emit(rows, None, False, blocking, job, nonfinite, (None, 0, 0, src, n),
                           epoch)
            else:
                gen, w, flushed_at = job[1], job[2], job[3]
                rows, latest_done, counter = self._decode(gen, w, flushed_at, nonfinite, epoch)
                if self.epoch != epoch:
                    return                        # a handler delivered meanwhile: its plan
                lost = max(gen.next_seq, counter - gen.capacity) - gen.next_seq
                if exchange is not None:
                    self._exchange(exchange, rows, job, (gen, counter, lost, None, 0), epoch)
                    return
                self._emit(rows, None, latest_done, blocking, job, nonfinite,
                           (gen, counter, lost, None, 0), epoch)
        except TimeoutError as exc:               # close()'s deadline: a copy never landed
            self.missing = self.missing + [f"the rows of a window ({exc})"]
            self.ran = job
        except Exception as exc:                  # delivery must never die silently
            _log.exception("syncless: delivery failed: %s", exc)
            self.ran = job                        # dropped: its window goes back
        except BaseException as exc:
            if by_signal(exc):                    # the training thread's own: it goes on up
                raise
            _log.exception("syncless: delivery failed: %s", exc)
            self.ran = job

    def end(self, upto: float) -> None:
        """A drain: deliver held rows, and late values of steps up to `upto`."""
        self._emit([], upto=upto)

    def wait_copy(self, w: Any) -> None:
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

    def _decode(self, gen: Source, w: Any, flushed_at: float, nonfinite: dict[str, int],
                epoch: int = -1) -> tuple[list[Row], bool, int]:
        """The window's rows, whether `latest` already holds their values, and the counter."""
        self.wait_copy(w)
        if epoch >= 0 and self.epoch != epoch:
            return [], False, gen.next_seq       # planned too late (see run): not decoded
        # The rows are made in C, `latest` updated there too (unless rows may be held back, be
        # merged with late values, gain GPU-clock metrics or be reduced across ranks): no Python
        # work per row, under the GIL the training thread needs. A graph replay's row takes
        # flushed_at as its time.
        latest = None if self.late.hold or self._gpu_time or self.exchange is not None \
            else self.latest
        clock: list[tuple[int, bool]] | None = [] if self._gpu_time else None
        counter, rows = w.win.decode(gen.next_seq, self._names, nonfinite, Row, flushed_at,
                                     latest, clock)
        for row, (gpu_ns, replayed) in zip(rows, clock or ()):
            row.gpu_ns = gpu_ns                  # an attribute costs each row a dict: opt-in
            self.clock.add(row, captured=replayed)
        return rows, latest is not None, counter

    def _exchange(self, exchange: Any, rows: list[Row], job: Job,
                  done: tuple[Any, int, int, Any, int], epoch: int) -> None:
        """This rank's rows go to the cross-rank exchange (reduce_on="host"), which hands them
        back reduced; the job is done here (its window may be reused). Committed like _emit."""
        exchange.wait_room()                 # the bound on rows waiting; changes nothing
        gen, counter, lost, src, n = done
        with self._commit:
            if self._abandoned == threading.get_ident() or self.epoch != epoch:
                return                         # as in _emit's commit
            self.epoch = epoch + 1
            if gen is not None:
                gen.next_seq = counter
            if src is not None:
                self._src = src
                self._src_done = n
            self.lost += lost
            self.ran = job
            exchange.put(rows)

    # ---- the commit --------------------------------------------------------------------------

    def _emit(self, rows: list[Row], upto: float | None, latest_done: bool = False,
              blocking: bool = True, job: Job | None = None,
              nonfinite: dict[str, int] | None = None,
              done: tuple[Any, int, int, Any, int] = (None, 0, 0, None, 0),
              epoch: int = -1) -> None:
        """upto None: a batch (hold its newest step back); else a drain up to that step.
        latest_done: the decode already put these rows' values in `latest` (nothing held).
        blocking False: late values are not waited for (see LateValues.merge). job, nonfinite
        and done: the job these rows come from, the NaN/Inf counts with them, and where its rows
        end (a generation's counter and rows lost, or a host-row list and how many). epoch:
        `epoch` when the plan began (its reads): a commit made since (a signal handler's
        delivery) drops this one."""
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
            return                                 # stale: see the commit
        if rows and not latest_done:
            _C.tally(rows, self.latest, None)      # the same values again if planned again
        missing = self.missing + missing if missing else self.missing
        gen, counter, lost, src, n = done
        with self._commit:
            if self._abandoned == threading.get_ident():
                return                             # take_over() delivers in this one's place
            if self.epoch != epoch:
                return                             # a signal handler's delivery committed
            # The commit: plain assignments, no call among them, so no signal handler can run
            # between them (see the module's docstring).
            self.epoch = epoch + 1
            if gen is not None:
                gen.next_seq = counter
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

    # ---- the sinks ---------------------------------------------------------------------------

    def write_batch(self) -> None:
        """Give the committed batch to every sink that does not have it yet, in order. Each
        sink but the last gets copies, so none can change what the others (or `latest`) see.
        On the main thread each write() runs whole (see `_once`): an interrupt stops the wait
        for it, never the write, and the next delivery goes on from the next sink."""
        main = on_main()
        while True:
            batch = self._batch
            if batch is None:
                return
            rows, sinks, i = batch
            last = len(sinks) - 1
            if i > last:
                if self._batch is batch:         # no call since the read: not a newer batch
                    self._batch = None
                continue
            sink = sinks[i]
            data = rows if i == last else [row._with(dict(row.values)) for row in rows]
            call = functools.partial(self._call, i, sink, sink.write, data, batch, 2)
            if main:
                self._once(call, batch, 2, i, sink, "write()")
            else:
                call()

    def _call(self, i: int, sink: Any, fn: Callable[..., Any], arg: Any, box: list[Any],
              k: int) -> None:
        """fn(arg) or fn() for the sink at `i`, its error reported; then box[k] says it is done."""
        try:
            if arg is None:
                fn()
            else:
                fn(arg)
        except BaseException as exc:     # whatever a sink raises (here, never a handler's)
            self._sink_failed(i, sink, exc)
        box[k] = i + 1

    def _once(self, call: Callable[[], None], box: list[Any], k: int, i: int, sink: Any,
              what: str) -> None:
        """On the main thread: make `call` on the helper if box[k] is still i, and wait for it.
        The check and the claim have no call between them, so a signal handler landing before
        the claim finds the call not made (and may make it), and one after it finds the call in
        flight (and waits for it): made once. After close()'s deadline a call that did not
        return within a second more is left to its thread, reported, and counted as made."""
        w = self.whole
        deadline = self.late.deadline
        w.ready()
        while True:
            stuck = w.idle(deadline)
            if stuck is not None:
                self._gave_up(w, stuck)
                w.ready()
                continue
            job = w.job(call, box, k, i, f"sink {sink!r}'s {what}")
            if box[k] == i and w.busy is None:   # the claim
                w.busy = job
                w.gate.release()
            if w.wait(job, deadline):
                return
            self._gave_up(w, job)
            return

    def _gave_up(self, w: Whole, job: list[Any]) -> None:
        w.abandon(job)
        self.sink_errors += 1
        _log.error("syncless: close() gave up on %s: it did not return within close()'s "
                   "timeout; it was left running", job[6])

    def _sink_failed(self, i: int, sink: Any, exc: BaseException) -> None:
        self.sink_errors += 1
        again = ""
        if not isinstance(exc, Exception):       # KeyboardInterrupt, SystemExit: the user's
            again = "; the next flush() or close() raises it again"
            if self.raised is None:
                self.raised = exc
        if i not in self._failed:
            self._failed.add(i)
            _log.error("syncless: sink %r raised %s: %s (reported once; the other sinks go on%s)",
                       sink, type(exc).__name__, exc, again)

    def pop_raised(self) -> BaseException | None:
        """The first KeyboardInterrupt or other BaseException a sink or an attach() fn raised
        since the last call (reported when it came), for the training thread to raise."""
        exc = self.raised or self.late.raised
        self.raised = self.late.raised = None
        return exc

    def call_sinks(self, method: str) -> None:
        """Every sink's optional flush(), under the same error policy as write() (on the main
        thread, each whole; an interrupt goes on up, the call goes on)."""
        main = on_main()
        for i, sink in enumerate(self.sinks):
            fn = getattr(sink, method, None)
            if fn is not None:
                box = [i]
                call = functools.partial(self._call, i, sink, fn, None, box, 0)
                if main:
                    self._once(call, box, 0, i, sink, f"{method}()")
                else:
                    call()

    def close_sinks(self) -> None:
        """Every sink's close(), once; an interrupt leaves the rest to the next call (on the
        main thread, the close() in flight goes on: the next call waits for it)."""
        ident = threading.get_ident()
        if self._closing == ident:
            raise RuntimeError(
                "syncless.Logger: close() was called from a sink's close(); sinks must not call "
                "the logger they belong to")
        main = on_main()
        sinks, done = self.sinks, self._closed_sinks
        while True:
            i = done[0]                          # read once: a handler may close sinks too
            if i >= len(sinks):
                break
            fn = getattr(sinks[i], "close", None)
            if fn is None:
                if done[0] == i:
                    done[0] = i + 1
                continue
            call = functools.partial(self._call, i, sinks[i], fn, None, done, 0)
            if main:
                self._once(call, done, 0, i, sinks[i], "close()")
                continue
            self._closing = ident
            try:
                call()
            finally:
                self._closing = 0
