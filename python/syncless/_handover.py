"""The hand-over: where the training thread lets rows go and the delivery side takes them.

One `Handover` per Logger owns the pinned windows and their pool, backpressure, the tickets that
keep the two sides' counts, and the driver that runs the `Delivery`:

    ThreadHandover   delivery="thread": a thread of the logger's takes the jobs from a queue,
                     waiting (GIL released) for each window's copy
    CallerHandover   delivery="caller": the jobs wait in a list and the training thread runs
                     them itself at its hand-overs and drains, those whose copies have landed
                     (an event query, never a wait), so no second thread takes the GIL

The Logger talks to it through send_window, send_rows, attach, drain, stop and close (and
refuse_on_thread, forget, stats); the jobs are _delivery's typed records. A new driver is a subclass with _submit, _wait_room, _deliver,
attach, drain, stop, refuse_on_thread.

Interrupts. Nothing here blocks a signal or changes a handler (a thread inherits its creator's
mask, and every process a sink starts inherits its thread's). Python runs signal handlers (Ctrl-C,
a preemption handler that flushes or closes) on the main thread at a function's start, after a
call returns and at a loop's jump back, never inside a run of plain assignments. So a hand-over
submits first and then counts, in one such run, and a hand-over submitted twice (an interrupt
between the two, or a handler's flush() inside the first) delivers its rows once: a window's
decode starts at the delivery's read position in its ring, host rows are taken by list and count
(_delivery). The waits before a hand-over change nothing, so an interrupt there loses nothing.
"""
from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from typing import Callable, NamedTuple, Union

from ._delivery import Delivery, Job, LateJob, ReducedJob, RowsJob, WindowJob
from ._late import Late
from ._ring import DeviceRing, Window
from ._signals import start
from .rows import Row

__all__ = ["Handover", "HandoverStats", "ThreadHandover", "CallerHandover", "Pool", "Window"]

_log = logging.getLogger("syncless")


class HandoverStats(NamedTuple):
    """The training thread's counts, for Logger.stats."""
    windows: int                         # hand-overs made
    waits: int                           # times a hand-over waited for a free window


class _Marker(NamedTuple):
    """ThreadHandover's drain: the thread delivers held rows and late values up to `upto`,
    then releases `done`."""
    done: threading.Lock
    upto: float


class _Stop(NamedTuple):
    """ThreadHandover's stop: the thread delivers what is left, ends, and releases `done`."""
    done: threading.Lock


_Queued = Union[Job, _Marker, _Stop]


