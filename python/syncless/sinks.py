"""Where delivered metrics go.

A sink is any object with `write(rows)`; `flush()` and `close()` are optional. `rows` is a list of
`syncless.Row(step, time, values)` in step order, `values` a dict of plain floats: a sink never
sees a tensor and can never cause a sync. Sinks are called one window at a time, on the logger's
delivery thread, or, with `Logger(delivery="caller")`, on the thread that logs, at its flushes.
A sink that raises is reported once and skipped for that window; the others go on.

    class Stdout:
        def write(self, rows):
            for r in rows:
                print(r.step, r.values)

Backends that need an optional package (TensorBoard, W&B) import it on construction and raise an
ImportError with the install hint when it is missing. How the file sinks' files survive a long
run (a full disk, a deleted file, spawned workers, a widening CSV header) is _files.py's part;
here is what their bytes are.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from typing import Any, Callable, TextIO

from ._files import FileSink, Table, encode, inherited, spawning, table_parts
from .rows import STEP, TIME, Row

__all__ = ["Callback", "JSONL", "CSV", "Print", "TensorBoard", "WandB"]


class Callback:
    """Call fn(step, time, values) for every delivered row."""

    def __init__(self, fn: Callable[[int, float, dict[str, float]], Any]):
        if not callable(fn):
            raise TypeError(f"Callback needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def write(self, rows: list[Row]) -> None:
        for row in rows:
            self.fn(row.step, row.time, row.values)

    def __repr__(self) -> str:
        return f"Callback({getattr(self.fn, '__qualname__', self.fn)!r})"


class JSONL(FileSink):
    """One JSON object per step: {"step": 7, "time": 1733000000.12, "loss": 0.5, ...}.
    NaN and Inf are written as JSON's NaN/Infinity extensions (Python's json reads them).

    mode "a" (default) appends to an existing file, "w" starts it afresh, at the first write
    (or at close() for a run without rows). Each window is one write of whole lines, passed
    straight to the OS (nothing is buffered, so flush() has nothing to do); on a failed write
    (a full disk) the file is cut back to whole lines and the sink raises an OSError naming the
    steps lost: the logger reports it and the next window tries again. A file deleted during
    the run (its directory removed) is made again and the error says which rows went with it.
    Names that are not valid Unicode are written as JSON escapes."""

    kind = "JSONL"

    def __init__(self, path: str | os.PathLike[str], mode: str = "a"):
        if mode not in ("a", "w"):
            raise ValueError(f"JSONL mode must be 'a' or 'w', got {mode!r}")
        self.mode = mode
        super().__init__(path, fresh=mode == "w")

    def write(self, rows: list[Row]) -> None:
        if not rows:
            return
        text = "".join([json.dumps({STEP: r.step, TIME: r.time, **r.values}) + "\n"
                        for r in rows])
        self._append(encode(text), rows)

    def close(self) -> None:
        self._close_file()


class CSV(Table):
    """A table: step,time,<metric>..., one row per step, a column per metric in order of first
    appearance; a metric absent at a step leaves its cell empty. After close(), `path` is one
    CSV file that `pandas.read_csv(path)` or `csv.DictReader` reads whole.

    New metrics never rewrite what is written. While the run goes on, a window that brings new
    names starts a new part, with the wider header, in a hidden folder the sink creates beside
    the file (`.m.csv.syncless-<time>-<random>/1.csv`, `2.csv`, ...; `sink.files` lists `path`
    and the parts in order, `CSV.parts(path)` what a crashed run left; each is a complete CSV,
    so a crashed run leaves files that read as they are). close() merges the parts into `path`
    in one pass (rows of narrower parts padded with empty cells) and removes them and the
    folder. Cost: a window costs the bytes of its rows (one field per known column), a new part
    one header; nothing is read back during the run, so the total work is O(bytes written),
    plus one pass over the file at close() when the columns grew.

    The sink writes `path` (truncated at the first write, or at close() for a run without
    rows) and the files it creates, and nothing else: files beside it (`m.1.csv`, an earlier
    run's part folder) are never touched. A path that is not a regular file (`/dev/stdout`, a
    FIFO) gets the wider header as a new line in the stream instead of parts, and no merge.

    Writes are unbuffered, one per window; a failed one (a full disk) leaves whole rows only
    and raises an OSError naming the steps lost, which the logger reports; the next window
    tries again. A file deleted during the run (its directory removed) is made again, with the
    full header, and the error says which rows went with it. A symlinked `path` writes its
    target. Names that are not valid Unicode are written with backslash escapes."""

    kind = "CSV"

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        self.columns: list[str] = []
        self._known: set[str] = set()
        self._head = _header_line([])                  # the header of `columns`, as written

    @staticmethod
    def parts(path: str | os.PathLike[str]) -> list[str]:
        """`path` (if it exists), then the parts that CSV sinks writing it left beside it (a run
        going on, or one that crashed before close()), oldest folder first."""
        return table_parts(os.fspath(path))

    def write(self, rows: list[Row]) -> None:
        if not rows:
            return
        new = _new_names(rows, self._known)
        columns = self.columns + list(new) if new else self.columns
        head = _header_line(columns) if new else self._head
        out = io.StringIO()
        csv.writer(out).writerows([r.step, repr(r.time)] + [r.values.get(c, "") for c in columns]
                                  for r in rows)
        self._write_table(rows, len(columns), head, encode(out.getvalue()))
        if new:
            self.columns, self._head = columns, head
            self._known.update(new)

    def close(self) -> None:
        self._close_table(self._head, len(self.columns))


def _header_line(columns: list[str]) -> bytes:
    out = io.StringIO()
    csv.writer(out).writerow([STEP, TIME, *columns])
    return encode(out.getvalue())


def _new_names(rows: list[Row], known: set[str]) -> dict[str, None]:
    """Names of `rows` not in `known`, in order of first appearance (a dict: O(1) membership)."""
    new: dict[str, None] = {}
    for r in rows:
        for name in r.values:
            if name not in known:
                new[name] = None
    return new


class Print:
    """One compact line per window: the last value and the window mean of each metric."""

    def __init__(self, file: TextIO | None = None, digits: int = 4):
        self.file = file
        self.digits = digits

    def write(self, rows: list[Row]) -> None:
        last: dict[str, float] = {}
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for r in rows:
            for k, v in r.values.items():
                last[k] = v
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
        g = f".{self.digits}g"
        parts = [f"{k} {last[k]:{g}} (mean {sums[k] / counts[k]:{g}})" for k in last]
        span = f"{rows[0].step}-{rows[-1].step}" if len(rows) > 1 else f"{rows[0].step}"
        print(f"step {span} | " + " | ".join(parts), file=self.file or sys.stdout, flush=True)

    def __repr__(self) -> str:
        return "Print()"


class _Refused:
    """The records a backend refused in one window: the others are written first, then one
    error names the first refused metric, so the logger reports and counts it."""

    def __init__(self, sink: str):
        self.sink = sink
        self.count = 0
        self.first: tuple[str, int, Exception] | None = None

    def add(self, metric: str, step: int, exc: Exception) -> None:
        self.count += 1
        if self.first is None:
            self.first = (metric, step, exc)

    def raise_if_any(self) -> None:
        if self.first is None:
            return
        metric, step, exc = self.first
        raise RuntimeError(f"{self.sink}: {self.count} record(s) of this window were not "
                           f"written, the first: metric {metric} at step {step}: "
                           f"{type(exc).__name__}: {exc}; every other record was") from exc


def _missing(package: str, extra: str) -> ImportError:
    return ImportError(f"this sink needs {package}: pip install {package} (from a syncless "
                       f"checkout: pip install -e '.[{extra}]')")


class TensorBoard:
    """Write every row as scalars to a TensorBoard event file, at its step and wall time (the
    host time of the log() call). Pass a log directory (extra keyword arguments go to torch's
    SummaryWriter) or an existing writer: torch's, tensorboardX's or syncless.tensorboard's."""

    def __init__(self, log_dir: str | os.PathLike[str] | Any = None, **writer_kwargs: Any):
        self.writer: Any
        self._add: Callable[[str, float, int, float], Any] | None
        if log_dir is not None and hasattr(log_dir, "add_scalar"):
            self.writer, self._owned = log_dir, False
        elif spawning():
            # A module-level line of the parent's run, executed again by a spawned worker: no
            # event file of its own in the parent's log directory.
            self.writer, self._owned, self._add = None, False, None
            return
        else:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise _missing("tensorboard", "tensorboard") from exc
            self.writer, self._owned = SummaryWriter(log_dir, **writer_kwargs), True
        # A syncless writer would defer these floats a second time; write them directly.
        self._add = getattr(self.writer, "_write_scalar", self.writer.add_scalar)

    def write(self, rows: list[Row]) -> None:
        add = self._add
        if add is None:
            raise inherited(self)
        failed = _Refused("TensorBoard")
        for r in rows:
            for name, v in r.values.items():
                try:
                    add(name, v, r.step, r.time)
                except Exception as exc:            # one bad scalar never costs the others
                    failed.add(repr(name), r.step, exc)
        failed.raise_if_any()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is None:
            return
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()

    def __repr__(self) -> str:
        return f"TensorBoard({getattr(self.writer, 'log_dir', '?')!r})"


