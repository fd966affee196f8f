"""Where delivered metrics go.

A sink is any object with `write(rows)`; `flush()` and `close()` are optional. `rows` is a list of
`syncless.Row(step, time, values)` in step order, `values` a dict of plain floats: a sink never
sees a tensor and can never cause a sync. Sinks run on the logger's delivery thread, one window
at a time. A sink that raises is reported once and skipped for that window; the others go on.

    class Stdout:
        def write(self, rows):
            for r in rows:
                print(r.step, r.values)

Backends that need an optional package (TensorBoard, W&B) import it on construction and raise an
ImportError with the install hint when it is missing.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, TextIO

if TYPE_CHECKING:
    from .logger import Row

__all__ = ["Callback", "JSONL", "CSV", "Print", "TensorBoard", "WandB"]


def _spawning() -> bool:
    """Is this a spawned child re-running its parent's modules before its own code starts (the
    `spawn` and `forkserver` start methods: macOS, Windows, DataLoader workers made with
    multiprocessing_context="spawn")? A sink made now is a module-level line of the parent's
    run executed again; its files are the parent's."""
    mp = sys.modules.get("multiprocessing.process")
    return mp is not None and bool(getattr(mp.current_process(), "_inheriting", False))


def _inherited(sink: Any) -> RuntimeError:
    return RuntimeError(f"{sink!r} was made while this spawned process re-imported its parent's "
                        "modules, so its files are the parent's and it writes nothing; create "
                        "loggers that log in the child inside the child's code (or put the "
                        "parent's under `if __name__ == '__main__':`)")


def _dir_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _File:
    """A file written a whole window at a time, unbuffered, so a failed write can be undone.

    Every write() is one os.write loop of bytes prepared beforehand. If it fails (a full disk:
    ENOSPC), a regular file is cut back to its size before the write, so it holds whole rows
    only, and the OSError names the file and the steps that were not written; the next window
    tries again. Nothing is ever read back, so a device or a FIFO (`/dev/full`, `/dev/stdout`)
    can only fail, never hang."""

    def __init__(self, path: str, truncate: bool, exclusive: bool = False):
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND)
        if exclusive:
            flags |= os.O_EXCL
        # os.open follows a symlink: the link's target is written, the link stays.
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.path = path
        self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)

    def unlinked(self) -> bool:
        """Was the file deleted while open (rows written now would reach no one)? One fstat,
        once per window."""
        if self.fd < 0 or not self.regular:
            return False
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return False

    def write(self, data: bytes, rows: list[Row]) -> None:
        """Write `data` (the bytes of `rows`, named in the error if it fails) or nothing."""
        if self.fd < 0:
            raise ValueError(f"{self.path}: the sink is closed")
        start = os.lseek(self.fd, 0, os.SEEK_END) if self.regular else -1
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.fd, view)
                if n <= 0:                                 # never spin on a stuck device
                    raise OSError(errno.EIO, "write() wrote nothing")
                view = view[n:]
        except OSError as exc:
            kept = "the file keeps every row before them"
            if start >= 0:
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    kept = "the last row may be cut short"
            raise OSError(exc.errno, f"{exc.strerror}: {self.path}: {_steps(rows)} not written "
                          f"({kept}); the next window tries again") from exc

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _steps(rows: list[Row]) -> str:
    if not rows:
        return "the header was"
    if len(rows) == 1:
        return f"step {rows[0].step} was"
    return f"steps {rows[0].step}-{rows[-1].step} were"


def _encode(text: str) -> bytes:
    # A name that is not valid Unicode (a lone surrogate, "bad\udc80", from os.fsdecode of a
    # bad file name) is written with a backslash escape instead of failing every window.
    return text.encode("utf-8", "backslashreplace")


# One sink per file in a process: two would interleave their rows (and a CSV's merge would
# fold one table into the other). Keyed by the resolved path; a sink leaves at close().
_claimed: "weakref.WeakValueDictionary[str, _FileSink]" = weakref.WeakValueDictionary()
_claim_lock = threading.Lock()