class Pool:
    """Pinned windows and their backpressure. Every hand-over carries a ticket, one more than the
    last the training thread counted (`taken`); the delivery side sets `given` to the ticket of
    each job it is done with. A hand-over an interrupt cut between its submit and its count is
    submitted again with the same ticket, so the counts never drift: an interrupt can at worst
    let one window too many out for a moment, never hold one back (a count lost that way would
    make a later flush wait forever). The training thread waits on a plain lock, re-checking:
    interrupted, its acquire raises and changes nothing, and a signal handler that flushes
    meanwhile cannot leave it waiting for a wake-up that was already taken.

    `lock` guards `free`, which both threads change. It is re-entrant: a signal handler that
    flushes can run inside reuse() or give() on the training thread (after a call returns,
    with the lock held), and its own hand-over takes the lock again; with a plain lock that
    thread waited for itself forever (delivery="caller" on CUDA hung so). Each takes or puts
    one window in a single list operation, so the one it interrupted finds `free` whole."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.RLock()
        self.free: list[Window] = []
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

    def reuse(self, nbytes: int) -> Window | None:
        """Training thread: a window the delivery side is done with that holds `nbytes`, or None
        (windows of a narrower ring, replaced by a wider one, are let go)."""
        with self.lock:
            while self.free:
                w = self.free.pop()
                if w.nbytes >= nbytes:
                    return w
            return None

    def give(self, window: Window | None, ticket: int) -> None:
        """Delivery side: the hand-over with this ticket is done (idempotent)."""
        with self.lock:
            if window is not None and all(w is not window for w in self.free):
                self.free.append(window)
        if ticket > self.given:
            self.given = ticket
        if self._wake.locked():
            try:
                self._wake.release()
            except RuntimeError:                 # released meanwhile by another give()
                pass


def _locked() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


def _acquire(lock: threading.Lock, deadline: float | None) -> bool:
    """Wait for a lock another thread releases, until `deadline` (time.monotonic) at most.
    A plain lock: an interrupt raises out of the wait and changes nothing."""
    if deadline is None:
        lock.acquire()
        return True
    return lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))


class Handover:
    """The training thread's side of the hand-over, whatever the driver. `windows` counts the
    hand-overs made, `sent_calls` is the logger's call count at the last one."""

    def __init__(self, delivery: Delivery, windows: int, lock: threading.RLock):
        self.delivery = delivery
        self.pool = Pool(windows)
        self.lock = lock                     # the Logger's: flush(), close(), threads=True
        self.windows = 0
        self.sent_calls = 0
        self._copying: Window | None = None  # the window of a hand-over until its commit
        self._parked: list[Window] = []      # see _park

    # ---- the Logger's calls ------------------------------------------------------------------

    def reserve(self, ring: DeviceRing) -> None:
        """Allocate the pool's pinned windows for the device ring `ring` now, when the ring is
        made (the first CUDA log(), or a wider ring), so no hand-over allocates one: a
        page-locked allocation (cudaHostAlloc) is an implicit synchronisation, and a flush that
        found every window still out (a max_delay flush soon after a full one) made it in the
        middle of a run. Not under capture: the hand-over then allocates, as a fallback."""
        if ring.ring.capturing():
            return
        pool = self.pool
        with pool.lock:                      # a narrower ring's windows go (one assignment)
            pool.free = [w for w in pool.free if w.nbytes >= ring.nbytes]
            missing = pool.limit - len(pool.free)
        made = [Window(ring.device, ring.nbytes) for _ in range(missing)]
        with pool.lock:
            pool.free.extend(made)

    def send_window(self, ring: DeviceRing, calls: int,
                    before_copy: Callable[[], None] | None) -> None:
        """Copy the device ring `ring` (on the current device and stream)
        into a pinned window and hand it over: one async copy and one event, never a wait on
        the GPU, only for a free window (backpressure). `calls`: the logger's call count, all
        of whose rows the copy holds; before_copy is enqueued first (a reduction)."""
        self._wait_room()
        self._deliver()                      # delivery="caller": windows landed come back
        if self._copying is not None or self._parked:
            self._park()
        w = self.pool.reuse(ring.nbytes)
        if w is None:                        # after an interrupt parked one, or see reserve()
            w = Window(ring.device, ring.nbytes)
        self._copying = w
        if before_copy is not None:          # enqueued before the copy, same stream
            before_copy()
        ring.ring.copy_to(w.win)
        ticket = self.pool.taken + 1
        self._submit(WindowJob(ring, w, time.time(), ticket))
        self.sent_calls = calls              # the counts: plain assignments (see above)
        self.windows += 1
        self.pool.taken = ticket
        self._copying = None

    def send_rows(self, rows: list[Row], out: list[Row], calls: int) -> None:
        """Hand over host rows (out: them, or their reduction). The list handed over again
        after an interrupt gives only the rows not delivered yet."""
        n = len(rows)
        self._wait_room()                    # may wait; an interrupt here loses nothing
        ticket = self.pool.taken + 1
        self._submit(RowsJob(rows, n, out, ticket))
        self.sent_calls = calls              # the counts: plain assignments (see above)
        self.windows += 1
        self.pool.taken = ticket
        self._deliver()                      # delivery="caller": host rows need no copy

    def submit_reduced(self, rows: list[Row]) -> None:
        """From the cross-rank exchange's thread (_ranks): rows reduced across ranks, delivered
        like host rows (no ticket: they hold no window)."""
        self._submit(ReducedJob(rows))

    def stats(self) -> HandoverStats:
        """The counts for Logger.stats, read whole."""
        return HandoverStats(self.windows, self.pool.waits)

    @property
    def deadline(self) -> float | None:
        """close()'s deadline (time.monotonic), once start_closing() set one."""
        return self.delivery.late.deadline

    def start_closing(self, timeout: float | None) -> None:
        """close() begins: from here on late values and copies are waited for `timeout`
        seconds at most (None: no bound). A close() an interrupt cut short and called again
        keeps the first deadline, so interpreter exit is bounded by it too."""
        late = self.delivery.late
        if timeout is not None:
            deadline = time.monotonic() + timeout
            if late.deadline is None or deadline < late.deadline:
                late.deadline = deadline

    def close(self, timeout: float | None) -> None:
        """After the last hand-over: deliver everything, stop the driver, close the sinks.
        Resumable: an interrupt leaves the rest to the next call."""
        deadline = self.delivery.late.deadline
        done = self.drain(math.inf, deadline) and self.stop(deadline)
        if not done and not self._take_over(grace=max(1.0, timeout or 0.0)):
            _log.error("syncless: close() gave up after %s s: a sink's write() did not return; "
                       "rows still queued were not delivered", timeout)
        self.delivery.close_sinks()
        self.delivery.whole.stop()

    def forget(self, lock: threading.RLock) -> None:
        """In a forked child: drop the parent's windows, jobs and thread without touching them."""
        self.lock = lock
        self.pool = Pool(self.pool.limit)
        self._copying = None
        self._parked = []
        self.delivery.forget()

    # ---- shared by the drivers ---------------------------------------------------------------

    def _park(self) -> None:
        """A hand-over an interrupt cut short after its copy may have left its window out of
        every job, with the copy still writing into it: kept alive until that copy is done
        (freed pinned memory goes back to torch's cache, which knows nothing of our copy)."""
        if self._copying is not None:
            self._parked.append(self._copying)
            self._copying = None
        self._parked = [w for w in self._parked if not w.win.ready()]

    def _run(self, job: Job, blocking: bool = True, epoch: int = -1) -> None:
        """Run a job on the delivery; once it is committed, its window and ticket come back.
        epoch: the delivery's commit count when the job was found due (see Delivery.run)."""
        try:
            committed = self.delivery.run(job, blocking, epoch)
        except BaseException:
            # An interrupt out of the sinks' calls that follow a commit: the job is done.
            if self.delivery.committed(job):
                self._give(job)
            raise
        if committed:
            self._give(job)

    def _give(self, job: Job) -> None:
        """A committed job's window (unless a wider ring replaced its ring) and ticket."""
        if isinstance(job, WindowJob):
            self.pool.give(job.window if job.ring.current else None, job.ticket)
        elif isinstance(job, RowsJob):
            self.pool.give(None, job.ticket)
        elif isinstance(job, ReducedJob):
            self.pool.give(None, 0)              # no ticket; wakes a waiting hand-over

    # ---- what a driver defines ---------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        raise NotImplementedError

    def _wait_room(self) -> None:
        """Backpressure before a hand-over. Nothing changes while it waits."""
        raise NotImplementedError

    def _deliver(self, upto: float | None = None) -> None:
        """Deliver on this thread what can be (upto given: everything, then a drain to it)."""

    def _take_over(self, grace: float) -> bool:
        return True

    def attach(self, late: Late) -> None:
        raise NotImplementedError

    def drain(self, upto: float, deadline: float | None = None) -> bool:
        """Return once every row handed over reached the sinks (held rows too, and late values
        of steps up to `upto`), and the sinks were flushed; False if `deadline` came first."""
        raise NotImplementedError

    def stop(self, deadline: float | None = None) -> bool:
        """Deliver what is left, then end. False if `deadline` came first."""
        raise NotImplementedError

    def refuse_on_thread(self, what: str) -> None:
        """Refuse a public call from inside the delivery (a sink's write()): it would deliver
        inside itself. A signal handler's call on the training thread is no such call."""
        raise NotImplementedError

    def _refuse_helper(self, what: str) -> None:
        """A sink's call on the helper that runs the sinks' calls made on the main thread
        (_whole): the main thread waits for that sink."""
        if threading.get_ident() == self.delivery.whole.ident:
            raise RuntimeError(
                f"syncless.Logger: {what} was called from a sink's write(), flush() or close() "
                "(or an attach() fn), which the logger runs while it waits for it; it would wait "
                "for itself forever. Sinks must not call the logger they belong to (log to "
                "another Logger, or keep the values and log them from the training loop).")


