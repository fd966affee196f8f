"""What the script writes, and a place where --verify's runs of it can write without harm.

The doctor's own run of the script is the user's run: it writes what the script writes. The runs
--verify adds must leave nothing behind. Each starts in a scratch copy of the working directory:
real folders where the script wrote, links to everything else (its data, its config), and none of
the files the doctor's own run created (a log it appends to, a checkpoint) — so a relative path
writes into the scratch folder, which is removed after the run, and reads find what they found.
Experiment trackers are switched off by their own environment switches.

That is isolation only when the script writes under its working directory. While the doctor's run
goes, a Watch notes every file opened for writing (Python's audit hook, and torch.save's path) and
every network connection; afterwards it compares the working directory with how it was. A write
outside the working directory (a path the script computes: /data/ckpt, ~/runs) or a connection to
a host that is not this machine's cannot be kept from the runs; then they do not run by default,
and the report says why."""
from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from typing import Any, Callable

__all__ = ["Watch", "TRACKERS_OFF", "under"]

# Experiment trackers off by their own switches, in the runs --verify makes (values that are
# not the user's choice: their runs are not the user's runs). TensorBoard (and syncless's
# drop-in for it) writes event files under a relative log dir by default: into the scratch folder.
TRACKERS_OFF = {
    "WANDB_MODE": "disabled",                 # wandb.init() returns a run that does nothing
    "COMET_AUTO_LOG_DISABLE": "true",         # comet_ml's `disabled`: no network, no files
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",     # transformers' MLflowCallback
    "NEPTUNE_MODE": "debug",                  # neptune: nothing stored or sent
    "CLEARML_OFFLINE_MODE": "1",
    "HF_HUB_OFFLINE": "1",                    # no Hub uploads (push_to_hub); reads from cache
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
MAX_ENTRIES = 50_000       # a working directory larger than this is not walked: no isolation
# Hosts whose connections the switches above cover (reads of the Hub's cache instead).
COVERED_HOSTS = ("huggingface.co", "hf.co")


def _cache_dirs() -> list[str]:
    """Folders whose writes are caches, not the script's outputs: temp, ~/.cache and the like."""
    home = os.path.expanduser("~")
    dirs = ["/dev", "/proc", "/sys", os.path.join(home, ".cache"), os.path.join(home, ".triton"),
            os.path.join(home, ".nv"), os.path.join(home, ".config"),
            os.path.join(home, ".local", "share"), os.path.join(home, ".netrc")]
    for var in ("XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR",
                "TRITON_CACHE_DIR", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        if os.environ.get(var):
            dirs.append(os.environ[var])
    return [os.path.realpath(d) for d in dirs]


# What the temp folder holds that is no output of the script: names tempfile makes (a prefix and 8
# random characters: mkdtemp, NamedTemporaryFile), and the caches of torch, triton and
# multiprocessing. A fixed name there (/tmp/ckpt.pt) is a file the script writes.
_TEMP_NAME = re.compile(r"(.*[a-z0-9_]{8}|torchinductor_.*|triton.*|pymp-.*|syncless-.*|"
                        r"torch_.*|tmp.*)$")


def _temp_dirs() -> set[str]:
    return {os.path.realpath(tempfile.gettempdir()), "/tmp", "/var/tmp", "/dev/shm"}


def _temporary(path: str, temps: set[str]) -> bool:
    for temp in temps:
        if path == temp:
            return True
        if under(path, temp):
            first = os.path.relpath(path, temp).split(os.sep)[0]
            return bool(_TEMP_NAME.fullmatch(first)) and "." not in first
    return False


def _local(host: str) -> bool:
    return host in ("localhost", "0.0.0.0", "::", "::1", "") or host.startswith("127.") or \
        host.startswith("::ffff:127.")


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def snapshot(root: str) -> dict[str, tuple[int, int]] | None:
    """relative path -> (mtime_ns, size) of every file and folder under `root` (links not
    followed); None past MAX_ENTRIES."""
    seen: dict[str, tuple[int, int]] = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            rel = os.path.relpath(e.path, root)
            seen[rel] = (st.st_mtime_ns, st.st_size)
            if len(seen) > MAX_ENTRIES:
                return None
            if e.is_dir(follow_symlinks=False):
                seen[rel] = (-1, -1)          # a folder: only whether it is there counts
                stack.append(e.path)
    return seen


class Watch:
    """Notes what the doctor's own run of the script writes and which hosts it connects to."""

    def __init__(self, cwd: str, script: str) -> None:
        self.cwd = os.path.realpath(cwd)
        self.script_dir = os.path.realpath(os.path.dirname(os.path.abspath(script)))
        self.before = snapshot(self.cwd)
        self.outside: set[str] = set()        # files written outside the working directory
        self.hosts: set[str] = set()          # hosts connected to (names where resolved)
        self._last_name: str | None = None    # the host name resolved last
        # Read now: the audit hook may run inside tempfile, under its lock (gettempdir()'s
        # first call writes a probe file), and must call nothing that takes it.
        self._caches = _cache_dirs()
        self._temps = _temp_dirs()
        self._on = False
        self._undo: Callable[[], None] | None = None
        self.created: set[str] = set()        # relative paths the run created ...
        self.changed: set[str] = set()        # ... and changed, under the working directory
        self.too_large = self.before is None

    def __enter__(self) -> "Watch":
        self._on = True
        if not getattr(sys, "_syncless_audit", False):   # an audit hook is for the process' life
            sys.addaudithook(_audit)
            setattr(sys, "_syncless_audit", True)
        _watches.append(self)
        self._undo = _watch_torch_save(self._wrote)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._on = False
        if self in _watches:
            _watches.remove(self)
        if self._undo is not None:
            self._undo()
        after = snapshot(self.cwd) if self.before is not None else None
        if self.before is None or after is None:
            self.too_large = True
            return
        self.created = {p for p in after if p not in self.before}
        self.changed = {p for p, st in after.items()
                        if p in self.before and st != self.before[p] and st[0] != -1}

    # ---- from the audit hook --------------------------------------------------------------------

    def _wrote(self, path: Any) -> None:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return                                # a file descriptor
        try:
            full = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        if under(full, self.cwd) or "__pycache__" in full or full.endswith(".pyc"):
            return
        if any(under(full, d) for d in self._caches) or _temporary(full, self._temps):
            return
        self.outside.add(full)

    def _connected(self, address: Any) -> None:
        if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
            return                                # a Unix socket: this machine
        if not _local(address[0]):
            # The name it was resolved from, when a resolution came just before (requests and
            # urllib resolve, then connect): the report names hosts, not addresses.
            self.hosts.add(self._last_name or address[0])
        self._last_name = None

    def _resolved(self, host: Any) -> None:
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        self._last_name = host if isinstance(host, str) and not _local(host) else None

    # ---- the decision ---------------------------------------------------------------------------

    def uncovered_hosts(self) -> list[str]:
        return sorted(h for h in self.hosts
                      if not any(h == c or h.endswith("." + c) for c in COVERED_HOSTS))

    def why_not(self) -> str | None:
        """Why --verify's runs cannot be kept from harm (None: they can)."""
        if self.too_large:
            return (f"the working directory holds more than {MAX_ENTRIES} files: what the "
                    "script writes there could not be told apart")
        if self.outside:
            shown = sorted(self.outside)
            more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
            return ("the script wrote outside its working directory (" + ", ".join(shown[:3]) +
                    more + "): runs of it would write there again")
        hosts = self.uncovered_hosts()
        if hosts:
            return ("the script connected to " + ", ".join(hosts[:3]) +
                    ": runs of it could send or change something there")
        return None


_watches: list[Watch] = []


# Audit events that change a path, and the index of that path in their arguments.
_PATH_EVENTS = {"os.rename": 1, "os.remove": 0, "os.rmdir": 0, "os.mkdir": 0, "os.truncate": 0,
                "shutil.rmtree": 0, "shutil.move": 1, "shutil.copyfile": 1, "os.symlink": 1,
                "os.link": 1, "os.chmod": 0}


_inside = threading.local()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _watches or getattr(_inside, "busy", False):
        return
    _inside.busy = True                    # an event the hook's own calls raise: not looked at
    try:
        _note(event, args)
    finally:
        _inside.busy = False


def _note(event: str, args: tuple[Any, ...]) -> None:
    if event == "open":
        path, mode, flags = args
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (mode is None and isinstance(flags, int) and
                 flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND)):
            for w in _watches:
                w._wrote(path)
    elif event in _PATH_EVENTS:
        for w in _watches:
            w._wrote(args[_PATH_EVENTS[event]])
    elif event in ("socket.connect", "socket.sendto"):
        for w in _watches:
            w._connected(args[1])
    elif event == "socket.getaddrinfo":
        for w in _watches:
            w._resolved(args[0])


def _watch_torch_save(wrote: Callable[[Any], None]) -> Callable[[], None]:
    """torch.save(obj, path) opens the file in C++ (no audit event): note its path."""
    import torch.serialization as ser
    original = getattr(ser, "_open_zipfile_writer", None)
    if original is None:
        return lambda: None

    def opened(name_or_buffer: Any) -> Any:
        wrote(name_or_buffer)
        return original(name_or_buffer)

    setattr(ser, "_open_zipfile_writer", opened)

    def undo() -> None:
        if getattr(ser, "_open_zipfile_writer", None) is opened:
            setattr(ser, "_open_zipfile_writer", original)
    return undo
