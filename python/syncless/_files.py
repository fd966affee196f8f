"""How a file sink's file survives a long run: what the JSONL and CSV sinks (sinks.py) share.

- A window is one unbuffered write of bytes prepared beforehand (`File`); a failed one (a full
  disk) is cut back, so the file holds whole rows only, and the error names the steps lost.
- One sink per file in a process (`FileSink`): two would interleave their rows.
- The file is opened at the first write, never at construction, and never by a sink made while a
  spawned worker re-imports its parent's modules (`spawning`): those files are the parent's.
- A file (or its directory) deleted during the run is made again, and the error says which rows
  went with it.
- A table whose header widens (`Table`, the CSV sink) starts a new part per wider header and
  merges the parts into one file at close(), so nothing written is ever rewritten during the run.

The sinks decide what the bytes are (JSON lines, CSV rows and headers); this module decides how
they reach the disk. Imports rows.py only, never the logger.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, BinaryIO

from .rows import Row

__all__ = ["File", "FileSink", "Table", "encode", "inherited", "spawning", "table_parts"]


def spawning() -> bool:
    """Is this a spawned child re-running its parent's modules before its own code starts (the
    `spawn` and `forkserver` start methods: macOS, Windows, DataLoader workers made with
    multiprocessing_context="spawn")? A sink made now is a module-level line of the parent's
    run executed again; its files are the parent's."""
    mp = sys.modules.get("multiprocessing.process")
    return mp is not None and bool(getattr(mp.current_process(), "_inheriting", False))


def inherited(sink: Any) -> RuntimeError:
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


class File:
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


def encode(text: str) -> bytes:
    # A name that is not valid Unicode (a lone surrogate, "bad\udc80", from os.fsdecode of a
    # bad file name) is written with a backslash escape instead of failing every window.
    return text.encode("utf-8", "backslashreplace")


# One sink per file in a process: two would interleave their rows (and a CSV's merge would
# fold one table into the other). Keyed by the resolved path; a sink leaves at close().
_claimed: "weakref.WeakValueDictionary[str, FileSink]" = weakref.WeakValueDictionary()
_claim_lock = threading.Lock()


class FileSink:
    """What CSV and JSONL share: a sink that writes one file, a window at a time. The file is
    opened at the first write (or at close(), for a run without rows), never at construction,
    and a sink made while a spawned worker re-imports its parent's modules never opens it: a
    module-level `Logger(sinks=[CSV(...)])` run again in every worker must not truncate the
    parent's file. Construction still fails early on a path that cannot be written, and on a
    path another open sink of this process writes. fresh: the first open truncates the file
    (else it appends)."""

    kind = "file"

    def __init__(self, path: str | os.PathLike[str], fresh: bool = False):
        self.path = os.fspath(path)
        self._fresh = fresh                           # truncated once, at the first open
        self._file: File | None = None
        self._dir: tuple[int, int] | None = None      # the directory of `path` when opened
        self._closed = False
        self._key: str | None = None
        self._inherited = spawning()
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

    def _open(self, truncate: bool) -> File:
        if self._inherited:
            raise inherited(self)
        if self._closed:
            raise ValueError(f"{self.path}: the sink is closed")
        self._file = File(self.path, truncate)
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

    def _append(self, data: bytes, rows: list[Row]) -> None:
        """One window: `data` (the bytes of `rows`) at the end of the file, opened first if it
        is not open yet. A file deleted since the last window is made again, and the error
        raised after this write says which rows went with it."""
        lost = self._reopened(rows)
        file = self._file or self._open(truncate=self._fresh)
        self._fresh = False
        file.write(data, rows)
        if lost:
            raise OSError(errno.ENOENT, lost)

    def _close_file(self) -> None:
        """close(): a run without rows leaves an empty file; a file deleted after the last
        window is reported, not passed over."""
        if self._closed:
            return
        try:
            if self._file is None and not self._inherited:
                self._open(truncate=self._fresh)
            self._check_not_deleted()
        finally:
            self._shut()

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