class _FileSink:
    """What CSV and JSONL share. The file is opened at the first write (or at close(), for a
    run without rows), never at construction, and a sink made while a spawned worker re-imports
    its parent's modules never opens it: a module-level `Logger(sinks=[CSV(...)])` run again in
    every worker must not truncate the parent's file. Construction still fails early on a path
    that cannot be written, and on a path another open sink of this process writes."""

    kind = "file"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._file: _File | None = None
        self._dir: tuple[int, int] | None = None      # the directory of `path` when opened
        self._closed = False
        self._key: str | None = None
        self._inherited = _spawning()
        if self._inherited:
            return
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        exists = os.path.exists(self.path)
        if exists and os.path.isdir(self.path):
            raise IsADirectoryError(errno.EISDIR, f"{self.kind} {self.path}: is a directory; "
                                    "pass a file path")
        if not os.access(self.path if exists else (parent or "."), os.W_OK):
            raise PermissionError(errno.EACCES, f"{self.kind} {self.path}: not writable "
                                  "(permission denied)")
        if not exists or os.path.isfile(self.path):   # streams (/dev/stdout) may be shared
            self._claim(os.path.realpath(self.path))

    def _claim(self, key: str) -> None:
        with _claim_lock:
            other = _claimed.get(key)
            if other is not None and not other._closed:
                raise ValueError(f"{self!r}: {other!r} already writes {key} in this process, "
                                 "and two sinks on one file would mix their rows; close the "
                                 "first one (its Logger's close()) or give each its own path")
            _claimed[key] = self
            self._key = key

    def _release(self) -> None:
        with _claim_lock:
            if self._key is not None and _claimed.get(self._key) is self:
                del _claimed[self._key]

    def _open(self, truncate: bool) -> _File:
        if self._inherited:
            raise _inherited(self)
        if self._closed:
            raise ValueError(f"{self.path}: the sink is closed")
        self._file = _File(self.path, truncate)
        self._dir = _dir_id(self.path)
        return self._file

    def _why_gone(self, lost: str) -> str:
        """What happened to the file `lost` (path or one of its parts), found deleted."""
        if _dir_id(self.path) != self._dir:
            return f"its directory {os.path.dirname(os.path.abspath(self.path))} was deleted " \
                   "during the run"
        if not os.path.lexists(self.path):
            return f"{self.path} was deleted during the run"
        return f"{lost} was deleted during the run"

    def _reopened(self, rows: list[Row]) -> str | None:
        """If the open file was deleted (its directory too, maybe), forget it, so the next write
        starts the file afresh; then say what happened for the error raised after that write."""
        if self._file is None or not self._file.unlinked():
            return None
        why = self._why_gone(self._file.path)
        self._file.close()
        self._file = None
        return (f"{self.kind} {self.path}: {why}, and the rows written before step "
                f"{rows[0].step} went with it; from that step on rows go to a new "
                f"{self.path}")

    def _check_not_deleted(self) -> None:
        """At close(): a file deleted after the last window is reported, not passed over."""
        if self._file is not None and self._file.unlinked():
            raise OSError(errno.ENOENT, f"{self.kind} {self.path}: "
                          f"{self._why_gone(self._file.path)}, and every row written to it "
                          "went with it")

    @property
    def closed(self) -> bool:
        return self._closed

    def flush(self) -> None:
        """Nothing to do: every window reaches the OS when it is written."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def _shut(self) -> None:
        self._closed = True
        self._release()
        if self._file is not None:
            self._file.close()


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


class JSONL(_FileSink):
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
        self._fresh = mode == "w"               # truncated once, at the first open
        super().__init__(path)

    def write(self, rows: list[Row]) -> None:
        if not rows:
            return
        text = "".join([json.dumps({"step": r.step, "time": r.time, **r.values}) + "\n"
                        for r in rows])
        lost = self._reopened(rows)
        file = self._file or self._open(truncate=self._fresh)
        self._fresh = False
        file.write(_encode(text), rows)
        if lost:
            raise OSError(errno.ENOENT, lost)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._file is None and not self._inherited:
                self._open(truncate=self._fresh)          # a run without rows: an empty file
            self._check_not_deleted()
        finally:
            self._shut()


class CSV(_FileSink):
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
        self._parts: list[tuple[str, int, int]] = []   # (path, columns, header bytes)
        self._header: int | None = None                # columns in the current header on disk
        self._folder: str | None = None                # the folder of parts, once there is one
        self._merged: list[tuple[str, int, int]] = []  # parts merged into path, to remove

    @property
    def files(self) -> list[str]:
        """The files this sink wrote so far, in order: `path`, then its parts (if any)."""
        return [p for p, _, _ in self._parts]

    @staticmethod
    def parts(path: str | os.PathLike[str]) -> list[str]:
        """`path` (if it exists), then the parts that CSV sinks writing it left beside it (a run
        going on, or one that crashed before close()), oldest folder first."""
        return _csv_parts(os.fspath(path))

    def write(self, rows: list[Row]) -> None:
        if not rows:
            return
        lost = self._reopened(rows)
        if lost:                             # the table starts again, with every column
            self._parts, self._header, self._folder = [], None, None
        new = _new_names(rows, self._known)
        columns = self.columns + list(new) if new else self.columns
        if new and self._header is not None:
            self._next_part()
        file = self._file or self._open(truncate=True)
        out = io.StringIO()
        w = csv.writer(out)
        header = self._header is None
        if header:
            w.writerow(["step", "time"] + columns)
            header_bytes = len(_encode(out.getvalue()))
        w.writerows([r.step, repr(r.time)] + [r.values.get(c, "") for c in columns] for r in rows)
        file.write(_encode(out.getvalue()), rows)
        if header:
            self._header = len(columns)
            if file.regular:
                self._parts.append((file.path, len(columns), header_bytes))
        if new:
            self.columns = columns
            self._known.update(new)
        if lost:
            raise OSError(errno.ENOENT, lost)

    def _next_part(self) -> None:
        assert self._file is not None            # a header was written: the file is open
        if not self._file.regular:
            self._header = None              # a stream: the wider header is the next line
            return
        if self._folder is None:
            self._folder = _parts_folder(self.path)
        part = _File(os.path.join(self._folder, f"{len(self._parts)}.csv"), truncate=True,
                     exclusive=True)
        self._file.close()
        self._file, self._header = part, None

    def close(self) -> None:
        if self._closed:
            if len(self._parts) > 1:
                self._merge()                # a close() cut short in its merge: finish it
            self._remove_merged()
            return
        try:
            if self._inherited:
                return
            file = self._file or self._open(truncate=True)
            if self._header is None and not self._parts and file.regular:
                file.write(b"step,time\r\n", [])          # an empty table, still a CSV
            if len(self._parts) < 2:                          # else the merge says it
                self._check_not_deleted()
        finally:
            self._shut()
        if len(self._parts) > 1:
            self._merge()

    def _merge(self) -> None:
        """Write path's target afresh with the final header and every part's rows, then remove
        the parts and their folder. On failure the parts stay and the OSError says where."""
        missing = [p for p, _, _ in self._parts if not os.path.lexists(p)]
        if missing:
            raise _unmergeable(self.path, self._why_gone(missing[0]), missing,
                               [p for p, _, _ in self._parts if p not in missing])
        target = os.path.realpath(self.path)
        folder, name = os.path.split(target)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".syncless-merge", dir=folder)
        try:
            _write_merged(fd, self.columns, self._parts)
            shutil.copymode(target, tmp)
            # The parts are forgotten as the merged file takes path's place, whatever lands
            # between (a Ctrl-C): a close() called again then merges once, never twice.
            parts, self._parts, self._merged = self._parts, self._parts[:1], self._parts[1:]
            try:
                os.replace(tmp, target)
            except BaseException:
                if os.path.lexists(tmp):     # not renamed: the parts still hold the rows
                    self._parts, self._merged = parts, []
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                raise
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            names = ", ".join(p for p, _, _ in self._parts)
            raise OSError(exc.errno, f"{exc.strerror}: CSV {self.path}: merging its parts "
                          f"failed; every row is still in {names} (each with its own "
                          "header)") from exc
        self._remove_merged()

    def _remove_merged(self) -> None:
        """The parts a merge took in, and their folder (kept if anyone put a file in it)."""
        while self._merged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._merged[-1][0])
            self._merged.pop()
        if self._folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._folder)


def _new_names(rows: list[Row], known: set[str]) -> dict[str, None]:
    """Names of `rows` not in `known`, in order of first appearance (a dict: O(1) membership)."""
    new: dict[str, None] = {}
    for r in rows:
        for name in r.values:
            if name not in known:
                new[name] = None
    return new


def _parts_folder(path: str) -> str:
    """A new hidden folder beside `path` for its parts: `.m.csv.syncless-<time>-<random>`."""
    parent, name = os.path.split(path)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return os.path.abspath(tempfile.mkdtemp(             # a later chdir changes nothing
        prefix=f".{name}.syncless-{stamp}-", dir=parent or "."))


def _unmergeable(path: str, why: str, missing: list[str], kept: list[str]) -> OSError:
    lost = "every row went with it" if why.startswith("its directory") else \
        f"the rows written to {', '.join(missing)} went with it"
    return OSError(errno.ENOENT, f"CSV {path}: {why}, so its parts cannot be merged; {lost}"
                   + (f"; the others are in {', '.join(kept)} (each a complete CSV)"
                      if kept else ""))


def _write_merged(fd: int, columns: list[str], parts: list[tuple[str, int, int]]) -> None:
    """The merged table into fd (closed after): the final header, then every part's rows, those
    of narrower parts padded with empty cells."""
    with os.fdopen(fd, "wb") as out:
        head = io.StringIO()
        csv.writer(head).writerow(["step", "time"] + columns)
        out.write(_encode(head.getvalue()))
        for path, width, header_bytes in parts:
            _copy_rows(path, header_bytes, out, pad=b"," * (len(columns) - width) + b"\r\n")


def _csv_parts(path: str) -> list[str]:
    """CSV.parts: path, then the numbered parts in the folders beside it, oldest first."""
    parent, name = os.path.split(path)
    found = [path] if os.path.lexists(path) else []
    prefix = f".{name}.syncless-"
    try:
        folders = sorted(f for f in os.listdir(parent or ".") if f.startswith(prefix))
    except OSError:
        return found
    for folder in folders:
        folder = os.path.join(parent, folder)
        with contextlib.suppress(OSError):
            numbered = [f for f in os.listdir(folder) if f[:-4].isdigit() and f.endswith(".csv")]
            found += [os.path.join(folder, f) for f in sorted(numbered, key=lambda f: int(f[:-4]))]
    return found


def _copy_rows(path: str, header_bytes: int, out: BinaryIO, pad: bytes) -> None:
    """The rows of a CSV part (after its header) into `out`, each row's line end replaced by
    `pad` (the empty cells of the columns the part lacks, then the line end)."""
    with open(path, "rb") as part:
        part.seek(header_bytes)
        rest = b""
        while True:
            chunk = part.read(1 << 20)
            if not chunk:
                break
            chunk = rest + chunk
            cut = chunk.rfind(b"\r\n") + 2      # data rows hold no newline
            out.write(chunk[:cut].replace(b"\r\n", pad))
            rest = chunk[cut:]
        if rest:                                   # never: rows end in \r\n
            out.write(rest + pad)


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
    return ImportError(f"this sink needs {package}: pip install syncless[{extra}]")


class TensorBoard:
    """Write every row as scalars to a TensorBoard event file, at its step and wall time (the
    host time of the log() call). Pass a log directory (extra keyword arguments go to torch's
    SummaryWriter) or an existing writer: torch's, tensorboardX's or syncless.tensorboard's."""

    def __init__(self, log_dir: str | os.PathLike[str] | Any = None, **writer_kwargs: Any):
        self.writer: Any
        self._add: Callable[[str, float, int, float], Any] | None
        if log_dir is not None and hasattr(log_dir, "add_scalar"):
            self.writer, self._owned = log_dir, False
        elif _spawning():
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
            raise _inherited(self)
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
