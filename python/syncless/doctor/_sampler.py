"""A low-rate stack sampler of one thread: which user lines the host time goes to.

Runs only while the doctor measures (never under watch()): every `interval` seconds a daemon thread
reads the target thread's current frame (sys._current_frames) and counts its first user line. It
needs the GIL for that, so it runs when the training thread releases it (inside torch ops, syncs,
sleeps) or at the interpreter's switch interval: at 2 ms it costs the training thread a few
microseconds per sample, well under 1% of the step."""
from __future__ import annotations

import bisect
import collections
import linecache
import sys
import threading
from time import perf_counter

from ._frames import sampled_site, short, step_part

__all__ = ["StackSampler", "Line"]


class Line(collections.namedtuple("Line", "file line via samples")):
    @property
    def where(self) -> str:
        return f"{short(self.file)}:{self.line}"

    @property
    def code(self) -> str:
        linecache.checkcache(self.file)           # a file of that name may have changed since
        return linecache.getline(self.file, self.line).strip()


class StackSampler:
    def __init__(self, thread_id: int | None = None, interval: float = 0.002):
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.interval = interval
        self.counts: collections.Counter[tuple[str, int, str] | None] = collections.Counter()
        self.total = 0
        self.times: list[float] = []          # when each sample was taken (perf_counter) ...
        # ... and its line: lines of chosen steps
        self.keys: list[tuple[str, int, str] | None] = []
        # samples by the part of the step they are in: "model", "optimizer", "other" (step_part)
        self.parts: collections.Counter[str] = collections.Counter()
        self._parts = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, parts: bool = True) -> None:
        """`parts`: also count each sample's part of the step (step_part walks the whole stack;
        only a CUDA loop's launch finding reads them)."""
        if self._thread is not None:
            return
        self._parts = parts
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="syncless-doctor-sampler",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        tid, wait, counts = self.thread_id, self._stop.wait, self.counts
        parts = self.parts if self._parts else None
        while not wait(self.interval):
            frame = sys._current_frames().get(tid)
            if frame is None:
                return
            key = sampled_site(frame)
            counts[key] += 1
            if parts is not None:
                parts[step_part(frame)] += 1
            self.times.append(perf_counter())
            self.keys.append(key)
            self.total += 1
            del frame

    def line_between(self, windows: list[tuple[float, float]]) -> tuple[Line | None, int]:
        """The line with the most samples inside the (start, end) perf_counter windows, and the
        number of samples they hold."""
        counts: collections.Counter[tuple[str, int, str]] = collections.Counter()
        for t0, t1 in windows:
            lo, hi = bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1)
            counts.update(k for k in self.keys[lo:hi] if k is not None)
        n = sum(counts.values())
        if not counts:
            return None, 0
        key, count = counts.most_common(1)[0]
        return Line(key[0], key[1], key[2], count), n

    def share(self, part: str) -> float | None:
        """The share of the samples in `part` of the step (step_part); None: none counted."""
        counted = sum(self.parts.values())
        return self.parts[part] / counted if counted else None

    def top(self, n: int = 5, least: float = 0.03) -> list[Line]:
        """The `n` user lines with the most samples, each holding at least `least` of them."""
        out: list[Line] = []
        for key, count in self.counts.most_common():
            if len(out) == n or count < least * self.total:
                break
            if key is not None:
                out.append(Line(key[0], key[1], key[2], count))
        return out