class ThreadHandover(Handover):
    """delivery="thread": the jobs go through a queue to a thread of the logger's."""

    def __init__(self, delivery: Delivery, windows: int, lock: threading.RLock):
        super().__init__(delivery, windows, lock)
        self._jobs: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        # The thread (see _submit): started by a hand-over, it claims the queue under _claim, a
        # lock the training thread takes only in take_over(), re-entrantly (a signal handler
        # there must not wait on it).
        self._claim = threading.RLock()
        self._used = False                   # a job was submitted
        self._live = False                   # a started thread will consume the queue
        self._consumer: threading.Thread | None = None
        self._ident = -1
        self._current: Job | None = None     # the job the thread is running

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that delivers now, if any (benchmarks read its CPU time)."""
        return self._consumer

    def _submit(self, job: _Queued) -> None:
        # The job first, then a thread if none is live. The thread deciding to end looks at
        # the queue after saying it is not live (_loop), so a job is never left without one.
        # An interrupt inside start() may leave a thread running that is not counted: the next
        # submit starts another, and the first to claim the queue consumes it, the other ends.
        self._used = True
        self._jobs.put(job)
        if not self._live:
            start(threading.Thread(target=self._loop, name="syncless-delivery", daemon=True))
            self._live = True

    def _wait_room(self) -> None:
        self.pool.wait()

    def attach(self, late: Late) -> None:
        self._submit(LateJob(late))

    def drain(self, upto: float, deadline: float | None = None) -> bool:
        if not self._used:
            return True
        self.refuse_on_thread("flush() or close()")
        done = _locked()                     # released by the thread once it got there
        self._submit(_Marker(done, upto))
        if not _acquire(done, deadline):
            return False
        self.delivery.call_sinks("flush")
        return True

    def stop(self, deadline: float | None = None) -> bool:
        """The thread delivers the jobs queued before the stop, then ends."""
        if not self._live and self._consumer is None and self._jobs.empty():
            return True
        done = _locked()
        self._submit(_Stop(done))
        return _acquire(done, deadline)

    def _take_over(self, grace: float) -> bool:
        """close() after its deadline, with the thread stuck (in an attached fn that does not
        return, a copy that never lands): deliver here what can be delivered, counting the late
        values given up on. The thread, if it ever comes back, changes nothing. False if a
        sink's write() did not return within `grace` either."""
        d = self.delivery
        if not d.abandon(self._ident, grace):
            return False
        jobs: list[_Queued] = []
        if self._current is not None and not d.committed(self._current):
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
            if isinstance(job, (_Marker, _Stop)):
                job.done.release()
            else:
                self._run(job)
        d.end(math.inf)
        return True

    def refuse_on_thread(self, what: str) -> None:
        self._refuse_helper(what)
        if threading.get_ident() == self._ident:
            raise RuntimeError(
                f"syncless.Logger: {what} was called from a sink's write(), on the logger's own "
                "delivery thread; it would wait for itself forever. Sinks must not call the "
                "logger they belong to (log to another Logger, or keep the values and log them "
                "from the training loop).")

    def forget(self, lock: threading.RLock) -> None:
        super().forget(lock)
        self._jobs = queue.SimpleQueue()
        self._claim = threading.RLock()
        self._used = self._live = False
        self._consumer = None
        self._ident = -1
        self._current = None

    def _loop(self) -> None:
        with self._claim:
            if self._consumer is not None:
                return                       # a second start (see _submit): the first has it
            self._consumer, self._ident = threading.current_thread(), threading.get_ident()
            self._live = True
            jobs = self._jobs                # _take_over() leaves it to a stuck thread
        d = self.delivery
        while True:
            job = jobs.get()
            if isinstance(job, _Stop):
                d.end(math.inf)
                with self._claim:
                    self._live = False
                    end = jobs.empty()           # a job submitted after the stop keeps it
                    if end:
                        self._consumer, self._ident = None, -1
                    else:
                        self._live = True
                job.done.release()
                if end:
                    return
                continue
            if isinstance(job, _Marker):
                d.end(job.upto)
                job.done.release()
                continue
            self._current = job
            self._run(job)
            self._current = None


