"""The delivery stage: everything that happens to a row after the training thread let it go.

One object per Logger. By default it owns a thread, and the training thread hands it work through
a queue (`window`: a pinned copy of the device ring to decode; `rows`: host rows; `attach`: a
value that becomes known later; `marker`: "tell me when you got here") and shares nothing else
with it but the window pool (its lock, and the lock the training thread waits on for a window).
With Logger(delivery="caller") there is no thread: the jobs wait in a list and the training
thread runs them itself at its next flush, those whose copies have landed (an event query, never
a wait), so no second thread takes the GIL from a host-bound loop. Either way the stage:

    decodes a window (waiting, GIL released, for its copy event)
    counts NaN/Inf per metric
    merges late values into the rows of their steps
    adds the GPU timestamps' metrics (gpu/step_ms, gpu/lag_ms) when asked
    updates `latest`, then gives every sink its own copy of the rows, in step order
    reports each failing sink once and goes on with the others, whatever it raised

Once late values are in use, rows of the newest step in a batch are held back until the next
batch (or a flush), so a late value for the step a flush just closed (the usual case: a timer
around a step that logs inside it) still joins that step's row instead of arriving as a row of
its own.
"""
from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

from ._torch import _C

__all__ = ["Delivery", "Pool", "Row", "RESERVED"]

_log = logging.getLogger("syncless")

_CAPTURED = _C.CAPTURED_TAG           # tag bit of a row written by a CUDA graph replay
GPU_STEP = "gpu/step_ms"
GPU_LAG = "gpu/lag_ms"
GPU_STEPS_KEPT = 8192                 # steps whose GPU clock Logger.gpu_steps() can return
RESERVED = frozenset({"step", "time"})       # every row's own fields in JSONL and CSV


class _RowFields(NamedTuple):
    step: int
    time: float
    values: dict


class Row(_RowFields):
    """One logged step as sinks receive it: plain Python floats, never tensors.

    `step`, `time` (host wall time of the log() call; for a row replayed by a CUDA graph, the
    time of the flush that found it) and `values` ({name: float}; absent metrics are absent).
    `gpu_ns` is the GPU's clock (%globaltimer, ns) when the gather kernel wrote the row, for a
    Logger(gpu_time=True); otherwise None.
    """
    gpu_ns: int | None = None
    late: bool = False               # True for a row made only of late values (see attach)

    def _with(self, values: dict) -> "Row":
        row = Row(self.step, self.time, values)
        if self.gpu_ns is not None:
            row.gpu_ns = self.gpu_ns
        return row