class WandB:
    """Log every row to a W&B run (the active one at delivery by default) at its step, with
    `_timestamp` the host time of the log() call. The logger's steps become the run's steps:
    wandb ignores a step below the run's current one, so let the logger own the step count.
    Consecutive rows of one step go in one run.log call. The run is not finished on close()."""

    def __init__(self, run: Any = None):
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb") from exc
        self._wandb = wandb
        self._run = run

    @property
    def run(self) -> Any:
        run = self._run if self._run is not None else self._wandb.run
        if run is None:
            raise RuntimeError("syncless.sinks.WandB: no W&B run; call wandb.init() first or "
                               "pass run=")
        return run

    def write(self, rows: list[Row]) -> None:
        run = self.run
        failed = _Refused("WandB")
        groups: list[tuple[int, dict[str, float]]] = []
        for r in rows:
            if not groups or groups[-1][0] != r.step:
                groups.append((r.step, {}))
            data = groups[-1][1]
            data.update(r.values)
            data["_timestamp"] = r.time
        for step, data in groups:
            try:
                run.log(data, step=step)
            except Exception as exc:                # one refused step never costs the others
                failed.add(", ".join(repr(k) for k in data if k != "_timestamp"), step, exc)
        failed.raise_if_any()

    def __repr__(self) -> str:
        return "WandB()"