class Table(FileSink):
    """A FileSink for a CSV table whose header widens during the run, without rewriting what is
    written: a window that brings new columns starts a new part, with the wider header, in a
    hidden folder beside the file (`.m.csv.syncless-<time>-<random>/1.csv`, `2.csv`, ...; each
    a complete CSV, so a crashed run leaves files that read as they are), and close() merges
    the parts into `path` in one pass, rows of narrower parts padded with empty cells. A path
    that is not a regular file (`/dev/stdout`, a FIFO) gets the wider header as a new line of
    the stream instead. The sink (sinks.CSV) makes the bytes: headers and rows; rows end in
    "\\r\\n" (the csv module's line end) and hold no newline of their own."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path, fresh=True)
        self._parts: list[tuple[str, int, int]] = []   # (path, columns, header bytes)
        self._header: int | None = None                # columns in the current header on disk
        self._folder: str | None = None                # the folder of parts, once there is one
        self._merged: list[tuple[str, int, int]] = []  # parts merged into path, to remove

    @property
    def files(self) -> list[str]:
        """The files this sink wrote so far, in order: `path`, then its parts (if any)."""
        return [p for p, _, _ in self._parts]

    def _write_table(self, rows: list[Row], width: int, head: bytes, body: bytes) -> None:
        """One window: `body`, the bytes of `rows` in a table `width` columns wide, after `head`
        (the header line of those columns) where the file needs one: its first window, a wider
        table (a new part), a file made again after it was deleted."""
        lost = self._reopened(rows)
        if lost:                             # the table starts again, with every column
            self._parts, self._header, self._folder = [], None, None
        if self._header is not None and width != self._header:
            self._next_part()
        file = self._file or self._open(truncate=True)
        header = self._header is None
        file.write(head + body if header else body, rows)
        if header:
            self._header = width
            if file.regular:
                self._parts.append((file.path, width, len(head)))
        if lost:
            raise OSError(errno.ENOENT, lost)

    def _next_part(self) -> None:
        assert self._file is not None            # a header was written: the file is open
        if not self._file.regular:
            self._header = None              # a stream: the wider header is the next line
            return
        if self._folder is None:
            self._folder = _parts_folder(self.path)
        part = File(os.path.join(self._folder, f"{len(self._parts)}.csv"), truncate=True,
                    exclusive=True)
        self._file.close()
        self._file, self._header = part, None

    def _close_table(self, head: bytes, width: int) -> None:
        """close(): a table without rows gets `head` alone (still a CSV); parts are merged under
        `head`, the header of all `width` columns. A close() cut short in its merge (a Ctrl-C)
        is finished by the next."""
        if self._closed:
            if len(self._parts) > 1:
                self._merge(head, width)     # a close() cut short in its merge: finish it
            self._remove_merged()
            return
        try:
            if self._inherited:
                return
            file = self._file or self._open(truncate=True)
            if self._header is None and not self._parts and file.regular:
                file.write(head, [])                        # an empty table, still a CSV
            if len(self._parts) < 2:                        # else the merge says it
                self._check_not_deleted()
        finally:
            self._shut()
        if len(self._parts) > 1:
            self._merge(head, width)

    def _merge(self, head: bytes, width: int) -> None:
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
            _write_merged(fd, head, width, self._parts)
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


def _write_merged(fd: int, head: bytes, width: int, parts: list[tuple[str, int, int]]) -> None:
    """The merged table into fd (closed after): the final header, then every part's rows, those
    of narrower parts padded with empty cells."""
    with os.fdopen(fd, "wb") as out:
        out.write(head)
        for path, columns, header_bytes in parts:
            _copy_rows(path, header_bytes, out, pad=b"," * (width - columns) + b"\r\n")


def table_parts(path: str) -> list[str]:
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