class Pool:
    """Pinned windows and their backpressure. The training thread counts the windows it handed
    over (`taken`, after the hand-over), the delivery thread those it is done with (`given`), each
    only its own, so an interrupt (Ctrl-C) landing anywhere in the training thread's code can at
    worst let one window too many out, never hold one back (a count lost that way would make a
    later flush wait forever). The training thread waits on a plain lock: interrupted, its
    acquire raises and changes nothing, where threading.Condition.wait can be interrupted
    between releasing its lock and taking it back."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()         # guards `free`, which both threads change
        self.free: list = []
        self.taken = 0
        self.given = 0
        self.waits = 0
        self._wake = threading.Lock()        # unlocked: a window came back since the last wait
        self._wake.acquire()

    def wait(self) -> None:
        """Training thread: wait (and count it) while `limit` windows are undelivered:
        backpressure, never loss. Nothing changes before it returns."""
        counted = False
        while self.taken - self.given >= self.limit:
            if not counted:
                self.waits += 1
                counted = True
            self._wake.acquire()

    def reuse(self) -> Any | None:
        """Training thread: a window the delivery thread is done with, or None."""
        with self.lock:
            return self.free.pop() if self.free else None

    def give(self, window: Any | None, keep: bool) -> None:
        """Delivery thread: a handed-over window (or batch of host rows) is done."""
        with self.lock:
            if keep and window is not None:
                self.free.append(window)
        self.given += 1
        if self._wake.locked():               # only this thread releases it: no race
            self._wake.release()


class _Late:
    __slots__ = ("step", "name", "resolve", "value")

    def __init__(self, step: int, name: str, resolve: Callable[[], float]):
        self.step, self.name, self.resolve = step, name, resolve
        self.value: float | None = None      # known without waiting (see _known)


def _known(late: _Late) -> bool:
    """Is the late value known without waiting? A resolve with a poll() method (a timer's
    reading) says so, None meaning not yet; any other resolve is taken to be known (it runs
    when its row is delivered, wherever that is)."""
    poll = getattr(late.resolve, "poll", None)
    if poll is None:
        return True
    try:
        v = poll()
    except Exception:
        return True                          # resolve() will raise it, and it is reported
    if v is None:
        return False
    late.value = v                           # checked like any attached value when merged
    return True


def _late_value(name: str, v: Any) -> float:
    """An attached fn's result, under log()'s rules (a real number or a one-element tensor;
    the same errors, naming the metric). A CUDA tensor is read here, where resolve() may wait."""
    if type(v) is float:
        return v
    device, values = _C.read_host_values({name: v})
    return float(v.item()) if values is None else values[name]


def _landed(job: tuple) -> bool:
    """Can this job run without waiting? (Host rows always; a window once its copy landed.)"""
    if job[0] != "window":
        return True
    try:
        return job[2].win.ready()
    except Exception:
        return True                          # the decode's wait raises it, and it is reported


class Delivery:
    """The delivery side of one Logger. Training-thread entry points: submit_window,
    submit_rows, attach, drain, stop, on_thread. Everything else runs on its thread."""

    def __init__(self, sinks: list, names: list[str], pool: Pool, gpu_time: bool,
                 caller: bool = False):
        self.sinks = sinks
        self.caller = caller                 # delivery="caller": no thread, see pump()
        self._pending: collections.deque = collections.deque()    # caller: jobs not yet run
        self._pumping = 0                    # caller: the thread inside pump() or finish()
        self._names = names                  # append-only, shared with the training thread
        self._pool = pool
        self._gpu_time = gpu_time
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ident = -1
        # Owned by the delivery thread (read by stats between drains).
        self.delivered = 0
        self.lost = 0
        self.nonfinite: dict[str, int] = {}
        self.sink_errors = 0
        self.latest: dict[str, float] = {}
        self.delivered_step = -1
        self._failed: set[int] = set()
        self._held: list[Row] = []           # rows of the newest step, waiting one batch
        self._hold = False                   # only once late values are in use
        self._late: list[_Late] = []
        self.late_errors = 0                 # attached values that failed or collided
        self._late_failed: set[str] = set()  # their names, each reported once
        self._last_gpu_ns: int | None = None
        self._gpu_offset: int | None = None  # min(gpu_ns - host_ns): the clocks' alignment
        # [step, gpu_ns, lag_ms] of the last row of each recent step (gpu_time only)
        self.gpu_steps: collections.deque = collections.deque(maxlen=GPU_STEPS_KEPT)

    # ---- the training thread's side -----------------------------------------------------------

    def submit_window(self, gen: Any, window: Any, flushed_at: float) -> None:
        self._put(("window", gen, window, flushed_at))

    def submit_rows(self, rows: list[Row]) -> None:
        self._put(("rows", rows))

    def attach(self, step: int, name: str, resolve: Callable[[], float]) -> None:
        self._put(("late", _Late(step, name, resolve)))

    # ---- delivery="caller": the training thread runs the jobs itself --------------------------
    # The Logger calls pump() at each flush and finish() at flush(wait=True) and close(), both
    # with signals deferred (as for a hand-over), and wait_landed() before them, interruptibly.

    def pump(self, wait: bool = False) -> None:
        """Run the pending jobs, oldest first: those whose copies have landed, or (wait) all of
        them. Inside a sink's call to its logger it does nothing: the next pump runs them."""
        if self._pumping:
            return
        self._pumping = threading.get_ident()
        try:
            pending = self._pending
            while pending and (wait or _landed(pending[0])):
                self._run(pending.popleft(), blocking=wait)
        finally:
            self._pumping = 0

    def wait_landed(self, count: int) -> None:
        """Wait (GIL released) for the copies of the `count` oldest pending jobs. Nothing
        changes, so an interrupt here loses nothing."""
        for job in list(self._pending)[:max(count, 0)]:
            if job[0] == "window":
                job[2].win.wait()

    def finish(self, upto: float, flush_sinks: bool = True) -> None:
        """After pump(wait=True): deliver held rows and late values of steps up to `upto`, then
        (flush_sinks) flush the sinks: a drain's end."""
        if self._pumping:
            return
        self._pumping = threading.get_ident()
        try:
            self._emit([], upto=upto)
            if flush_sinks:
                self.call_sinks("flush")
        finally:
            self._pumping = 0

    def pending(self) -> int:
        return len(self._pending)

    def drain(self, upto: float) -> None:
        """Return once everything submitted so far reached the sinks (held rows too, and late
        values of steps up to `upto`), then flush the sinks. On the delivery thread itself this
        would wait forever: refused."""
        if self._thread is None:
            return
        self.refuse_on_thread("flush() or close()")
        # A plain lock, released by the delivery thread: an interrupted wait changes nothing.
        done = threading.Lock()
        done.acquire()
        self._jobs.put(("marker", done, upto))
        done.acquire()
        self.call_sinks("flush")

    def stop(self) -> None:
        """Deliver what is left (the thread: the jobs queued before the stop; the caller: those
        pending, waiting for their copies), then end."""
        if self.caller:
            self.pump(wait=True)
            self.finish(math.inf, flush_sinks=False)
        if self._thread is not None:
            self._jobs.put(("stop",))
            self._thread.join()
            self._thread = None

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def refuse_on_thread(self, what: str) -> None:
        if self._pumping and self._pumping == threading.get_ident():
            raise RuntimeError(
                f"syncless.Logger: {what} was called from a sink's write(), while the logger "
                "delivered its rows on this thread (delivery='caller'); it would deliver inside "
                "its own delivery. Sinks must not call the logger they belong to (log to another "
                "Logger, or keep the values and log them from the training loop).")
        if threading.get_ident() == self._ident:
            raise RuntimeError(
                f"syncless.Logger: {what} was called from a sink's write(), on the logger's own "
                "delivery thread; it would wait for itself forever. Sinks must not call the "
                "logger they belong to (log to another Logger, or keep the values and log them "
                "from the training loop).")

    def forget(self) -> None:
        """In a forked child: drop the parent's thread, queue and state without touching them."""
        self._jobs = queue.SimpleQueue()
        self._pending = collections.deque()
        self._pumping = 0
        self._thread = None
        self._ident = -1
        self._held = []
        self._late = []

    def _put(self, job: tuple) -> None:
        if self.caller:
            if job[0] == "late":
                self._run(job)           # kept until its row comes (no copy to wait for)
            else:
                self._pending.append(job)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="syncless-delivery",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    # ---- the delivery thread ------------------------------------------------------------------

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        while True:
            job = self._jobs.get()
            kind = job[0]
            if kind == "stop":
                self._emit([], upto=math.inf)
                return
            if kind == "marker":
                self._emit([], upto=job[2])
                job[1].release()
                continue
            self._run(job)

    def _run(self, job: tuple, blocking: bool = True) -> None:
        """One job: keep a late value, or deliver host rows or a window's rows and give the
        window back. blocking False (a caller's pump): late values not known yet hold their
        rows back instead of being waited for."""
        kind = job[0]
        if kind == "late":
            self._late.append(job[1])
            self._hold = True
            return
        try:
            latest_done = False
            if kind == "rows":
                rows = job[1]
                for row in rows:
                    self._count_nonfinite(row.values)
            else:
                rows, latest_done = self._decode(*job[1:])
            self._emit(rows, upto=None, latest_done=latest_done, blocking=blocking)
        except Exception as exc:                  # delivery must never die silently
            _log.exception("syncless: delivery failed: %s", exc)
        except BaseException as exc:
            if self.caller:                       # the training thread's own: it goes on up
                raise
            _log.exception("syncless: delivery failed: %s", exc)
        finally:
            if kind == "window":
                gen, w = job[1], job[2]
                self._pool.give(w, keep=gen.current and w.nbytes >= gen.nbytes)
            else:
                self._pool.give(None, keep=False)

    def _count_nonfinite(self, values: dict) -> None:
        for name, v in values.items():
            if not math.isfinite(v):
                self.nonfinite[name] = self.nonfinite.get(name, 0) + 1

    def _decode(self, gen: Any, w: Any, flushed_at: float) -> tuple[list[Row], bool]:
        """The window's rows, and whether `latest` already holds their values."""
        w.win.wait()
        if not self._gpu_time:
            # The rows are made in C, `latest` updated there too (unless rows may be held back
            # or merged with late values): no Python work per row, under the GIL the training
            # thread needs. A graph replay's step was computed on the device; the host saw no
            # call, so its time is that of the flush that found the row.
            latest = None if self._hold else self.latest
            counter, rows = w.win.decode(gen.next_seq, self._names, self.nonfinite, Row,
                                         flushed_at, latest)
            self._count_lost(gen, counter)
            return rows, latest is not None
        counter, raw = w.win.decode(gen.next_seq, self._names, self.nonfinite)
        self._count_lost(gen, counter)
        rows = []
        for item in raw:
            tag, step, t, values = item[1], item[2], item[3], item[-1]
            row = Row(step, flushed_at if tag & _CAPTURED else t, values)
            row.gpu_ns = item[4]                 # an attribute costs each row a dict: opt-in
            self._gpu_metrics(row, captured=bool(tag & _CAPTURED))
            rows.append(row)
        return rows, False

    def _count_lost(self, gen: Any, counter: int) -> None:
        oldest = max(gen.next_seq, counter - gen.capacity)
        self.lost += oldest - gen.next_seq
        gen.next_seq = counter

    def _gpu_metrics(self, row: Row, captured: bool) -> None:
        gpu = row.gpu_ns
        if gpu is None:
            return
        if self._last_gpu_ns is not None:
            row.values[GPU_STEP] = (gpu - self._last_gpu_ns) / 1e6
        self._last_gpu_ns = gpu
        lag = None
        if not captured:                     # a replayed row has no host call time to compare
            # The smallest (GPU write - host call) seen is the clocks' offset plus the launch
            # latency: the moment the GPU was idle, waiting for this very call. Lag above it is
            # queue depth: ~0 when the CPU is the bottleneck, growing when the GPU is.
            d = gpu - int(row.time * 1e9)
            if self._gpu_offset is None or d < self._gpu_offset:
                self._gpu_offset = d
            lag = row.values[GPU_LAG] = (d - self._gpu_offset) / 1e6
        steps = self.gpu_steps
        if steps and steps[-1][0] == row.step:
            steps[-1][1:] = gpu, lag         # the step's last row stands for it
        else:
            steps.append([row.step, gpu, lag])

    def _merge_late(self, rows: list[Row], upto: float | None, blocking: bool) -> list[Row]:
        """Late values join the first row of their step; those whose step already went out
        (or, at a drain, has no row) become rows of their own at that step. Not blocking, the
        rows from the first step whose late value is not known yet are held back, with it."""
        if not self._late:
            return rows
        top = rows[-1].step if rows else -1
        if upto is not None:
            top = max(top, upto)
        due, keep = [], []
        for late in self._late:
            (due if late.step <= top else keep).append(late)
        if due and not blocking:
            waiting = [late.step for late in due if not _known(late)]
            if waiting:
                first = min(waiting)
                cut = next((i for i, row in enumerate(rows) if row.step >= first), len(rows))
                rows, self._held = rows[:cut], rows[cut:] + self._held
                keep += [late for late in due if late.step >= first]
                due = [late for late in due if late.step < first]
        self._late = keep
        if not due:
            return rows
        first: dict[int, Row] = {}
        for row in rows:
            first.setdefault(row.step, row)
        extra: dict[int, dict] = {}
        merged: set[tuple[int, str]] = set()       # late values added to a row here
        for late in due:
            try:
                v = late.value
                if v is None:                # may wait (a timer's end event)
                    v = late.resolve()
                v = _late_value(late.name, v)
            except BaseException as exc:
                self._late_failed_once(late, f"failed: {type(exc).__name__}: {exc}")
                continue
            row = first.get(late.step)
            if row is not None and late.name in row.values and \
                    (late.step, late.name) not in merged:
                self._late_failed_once(late, f"was not added: log() wrote {late.name!r} at "
                                       "that step, and its value is kept; attach under a name "
                                       "log() does not use")
                continue
            merged.add((late.step, late.name))
            values = row.values if row is not None else extra.setdefault(late.step, {})
            values[late.name] = values.get(late.name, 0.0) + v     # repeated durations add up
            if not math.isfinite(v):
                self.nonfinite[late.name] = self.nonfinite.get(late.name, 0) + 1
        if extra:
            now = time.time()
            for step, values in extra.items():
                row = Row(step, now, values)
                row.late = True
                rows.append(row)
            rows.sort(key=lambda r: r.step)        # stable: equal steps keep their order
        return rows

    def _late_failed_once(self, late: _Late, what: str) -> None:
        self.late_errors += 1
        if late.name not in self._late_failed:
            self._late_failed.add(late.name)
            _log.error("syncless: late value %r for step %d %s (reported once per name; "
                       "stats.late_errors counts them)", late.name, late.step, what)

    def _emit(self, rows: list[Row], upto: float | None, latest_done: bool = False,
              blocking: bool = True) -> None:
        """upto None: a batch (hold its newest step back); else a drain up to that step.
        latest_done: the decode already put these rows' values in `latest` (nothing held).
        blocking False: late values are not waited for (see _merge_late)."""
        rows = self._held + rows
        self._held = []
        if rows and upto is None and self._hold:
            top = rows[-1].step
            cut = len(rows)
            while cut and rows[cut - 1].step == top:
                cut -= 1
            rows, self._held = rows[:cut], rows[cut:]
        rows = self._merge_late(rows, upto, blocking)
        if not rows:
            return
        if not latest_done:
            latest = self.latest
            for row in rows:
                latest.update(row.values)
        self.delivered += sum(1 for row in rows if not row.late) if self._hold else len(rows)
        self.delivered_step = rows[-1].step
        sinks = self.sinks
        last = len(sinks) - 1
        for i, sink in enumerate(sinks):
            # Each sink but the last gets copies, so none can change what the others (or
            # `latest`, already updated) see; the last can have the rows themselves.
            batch = rows if i == last else [row._with(dict(row.values)) for row in rows]
            try:
                sink.write(batch)
            except BaseException as exc:        # KeyboardInterrupt raised by a sink included
                self._sink_failed(i, sink, exc)

    def _sink_failed(self, i: int, sink: Any, exc: BaseException) -> None:
        self.sink_errors += 1
        if i not in self._failed:
            self._failed.add(i)
            _log.error("syncless: sink %r raised %s: %s (reported once; the other sinks go on)",
                       sink, type(exc).__name__, exc)

    def call_sinks(self, method: str) -> None:
        """Every sink's optional flush() or close(), under the same error policy as write()."""
        for i, sink in enumerate(self.sinks):
            fn = getattr(sink, method, None)
            if fn is not None:
                try:
                    fn()
                except BaseException as exc:
                    self._sink_failed(i, sink, exc)
