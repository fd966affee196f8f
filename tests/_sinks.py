"""The test sink, for every test file: `from _sinks import Collect`."""
import threading


class Collect:
    """A sink that keeps every row: `rows` as (step, values), `raw` as the Row objects given;
    it counts its flushes, notes its close and the threads that wrote to it."""

    def __init__(self):
        self.rows = []
        self.raw = []
        self.threads = set()
        self.flushed = 0
        self.closed = False

    def write(self, rows):
        self.threads.add(threading.get_ident())
        self.raw.extend(rows)
        self.rows.extend((r.step, dict(r.values)) for r in rows)

    def flush(self):
        self.flushed += 1

    def close(self):
        self.closed = True


class Gated(Collect):
    """A Collect whose write() first waits for `gate` (a threading.Event, set by the test) for
    up to `timeout` seconds: a sink that holds its window until the test lets it go."""

    def __init__(self, timeout=60):
        super().__init__()
        self.gate = threading.Event()
        self.timeout = timeout

    def write(self, rows):
        self.gate.wait(self.timeout)
        super().write(rows)