class CallerHandover(Handover):
    """delivery="caller": the training thread runs the jobs itself, at each hand-over those
    whose copies landed, at a drain all of them. An interrupt anywhere in a delivery leaves
    what the next one resumes. A signal handler's flush() or close() on the main thread, inside
    a delivery it interrupted, delivers itself (re-entrant: the interrupted delivery's plan is
    then dropped, see Delivery._emit, and the sink's call it waited for goes on, see _whole),
    and returns with its rows delivered. `unowned(fn)` (the Logger's) runs fn with the logger
    owned by no thread, so a sink's log() is refused as a call from elsewhere and never
    recurses."""

    def __init__(self, delivery: Delivery, windows: int, lock: threading.RLock,
                 unowned: Callable[[Callable[[], None]], None]):
        super().__init__(delivery, windows, lock)
        self._pending: collections.deque[Job] = collections.deque()   # jobs not yet run
        self._pumping = 0                    # the thread inside _pump() or _finish()
        self._unowned = unowned

    def _submit(self, job: Job) -> None:
        self._pending.append(job)

    def _wait_room(self) -> None:
        """Wait for the oldest copies while every window is undelivered; the hand-over's
        _deliver then delivers them."""
        over = len(self._pending) - self.pool.limit + 1
        if over > 0:
            self.pool.waits += 1
            self._wait_landed(over)

    def attach(self, late: Late) -> None:
        self.delivery.late.keep(late)        # kept until its row comes (no copy to wait for)

    def drain(self, upto: float, deadline: float | None = None) -> bool:
        self.refuse_on_thread("flush() or close()")
        with self.lock:                      # the sinks run on this thread: one at a time
            self._wait_landed(len(self._pending))    # interruptible; nothing changes meanwhile
            self._deliver(upto)
        return True

    def stop(self, deadline: float | None = None) -> bool:
        """Deliver the pending jobs, waiting for their copies."""
        self._pump(wait=True)
        self._finish(math.inf, flush_sinks=False)
        return True

    def refuse_on_thread(self, what: str) -> None:
        self._refuse_helper(what)
        # On the main thread the sinks run on the helper: a call here inside a delivery is a
        # signal handler's, and is served. Elsewhere (no handler runs there) it is a sink's.
        if self._pumping and self._pumping == threading.get_ident() and \
                threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"syncless.Logger: {what} was called from a sink's write(), while the logger "
                "delivered its rows on this thread (delivery='caller'); it would deliver inside "
                "its own delivery. Sinks must not call the logger they belong to (log to another "
                "Logger, or keep the values and log them from the training loop).")

    def forget(self, lock: threading.RLock) -> None:
        super().forget(lock)
        self._pending = collections.deque()
        self._pumping = 0

    def _deliver(self, upto: float | None = None) -> None:
        if upto is None:
            self._unowned(self._pump)
        else:
            self._unowned(lambda: self._drain_here(upto))

    def _drain_here(self, upto: float) -> None:
        self._pump(wait=True)
        self._finish(upto)

    def _wait_landed(self, count: int) -> None:
        """Wait (GIL released) for the copies of the `count` oldest pending jobs. Nothing
        changes, so an interrupt here loses nothing."""
        try:
            for job in list(self._pending)[:max(count, 0)]:
                if isinstance(job, WindowJob):
                    self.delivery.wait_copy(job.window)
        except TimeoutError:
            pass                             # close()'s deadline: the pump counts it

    def _pump(self, wait: bool = False) -> None:
        """Run the pending jobs, oldest first: those whose copies have landed, or (wait) all of
        them. Re-entrant on the main thread (a signal handler's flush() inside the pump it
        interrupted; the pump below then finds the jobs done). Elsewhere, inside a sink's call to
        its logger, it does nothing: the next pump runs them."""
        before = self._pumping
        if before and threading.current_thread() is not threading.main_thread():
            return
        self._pumping = threading.get_ident()
        try:
            self.delivery.write_batch()      # a batch an interrupt cut short goes on first
            pending, d = self._pending, self.delivery
            while True:
                # The commit count first, then the head job, with no call between: a handler
                # that delivers this job after here (inside _landed, say) makes its run a
                # stale plan, dropped (an older host-row list run again would repeat rows).
                # `while pending` would test before the loop's jump back, where handlers run.
                epoch = d.epoch
                if not pending:
                    break
                job = pending[0]
                if d.committed(job):
                    pending.popleft()
                elif wait or _landed(job):
                    self._run(job, wait, epoch)
                else:
                    break
        finally:
            self._pumping = before

    def _finish(self, upto: float, flush_sinks: bool = True) -> None:
        """After _pump(wait=True): deliver held rows and late values of steps up to `upto`,
        then (flush_sinks) flush the sinks: a drain's end. Re-entrant as _pump is."""
        before = self._pumping
        if before and threading.current_thread() is not threading.main_thread():
            return
        self._pumping = threading.get_ident()
        try:
            d = self.delivery
            d.write_batch()
            d.end(upto)
            if flush_sinks:
                d.call_sinks("flush")
        finally:
            self._pumping = before


def _landed(job: Job) -> bool:
    """Can this job run without waiting? (Host rows always; a window once its copy landed.)"""
    if not isinstance(job, WindowJob):
        return True
    try:
        return job.window.win.ready()
    except Exception:
        return True                          # the decode's wait raises it, and it is reported
