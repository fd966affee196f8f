"""User code run whole: a sink's write(), flush() or close() and an attach() fn, called by the
logger on the main thread, run on a helper thread while the main thread waits for them.

Python runs signal handlers on the main thread only. A handler that raises (Ctrl-C's
KeyboardInterrupt, a preemption handler's exit) inside a sink's write() on the main thread cut
it short, and nobody can tell which of its rows the sink kept: it lost or repeated them. Run by
the helper, the call goes on to its end whatever the handler does; the main thread waits for it
(interruptibly: the lock's wait lets handlers run, and their exception goes on up) and the next
delivery, or the handler's own flush() or close(), first waits for the call in flight. So every
call is made once and runs to its end: the rows of every returned log() call reach each sink
once. An exception the user's code raises is never taken for the main thread's interrupt (it
is raised on the helper), and whatever it is, the logger reports it.

No signal is blocked and no handler changed (see DESIGN.md's hazards). The cost is a hand-over
between two threads per call (the main thread waits, so they never compete for the GIL).

A call is claimed, then run: `claim(job)` says whether nothing is in flight, and `go(job)` hands
it to the helper; the caller checks that the call is still due and claims it with no call in
between (see Delivery.write_batch), so a handler that runs before the claim finds the call not
made, and one after it finds it in flight.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ._signals import start

__all__ = ["Whole", "Job", "on_main"]

# A call: [fn, done (a lock released once it ran), finished, box, k, i, what]: fn, once made,
# sets box[k] to i + 1 (see Delivery._call); `what` names it if it is given up on
Job = list[Any]
GRACE = 1.0                                  # seconds each call gets after close()'s deadline


def on_main() -> bool:
    """Is this the thread that Python runs signal handlers on?"""
    return threading.current_thread() is threading.main_thread()


def _locked() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


class Whole:
    """One helper thread of a Logger's that runs the user's calls the main thread hands it, one
    at a time. `busy` is the call in flight (None: none); the helper clears it when done."""

    def __init__(self) -> None:
        self.busy: Job | None = None
        self.gate = _locked()                # released: `busy` waits for the helper
        self._thread: threading.Thread | None = None
        self.ident = -1                      # the helper's thread id (its calls are refused)

    @staticmethod
    def job(fn: Callable[[], None], box: list[Any], k: int, i: int, what: str) -> Job:
        return [fn, _locked(), False, box, k, i, what]

    def ready(self) -> None:
        """Start the helper if none runs. An interrupt inside start() may leave one running that
        is not counted: the next call starts another, and both take calls from the same gate."""
        t = self._thread
        if t is None or not t.is_alive():
            t = threading.Thread(target=self._loop, args=(self.gate,), name="syncless-sinks",
                                 daemon=True)
            start(t)
            self._thread = t

    def wait(self, job: Job, deadline: float | None = None) -> bool:
        """Wait until `job` ran (or until it is not the call in flight: never claimed).
        Interruptible: a signal handler runs while it waits, and what it raises goes on up; the
        call goes on. False: `deadline` (time.monotonic) came first, and GRACE more seconds."""
        until = None if deadline is None else max(deadline, time.monotonic() + GRACE)
        while not job[2] and self.busy is job:
            if until is None:
                got = job[1].acquire(timeout=1.0)
            else:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                got = job[1].acquire(timeout=left)
            if got:
                job[1].release()             # for any other waiter (a handler's, nested)
        return True

    def idle(self, deadline: float | None = None) -> Job | None:
        """Wait for the call in flight, if any (see wait); the call if it did not return."""
        job = self.busy
        if job is None or self.wait(job, deadline):
            return None
        return job

    def abandon(self, job: Job) -> None:
        """Leave `job` in flight (it did not return by close()'s deadline) to its thread, count
        it made, and let a new helper take the next calls. The old one ends when (if) it
        returns."""
        box, k, i = job[3], job[4], job[5]
        if box[k] == i:
            box[k] = i + 1
        if self.busy is job:
            self.busy = None
            self.gate = _locked()
            self._thread = None

    def stop(self) -> None:
        """The logger closed: the helper ends (a later call starts another)."""
        gate = self.gate
        self.gate = _locked()
        self._thread = None
        try:
            gate.release()                   # wakes it: it finds its gate replaced, and ends
        except RuntimeError:                 # already open: a call's hand-over woke it first
            pass                             # (CI: "release unlocked lock" out of close())

    def forget(self) -> None:
        """In a forked child: the parent's helper does not run here."""
        self.busy = None
        self.gate = _locked()
        self._thread = None
        self.ident = -1

    def _loop(self, gate: threading.Lock) -> None:
        self.ident = threading.get_ident()
        while True:
            gate.acquire()
            if gate is not self.gate:
                return                       # stopped, or abandoned (see abandon)
            job = self.busy
            if job is None:
                continue
            try:
                job[0]()                     # reports its own errors (see Delivery._call)
            except BaseException:            # never this thread's end
                pass
            job[2] = True
            if self.busy is job:
                self.busy = None
            job[1].release()
            if gate is not self.gate:
                return                       # abandoned while it ran
