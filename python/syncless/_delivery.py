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

Interrupts. Nothing here blocks a signal or changes a handler: the thread starts with its
creator's signal mask, and so does every process a sink starts. Python runs signal handlers
(Ctrl-C's KeyboardInterrupt, a preemption handler that flushes) only on the main thread, at a
function's start, after a call returns and at a loop's jump back; never inside a run of plain
assignments. So every change of state a delivery makes is computed first and then committed by
such a run (`_emit`), and a batch remembers how many sinks already have it: with
delivery="caller" an interrupt anywhere leaves a state the next pump resumes from, each row
going to each sink once. A sink whose write() an interrupt cut short keeps what it wrote (it
was not waited for; see `_entered`).
"""
from __future__ import annotations

import collections
import dis
import logging
import math
import queue
import signal
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
    """Pinned windows and their backpressure. Every hand-over carries a ticket, one more than the
    last the training thread counted (`taken`); the delivery side sets `given` to the ticket of
    each job it is done with. A hand-over an interrupt cut between its submit and its count is
    submitted again with the same ticket, so the counts never drift: an interrupt can at worst
    let one window too many out for a moment, never hold one back (a count lost that way would
    make a later flush wait forever). The training thread waits on a plain lock, re-checking:
    interrupted, its acquire raises and changes nothing, and a signal handler that flushes
    meanwhile cannot leave it waiting for a wake-up that was already taken.

    The free windows are a dict keyed by id(window), taken and given back by one C call each
    (popitem, a store): atomic against the other thread and against a signal handler, with no
    lock. A lock taken on the training thread would deadlock a handler that flushes while the
    thread holds it (seen on the H200: a caller-delivery flush() landing inside reuse())."""

    def __init__(self, limit: int):
        self.limit = limit
        self.free: dict = {}                 # {id(window): window}; see the docstring
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
            self._wake.acquire(timeout=0.05)

    def reuse(self) -> Any | None:
        """Training thread: a window the delivery thread is done with, or None."""
        try:
            return self.free.popitem()[1]
        except KeyError:
            return None

    def give(self, window: Any | None, keep: bool, ticket: int) -> None:
        """Delivery side: the hand-over with this ticket is done (idempotent)."""
        if keep and window is not None:
            self.free[id(window)] = window       # given twice, kept once
        if ticket > self.given:
            self.given = ticket
        if self._wake.locked():
            try:
                self._wake.release()
            except RuntimeError:                 # released meanwhile by another give()
                pass


class _Late:
    __slots__ = ("step", "name", "resolve", "value", "missing", "runner")

    def __init__(self, step: int, name: str, resolve: Callable[[], float]):
        self.step, self.name, self.resolve = step, name, resolve
        self.value: float | None = None      # known without waiting (see _known), or resolved
        self.missing = False                 # close() gave up waiting for it
        self.runner: tuple | None = None     # (thread, result box) of a bounded resolve


def _known(late: _Late) -> bool:
    """Is the late value known without waiting? A resolve with a poll() method (a timer's
    reading) says so, None meaning not yet; any other resolve is taken to be known (it runs
    when its row is delivered, wherever that is)."""
    if late.value is not None or late.missing:
        return True
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


def _locked() -> Any:
    lock = threading.Lock()
    lock.acquire()
    return lock


def _acquire(lock: Any, deadline: float | None) -> bool:
    """Wait for a lock another thread releases, until `deadline` (time.monotonic) at most.
    A plain lock: an interrupt raises out of the wait and changes nothing."""
    if deadline is None:
        lock.acquire()
        return True
    return lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))


_RUNNERS = threading.RLock()                     # starts the threads of bounded resolves
_RESUME = dis.opmap.get("RESUME", -1)             # a function's first instruction (3.11+)
_RAISES = frozenset(dis.opmap[n] for n in ("RAISE_VARARGS", "RERAISE") if n in dis.opmap)


def by_signal(exc: BaseException) -> bool:
    """Did a signal handler raise `exc` into the code it interrupted (Ctrl-C's KeyboardInterrupt,
    or whatever a Python handler raised), rather than that code itself? A Python handler's frame
    is in the traceback; CPython's own Ctrl-C handler raises at the interrupted instruction, which
    is then no raise statement. Handlers run on the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    handlers = set()
    for sig in signal.valid_signals():
        try:
            h = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        code = getattr(getattr(h, "__func__", h), "__code__", None)
        if code is not None:
            handlers.add(code)
    last = tb
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        last, tb = tb, tb.tb_next
    if not isinstance(exc, KeyboardInterrupt):
        return False
    code, i = last.tb_frame.f_code.co_code, last.tb_lasti
    return not (0 <= i < len(code) and code[i] in _RAISES)


def _entered(exc: BaseException) -> bool:
    """Caught right around a call: did the callee run any of its own code before `exc`? An
    interrupt at a Python callee's first instruction (a function's start is where a pending
    handler runs) left it untouched; one raised after the call returned, or by a C callee,
    finds no frame of the callee."""
    tb = exc.__traceback__
    inner = tb.tb_next if tb is not None else None
    if inner is None:
        return True
    code, i = inner.tb_frame.f_code.co_code, inner.tb_lasti
    return not (0 <= i < len(code) and code[i] == _RESUME)


class Delivery:
    """The delivery side of one Logger. Training-thread entry points: submit_window,
    submit_rows, attach, drain, stop, take_over, close_sinks, refuse_on_thread. Everything else
    runs on its thread, or with delivery="caller" in pump() and finish() on the training one."""

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
        # The thread (see _put): started by a hand-over, it claims the queue under _claim, a
        # lock the training thread never takes (a signal handler there must not wait on it).
        self._claim = threading.RLock()      # re-entrant: see _commit
        self._used = False                   # a job was submitted
        self._live = False                   # a started thread will consume the queue
        self._consumer: threading.Thread | None = None
        self._ident = -1
        # A batch's commit and writes vs take_over(). Re-entrant (so is _claim): a signal
        # handler's close() landing in close()'s own take_over() on the same thread would
        # otherwise wait on a lock its own thread holds.
        self._commit = threading.RLock()
        self._abandoned = -1                 # the ident of a thread take_over() left behind
        self._current: tuple | None = None   # the job the thread is running
        self._resolving: _Late | None = None  # the late value it waits for
        self.deadline: float | None = None   # close(): late values are waited for until then
        # Changed only by whoever delivers, and only in _emit's commit.
        self.delivered = 0
        self.lost = 0
        self.nonfinite: dict[str, int] = {}
        self.delivered_step = -1
        self._held: list[Row] = []           # rows of the newest step, waiting one batch
        self._late: list[_Late] = []
        self._src: list | None = None        # the host-row list delivered from last, and how
        self._src_done = 0                   # many of its rows (a repeated hand-over's are not)
        self._ran: tuple | None = None       # the last job committed
        self._batch: list | None = None      # [rows, sinks, how many of them have the rows]
        self.sink_errors = 0
        self.latest: dict[str, float] = {}
        self.missing: list[str] = []         # late values close() stopped waiting for
        self._hold = False                   # only once late values are in use
        self.late_errors = 0                 # attached values that failed or collided
        self._late_failed: set[str] = set()  # their names, each reported once
        self._closed_sinks = 0               # close_sinks() is resumable
        self._closing = 0                    # the thread inside a sink's close()
        self._failed: set[int] = set()
        self._last_gpu_ns: int | None = None
        self._gpu_offset: int | None = None  # min(gpu_ns - host_ns): the clocks' alignment
        # [step, gpu_ns, lag_ms] of the last row of each recent step (gpu_time only)
        self.gpu_steps: collections.deque = collections.deque(maxlen=GPU_STEPS_KEPT)

    # ---- the training thread's side -----------------------------------------------------------

    def submit_window(self, gen: Any, window: Any, flushed_at: float, ticket: int) -> None:
        self._put(("window", gen, window, flushed_at, ticket))

    def submit_rows(self, src: list, n: int, rows: list[Row], ticket: int) -> None:
        """The first n host rows of `src` (rows: them, or their reduction); a list submitted
        again (an interrupt cut its hand-over short) gives only the rows not delivered yet."""
        self._put(("rows", src, n, rows, ticket))

    def attach(self, step: int, name: str, resolve: Callable[[], float]) -> None:
        late = _Late(step, name, resolve)
        if self.caller:
            self._hold = True
            self._late.append(late)          # kept until its row comes (no copy to wait for)
        else:
            self._put(("late", late))

    def _put(self, job: tuple) -> None:
        if self.caller:
            self._pending.append(job)
            return
        # The job first, then a thread if none is live. The thread deciding to end looks at
        # the queue after saying it is not live (_loop), so a job is never left without one.
        # An interrupt inside start() may leave a thread running that is not counted: the next
        # submit starts another, and the first to claim the queue consumes it, the other ends.
        self._used = True
        self._jobs.put(job)
        if not self._live:
            threading.Thread(target=self._loop, name="syncless-delivery", daemon=True).start()
            self._live = True

    # ---- delivery="caller": the training thread runs the jobs itself --------------------------
    # The Logger calls pump() at each flush and finish() at flush(wait=True) and close(), and
    # wait_landed() before them. An interrupt anywhere in them leaves what the next one resumes.

    def pump(self, wait: bool = False) -> None:
        """Run the pending jobs, oldest first: those whose copies have landed, or (wait) all of
        them. Inside a sink's call to its logger it does nothing: the next pump runs them."""
        if self._pumping:
            return
        self._pumping = threading.get_ident()
        try:
            self._write_batch()              # a batch an interrupt cut short goes on first
            pending = self._pending
            while pending:
                job = pending[0]
                if job is self._ran:
                    pending.popleft()
                elif wait or _landed(job):
                    self._run(job, blocking=wait)
                else:
                    break
        finally:
            self._pumping = 0

    def wait_landed(self, count: int) -> None:
        """Wait (GIL released) for the copies of the `count` oldest pending jobs. Nothing
        changes, so an interrupt here loses nothing."""
        try:
            for job in list(self._pending)[:max(count, 0)]:
                if job[0] == "window":
                    self._wait_copy(job[2])
        except TimeoutError:
            pass                             # close()'s deadline: the pump counts it

    def finish(self, upto: float, flush_sinks: bool = True) -> None:
        """After pump(wait=True): deliver held rows and late values of steps up to `upto`, then
        (flush_sinks) flush the sinks: a drain's end."""
        if self._pumping:
            return
        self._pumping = threading.get_ident()
        try:
            self._write_batch()
            self._emit([], upto=upto)
            if flush_sinks:
                self.call_sinks("flush")
        finally:
            self._pumping = 0

    def pending(self) -> int:
        return len(self._pending)

    # ---- draining and stopping ----------------------------------------------------------------

    def drain(self, upto: float, deadline: float | None = None) -> bool:
        """Return once everything submitted so far reached the sinks (held rows too, and late
        values of steps up to `upto`), then flush the sinks; False if `deadline` came first.
        On the delivery thread itself this would wait forever: refused."""
        if not self._used:
            return True
        self.refuse_on_thread("flush() or close()")
        done = _locked()                     # released by the thread once it got there
        self._put(("marker", done, upto))
        if not _acquire(done, deadline):
            return False
        self.call_sinks("flush")
        return True

    def stop(self, deadline: float | None = None) -> bool:
        """Deliver what is left (the thread: the jobs queued before the stop; the caller: those
        pending, waiting for their copies), then end. False if `deadline` came first."""
        if self.caller:
            self.pump(wait=True)
            self.finish(math.inf, flush_sinks=False)
            return True
        if not self._live and self._consumer is None and self._jobs.empty():
            return True
        done = _locked()
        self._put(("stop", done))
        return _acquire(done, deadline)

    def take_over(self, grace: float) -> bool:
        """close() after its deadline, with the thread stuck (in an attached fn that does not
        return, a copy that never lands): deliver here what can be delivered, counting the late
        values given up on. The thread, if it ever comes back, changes nothing. False if a
        sink's write() did not return within `grace` either."""
        if not self._commit.acquire(timeout=grace):
            return False
        self._abandoned = self._ident
        self._commit.release()
        stuck = self._resolving
        if stuck is not None:
            stuck.missing = True
        jobs = []
        if self._current is not None and self._current is not self._ran:
            jobs.append(self._current)
        with self._claim:
            left, self._jobs = self._jobs, queue.SimpleQueue()
            self._live, self._consumer, self._ident = False, None, -1
        while True:
            try:
                jobs.append(left.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job[0] in ("marker", "stop"):
                job[1].release()
            else:
                self._run(job)
        self._emit([], upto=math.inf)
        return True

    def close_sinks(self) -> None:
        """Every sink's close(), once; an interrupt leaves the rest (and the sink it cut short:
        closing is idempotent) to the next call."""
        if self._closing == threading.get_ident():
            raise RuntimeError(
                "syncless.Logger: close() was called from a signal handler that interrupted this "
                "logger's own close() while it closed a sink; the close() it interrupted finishes "
                "(or, if the handler raises, the next close() or the exit hook)")
        sinks = self.sinks
        while self._closed_sinks < len(sinks):
            i = self._closed_sinks
            fn = getattr(sinks[i], "close", None)
            if fn is not None:
                self._closing = threading.get_ident()
                try:
                    fn()
                except BaseException as exc:
                    if by_signal(exc):
                        raise
                    self._sink_failed(i, sinks[i], exc)
                finally:
                    self._closing = 0
            self._closed_sinks = i + 1

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    @property
    def _thread(self) -> threading.Thread | None:
        """The thread that delivers now, if any (benchmarks read its CPU time)."""
        return self._consumer

    def refuse_on_thread(self, what: str) -> None:
        if self._pumping and self._pumping == threading.get_ident():
            raise RuntimeError(
                f"syncless.Logger: {what} was called from a sink's write(), while the logger "
                "delivered its rows on this thread (delivery='caller'), or from a signal handler "
                "that interrupted that delivery; it would deliver inside its own delivery. Sinks "
                "must not call the logger they belong to (log to another Logger, or keep the "
                "values and log them from the training loop); a handler's rows are delivered when "
                "the delivery it interrupted goes on, or by close() or at exit.")
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
        self._claim = threading.RLock()
        self._commit = threading.RLock()
        self._pumping = 0
        self._used = self._live = False
        self._consumer = None
        self._ident = -1
        self._held = []
        self._late = []
        self._batch = None
        self._current = None
        self._abandoned = -1

    # ---- the delivery thread ------------------------------------------------------------------

    def _loop(self) -> None:
        with self._claim:
            if self._consumer is not None:
                return                       # a second start (see _put): the first one has it
            self._consumer, self._ident = threading.current_thread(), threading.get_ident()
            self._live = True
            jobs = self._jobs                # take_over() leaves it to a stuck thread
        while True:
            job = jobs.get()
            kind = job[0]
            if kind == "stop":
                self._emit([], upto=math.inf)
                with self._claim:
                    self._live = False
                    end = jobs.empty()           # a job submitted after the stop keeps it
                    if end:
                        self._consumer, self._ident = None, -1
                    else:
                        self._live = True
                job[1].release()
                if end:
                    return
                continue
            if kind == "marker":
                self._emit([], upto=job[2])
                job[1].release()
                continue
            self._current = job
            self._run(job)
            self._current = None

    def _run(self, job: tuple, blocking: bool = True) -> None:
        """One job: keep a late value, or deliver host rows or a window's rows and give the
        window back. blocking False (a caller's pump): late values not known yet hold their
        rows back instead of being waited for. Nothing changes until _emit commits the job, so
        an interrupt before that leaves it to be run again."""
        kind = job[0]
        if kind == "late":
            self._hold = True
            self._late.append(job[1])
            return
        try:
            nonfinite = dict(self.nonfinite)
            if kind == "rows":
                src, n, out = job[1], job[2], job[3]
                rows = out[self._src_done if src is self._src else 0:n]
                for row in rows:
                    _count_nonfinite(nonfinite, row.values)
                self._emit(rows, None, False, blocking, job, nonfinite, (None, 0, 0, src, n))
            else:
                gen, w, flushed_at = job[1], job[2], job[3]
                rows, latest_done, counter = self._decode(gen, w, flushed_at, nonfinite)
                lost = max(gen.next_seq, counter - gen.capacity) - gen.next_seq
                self._emit(rows, None, latest_done, blocking, job, nonfinite,
                           (gen, counter, lost, None, 0))
        except TimeoutError as exc:               # close()'s deadline: a copy never landed
            self.missing = self.missing + [f"the rows of a window ({exc})"]
            self._ran = job
        except Exception as exc:                  # delivery must never die silently
            _log.exception("syncless: delivery failed: %s", exc)
            self._ran = job                       # dropped: its window goes back below
        except BaseException as exc:
            if self.caller or by_signal(exc):     # the training thread's own: it goes on up
                raise
            _log.exception("syncless: delivery failed: %s", exc)
            self._ran = job
        finally:
            if self._ran is job:
                if kind == "window":
                    gen, w = job[1], job[2]
                    self._pool.give(w, gen.current and w.nbytes >= gen.nbytes, job[4])
                else:
                    self._pool.give(None, False, job[4])

    def _wait_copy(self, w: Any) -> None:
        """Wait for a window's copy (GIL released); after close()'s deadline, not at all."""
        if self.deadline is None:
            w.win.wait()
            return
        while not w.win.ready():
            if time.monotonic() >= self.deadline:
                raise TimeoutError("a device-to-host copy of the logger's window did not "
                                   "complete within close()'s timeout (the stream is stuck)")
            time.sleep(0.001)

    def _decode(self, gen: Any, w: Any, flushed_at: float,
                nonfinite: dict) -> tuple[list[Row], bool, int]:
        """The window's rows, whether `latest` already holds their values, and the counter."""
        self._wait_copy(w)
        if not self._gpu_time:
            # The rows are made in C, `latest` updated there too (unless rows may be held back
            # or merged with late values): no Python work per row, under the GIL the training
            # thread needs. A graph replay's step was computed on the device; the host saw no
            # call, so its time is that of the flush that found the row.
            latest = None if self._hold else self.latest
            counter, rows = w.win.decode(gen.next_seq, self._names, nonfinite, Row, flushed_at,
                                         latest)
            return rows, latest is not None, counter
        counter, raw = w.win.decode(gen.next_seq, self._names, nonfinite)
        rows = []
        for item in raw:
            tag, step, t, values = item[1], item[2], item[3], item[-1]
            row = Row(step, flushed_at if tag & _CAPTURED else t, values)
            row.gpu_ns = item[4]                 # an attribute costs each row a dict: opt-in
            self._gpu_metrics(row, captured=bool(tag & _CAPTURED))
            rows.append(row)
        return rows, False, counter

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

    def _resolve(self, late: _Late) -> float:
        """A late value, waiting for it; after close() set a deadline, until then at most (an
        fn without poll() then runs on a thread of its own, left behind if it does not
        return). Raises TimeoutError when it gave up (the value is then counted missing)."""
        if late.value is not None:
            return late.value
        deadline = self.deadline
        if deadline is None:
            self._resolving = late
            try:
                late.value = _late_value(late.name, late.resolve())
            finally:
                self._resolving = None
            return late.value
        if not late.missing and getattr(late.resolve, "poll", None) is not None:
            while not _known(late) and time.monotonic() < deadline:
                time.sleep(0.001)
        elif not late.missing:
            with _RUNNERS:                   # one run, for the thread and take_over() both
                if late.runner is None:
                    box: list = []

                    def run() -> None:
                        try:
                            box.append(_late_value(late.name, late.resolve()))
                        except BaseException as exc:
                            box.append(exc)
                    t = threading.Thread(target=run, name="syncless-attach", daemon=True)
                    t.start()
                    late.runner = t, box
            t, box = late.runner
            t.join(max(deadline - time.monotonic(), 0.05))
            if box and isinstance(box[0], BaseException):
                raise box[0]
            if box:
                late.value = box[0]
        if late.value is None:
            late.missing = True
            raise TimeoutError("close() stopped waiting for it")
        return late.value

    def _merge_late(self, rows: list[Row], upto: float | None, blocking: bool,
                    nonfinite: dict) -> tuple[list[Row], list[Row], list[_Late], list[str]]:
        """Late values join the first row of their step; those whose step already went out
        (or, at a drain, has no row) become rows of their own at that step. Not blocking, the
        rows from the first step whose late value is not known yet are held back, with it.
        Returns (rows, rows held back, late values kept, late values given up on); the rows'
        values are new dicts, so a delivery an interrupt cut short before its commit is
        planned again from the same state."""
        held: list[Row] = []
        if not self._late:
            return rows, held, self._late, []
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
                rows, held = rows[:cut], rows[cut:]
                keep += [late for late in due if late.step >= first]
                due = [late for late in due if late.step < first]
        if not due:
            return rows, held, keep, []
        rows = [row._with(dict(row.values)) for row in rows]
        first: dict[int, Row] = {}
        for row in rows:
            first.setdefault(row.step, row)
        extra: dict[int, dict] = {}
        merged: set[tuple[int, str]] = set()       # late values added to a row here
        missing = []
        for late in due:
            try:
                v = _late_value(late.name, self._resolve(late))     # may wait (a timer's end)
            except TimeoutError:
                missing.append(f"{late.name!r} at step {late.step}")
                continue
            except BaseException as exc:
                if self.caller and by_signal(exc):
                    raise                         # the training thread's own interrupt
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
                nonfinite[late.name] = nonfinite.get(late.name, 0) + 1
        if extra:
            now = time.time()
            for step, values in extra.items():
                row = Row(step, now, values)
                row.late = True
                rows.append(row)
            rows.sort(key=lambda r: r.step)        # stable: equal steps keep their order
        return rows, held, keep, missing

    def _late_failed_once(self, late: _Late, what: str) -> None:
        self.late_errors += 1
        if late.name not in self._late_failed:
            self._late_failed.add(late.name)
            _log.error("syncless: late value %r for step %d %s (reported once per name; "
                       "stats.late_errors counts them)", late.name, late.step, what)

    def _emit(self, rows: list[Row], upto: float | None, latest_done: bool = False,
              blocking: bool = True, job: tuple | None = None, nonfinite: dict | None = None,
              done: tuple = (None, 0, 0, None, 0)) -> None:
        """upto None: a batch (hold its newest step back); else a drain up to that step.
        latest_done: the decode already put these rows' values in `latest` (nothing held).
        blocking False: late values are not waited for (see _merge_late). job, nonfinite and
        done: the job these rows come from, the NaN/Inf counts with them, and where its rows
        end (a generation's counter and rows lost, or a host-row list and how many)."""
        if nonfinite is None:
            nonfinite = dict(self.nonfinite)
        rows = self._held + rows
        held: list[Row] = []
        if rows and upto is None and self._hold:
            top = rows[-1].step
            cut = len(rows)
            while cut and rows[cut - 1].step == top:
                cut -= 1
            rows, held = rows[:cut], rows[cut:]
        rows, held_late, late, missing = self._merge_late(rows, upto, blocking, nonfinite)
        held = held_late + held
        delivered = sum(1 for row in rows if not row.late) if self._hold else len(rows)
        if rows and not latest_done:
            latest = self.latest                   # the same values again if planned again
            for row in rows:
                latest.update(row.values)
        if missing:
            missing = self.missing + missing
        else:
            missing = self.missing
        gen, counter, lost, src, n = done
        with self._commit:
            if self._abandoned == threading.get_ident():
                return                             # take_over() delivers in this one's place
            # The commit: plain assignments, no call among them, so no signal handler can run
            # between them (see the module's docstring).
            if gen is not None:
                gen.next_seq = counter
            if src is not None:
                self._src = src
                self._src_done = n
            self.lost += lost
            self.nonfinite = nonfinite
            self._held = held
            self._late = late
            self.missing = missing
            self.delivered += delivered
            if rows:
                self.delivered_step = rows[-1].step
                self._batch = [rows, self.sinks, 0]
            if job is not None:
                self._ran = job
            self._write_batch()

    def _write_batch(self) -> None:
        """Give the committed batch to every sink that does not have it yet, in order. Each
        sink but the last gets copies, so none can change what the others (or `latest`) see.
        An interrupt (caller) stops here and the next pump goes on from the sink it reached:
        again with that sink if it was cut short before its first instruction."""
        batch = self._batch
        while batch is not None:
            rows, sinks, i = batch
            last = len(sinks) - 1
            if i > last:
                self._batch = batch = None
                break
            sink = sinks[i]
            try:
                sink.write(rows if i == last else [row._with(dict(row.values)) for row in rows])
            except BaseException as exc:        # KeyboardInterrupt raised by a sink included
                if by_signal(exc):
                    if _entered(exc):
                        batch[2] = i + 1
                    raise
                self._sink_failed(i, sink, exc)
            batch[2] = i + 1

    def _sink_failed(self, i: int, sink: Any, exc: BaseException) -> None:
        self.sink_errors += 1
        if i not in self._failed:
            self._failed.add(i)
            _log.error("syncless: sink %r raised %s: %s (reported once; the other sinks go on)",
                       sink, type(exc).__name__, exc)

    def call_sinks(self, method: str) -> None:
        """Every sink's optional flush(), under the same error policy as write(); an interrupt
        goes on up."""
        for i, sink in enumerate(self.sinks):
            fn = getattr(sink, method, None)
            if fn is not None:
                try:
                    fn()
                except BaseException as exc:
                    if by_signal(exc):
                        raise
                    self._sink_failed(i, sink, exc)


def _count_nonfinite(counts: dict, values: dict) -> None:
    for name, v in values.items():
        if not math.isfinite(v):
            counts[name] = counts.get(name, 0) + 1
