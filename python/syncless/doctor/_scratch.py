"""Scratch working directories for --verify's runs: each a copy of the user's working directory
as the doctor's own run found it, written into freely and removed after the run (see _isolate).

A script may read beside its folder (pytorch/examples' vae and mnist read `../data`): a run's
folder sits as deep in its scratch tree as the working directory's last LEVELS folders, and each
level above it holds links to what the real one holds, so `../data` and `../../x` read the user's
files. A new name there is made in the scratch tree (a write the doctor's own run made outside
the working directory keeps --verify off by default: see _isolate)."""
from __future__ import annotations

import os
import shutil
import tempfile

from ._isolate import Watch, under

__all__ = ["Scratch", "own_tempdir"]

LEVELS = 2             # folders above the working directory whose entries a run's folder sees
MAX_SIBLINGS = 1000    # a folder holding more (/tmp, a home of many projects) is not mirrored


def own_tempdir(prefix: str) -> str:
    """A new temporary folder `<prefix><pid>-<random>`, after removing this user's folders of
    the same prefix whose process is gone (a doctor killed by SIGTERM or SIGKILL removes nothing
    itself: its folder goes at the next run)."""
    base = tempfile.gettempdir()
    try:
        entries = list(os.scandir(base))
    except OSError:
        entries = []
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        pid = e.name[len(prefix):].split("-", 1)[0]
        try:
            if not pid.isdigit() or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)               # alive (or another user's): kept
        except ProcessLookupError:
            shutil.rmtree(e.path, ignore_errors=True)
        except OSError:
            continue
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


class Scratch:
    """Fresh working directories for --verify's runs, all under one temporary folder, removed by
    close(): each a copy of the user's working directory as the doctor's run found it (see the
    module's docstring)."""

    def __init__(self, cwd: str, watch: Watch | None) -> None:
        self.cwd = os.path.realpath(cwd)
        self.root = own_tempdir("syncless-verify-")
        self.created = watch.created if watch is not None else set()
        self.changed = watch.changed if watch is not None else set()
        # Folders the script wrote in: made for real (their entries linked one by one).
        self._real: set[str] = {""}
        for p in self.created | self.changed:
            parts = p.split(os.sep)
            for i in range(1, len(parts)):
                self._real.add(os.sep.join(parts[:i]))
        self.count = 0
        self._tops: dict[str, str] = {}
        # The folders above the working directory, nearest first, as (folder, the name in it
        # that leads down), while they are few enough to link entry by entry.
        self._above: list[tuple[str, str]] = []
        below = self.cwd
        for _ in range(LEVELS):
            up = os.path.dirname(below)
            if up == below:
                break
            try:
                if len(os.listdir(up)) > MAX_SIBLINGS:
                    break
            except OSError:
                break
            self._above.append((up, os.path.basename(below)))
            below = up

    def make(self) -> str:
        """A new working directory for one run."""
        self.count += 1
        top = os.path.join(self.root, f"run{self.count}")
        here = top
        for up, name in reversed(self._above):
            os.makedirs(here, exist_ok=True)
            try:
                entries = list(os.scandir(up))
            except OSError:
                entries = []
            for e in entries:
                if e.name != name:
                    os.symlink(e.path, os.path.join(here, e.name))
            here = os.path.join(here, name)
        self._mirror("", here)
        self._tops[here] = top
        return here

    def _mirror(self, rel: str, into: str) -> None:
        os.makedirs(into, exist_ok=True)
        try:
            entries = list(os.scandir(os.path.join(self.cwd, rel)))
        except OSError:
            return
        for e in entries:
            sub = os.path.join(rel, e.name) if rel else e.name
            target = os.path.join(into, e.name)
            if sub in self.created:
                continue                          # the doctor's run made it: the run makes its own
            if sub in self._real and e.is_dir(follow_symlinks=False):
                self._mirror(sub, target)
            elif sub in self.changed and e.is_file(follow_symlinks=False):
                shutil.copy2(e.path, target)      # the script rewrites it: its own copy
            else:
                os.symlink(e.path, target)

    def inside(self, path: str) -> str:
        """`path` (under the user's working directory) as seen from a run's directory."""
        full = os.path.realpath(path)
        return os.path.relpath(full, self.cwd) if under(full, self.cwd) else path

    def drop(self, here: str) -> None:
        shutil.rmtree(self._tops.pop(here, here), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
