"""Who raised it: a signal handler into the code it interrupted, or that code itself?

Python runs signal handlers on the main thread only, at a function's start, after a call returns
and at a loop's jump back. Delivery on the training thread lets such an exception go on up (the
user's Ctrl-C, a preemption handler's exit) and reports any other as the sink's or value's own
failure; these two tests tell them apart from the traceback alone.
"""
from __future__ import annotations

import dis
import signal
import threading

__all__ = ["by_signal", "entered", "start"]

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


def entered(exc: BaseException) -> bool:
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


def start(thread: threading.Thread) -> None:
    """thread.start(), with a signal handler's exception kept. start() waits on an Event until
    the thread runs; a handler that raises while Condition.wait() takes its lock back leaves the
    `with` block on a lock it never got, and CPython then raises RuntimeError('release unlocked
    lock') in place of the handler's exception, which it keeps as the error's __context__ (seen:
    1 in 500 handler trials under ASan on 2 cores). The handler's exception goes on up, as raised;
    the thread may have started: the caller treats it as an interrupted start."""
    try:
        thread.start()
    except RuntimeError as exc:
        cause = exc.__context__
        if cause is not None and "release unlocked lock" in str(exc):
            raise cause from None
        raise
