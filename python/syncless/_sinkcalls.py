"""Calling the sinks: the delivery side's last step, apart from the seam with the training side.

`SinkCalls` is the part of `_delivery.Delivery` (its base class) that calls the user's code: each
committed batch to every sink once, in order; every sink's flush() and close(); each failing sink
reported once while the others go on, whatever it raised. On the main thread, where signal
handlers run, each call runs whole on a helper thread (`_whole`): an interrupt stops the wait for
it, never the call, and the next delivery goes on from the next sink. Sinks are the user's
objects (anything with write(rows)), so this module, unlike `_delivery` and `_handover`, handles
values typed Any.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

from ._late import LateValues
from ._whole import Whole, on_main

__all__ = ["SinkCalls"]

_log = logging.getLogger("syncless")


class SinkCalls:
    """The sinks and their calls. `_batch` is set by Delivery's commit: [rows, sinks, how many
    of them have the rows]."""

    def __init__(self, sinks: list[object]):
        self.sinks = sinks
        self.whole = Whole()                 # runs the sinks' calls made on the main thread
        self.late = LateValues(self.whole)
        self._batch: list[Any] | None = None  # [rows, sinks, how many of them have the rows]
        self.sink_errors = 0
        self._failed: set[int] = set()
        self.raised: BaseException | None = None   # the first BaseException a sink raised
        self._closed_sinks = [0]             # sinks closed: close_sinks() is resumable
        self._closing = 0                    # the thread inside a sink's close() (not main)

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
