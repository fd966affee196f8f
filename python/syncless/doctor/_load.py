"""Whether other processes compete for this process's CPUs while the doctor measures.

The doctor's timings, and the worker counts it prescribes, hold for the load they were measured
under: the same CPU script gave 2, 14 and 10 workers in three runs as the host's load changed. A
LoadMeter reads the busy time of the CPUs this process may run on (/proc/stat) and the CPU time of
this process tree (this process, its live descendants, and the children it has reaped: a
DataLoader's workers, the doctor's own side loaders and runs); what the CPUs did beyond it is
other processes' load. Linux only (elsewhere: not measured)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from time import perf_counter

from ._loader import cpu_count

__all__ = ["Load", "LoadMeter", "LOADED", "process_age_s"]

LOADED = 0.25            # others keeping this share of the CPUs busy (at least half a CPU): loaded
MIN_WALL_S = 0.5         # over less, /proc/stat's 10-ms ticks say nothing: never "loaded"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Load:
    """CPUs kept busy over `wall_s`, on average: by this process tree and by everything else."""
    wall_s: float
    cpus: int
    own_cpus: float
    other_cpus: float

    @property
    def loaded(self) -> bool:
        return self.wall_s >= MIN_WALL_S and self.other_cpus >= max(0.5, LOADED * self.cpus)

    def text(self) -> str:
        return (f"other processes kept {self.other_cpus:.1f} of the {self.cpus} CPUs this "
                f"process may use busy during the run ({self.wall_s:.0f} s; this process and its "
                f"children {self.own_cpus:.1f}: /proc/stat less their own CPU time)")

    def as_dict(self) -> dict[str, object]:
        return {"wall_s": self.wall_s, "cpus": self.cpus, "own_cpus": self.own_cpus,
                "other_cpus": self.other_cpus, "loaded": self.loaded}


def _busy_s(cpus: set[int]) -> float | None:
    """Busy seconds so far of the CPUs numbered in `cpus` (user, nice, system, irq, softirq,
    steal: all but idle and iowait)."""
    total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                total += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    return total / _TICK


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def process_age_s() -> float:
    """Seconds since this process started: the interpreter's start and its imports, which the
    user's clock counts and the doctor's own does not (0 where /proc does not say)."""
    stat = _stat("self")
    try:
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return max(0.0, up - int(stat[19]) / _TICK) if stat else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def tree_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds of process `pid` (default: this one) and its tree: its own, its live
    descendants', and what its reaped children (and theirs) used."""
    root = pid or os.getpid()
    fields = _stat(root)
    if fields is None:
        return None
    # utime, stime, cutime, cstime: fields 14-17 of stat, 11-14 past the command's ")"
    total = sum(int(x) for x in fields[11:15])
    todo = _children(root)
    seen = set()
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        f = _stat(child)
        if f is not None:
            total += sum(int(x) for x in f[11:15])   # into our cutime once we reap it
            todo += _children(child)
    return total / _TICK


class LoadMeter:
    """Started at construction; read() gives the Load since then (None where unmeasured)."""

    def __init__(self) -> None:
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = set(range(os.cpu_count() or 1))
        self.t = perf_counter()
        self.busy = _busy_s(self.cpus)
        self.own = tree_cpu_s()

    def read(self) -> Load | None:
        busy, own = _busy_s(self.cpus), tree_cpu_s()
        wall = perf_counter() - self.t
        if busy is None or own is None or self.busy is None or self.own is None or wall <= 0:
            return None
        mine = own - self.own
        others = max(0.0, (busy - self.busy) - mine)
        return Load(wall, cpu_count(), mine / wall, others / wall)
