"""The DataLoader side: its settings, the time its iterators block the training thread, and how
many workers it needs (from the per-worker batch time measured against the step it must feed)."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping
from time import perf_counter, process_time, thread_time
from typing import Any, Callable, Iterator

__all__ = ["cpu_count", "ready_batches", "loader_settings", "timed_dataloaders", "WorkerPlan",
           "plan_workers", "batch_spec", "handoff_ms"]

HEADROOM = 1.1      # workers for 10% more throughput than the step needs: batch times jitter


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def loader_settings(loader: Any) -> dict[str, Any]:
    """The DataLoader settings the starvation advice depends on, from a DataLoader or one of its
    iterators; {} for anything else."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    if isinstance(loader, DataLoader):
        return {"num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
                "persistent_workers": loader.persistent_workers,
                "prefetch_factor": loader.prefetch_factor, "batch_size": loader.batch_size}
    if isinstance(loader, _BaseDataLoaderIter):
        return {"num_workers": loader._num_workers, "pin_memory": loader._pin_memory,
                "persistent_workers": getattr(loader, "_persistent_workers", False),
                "prefetch_factor": getattr(loader, "_prefetch_factor", None),
                "batch_size": None}
    return {}


def ready_batches(it: Any) -> int | None:
    """Batches a DataLoader iterator's workers have made and the steps have not taken yet (its
    queue, and those that came out of order); None where the queue cannot say (macOS)."""
    try:
        queued = it._data_queue.qsize()
    except (AttributeError, NotImplementedError, OSError):
        return None
    return int(queued) + sum(1 for v in getattr(it, "_task_info", {}).values() if len(v) == 2)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
WORKER_READ_S = 0.05    # read the workers' CPU time at most this often (a /proc read per worker)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK      # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class _WorkerCpu:
    """The CPU share of an iterator's worker processes: CPU seconds over worker-wall seconds,
    read at most every WORKER_READ_S. Tells workers that compute (a CPU each) from workers that
    mostly wait (disk, network, a sleep), which more of them fix without more CPUs. When the
    workers together keep the CPUs they may have busy, they compute, whatever each one's share
    (too many workers on too few CPUs): then the share counted is 1."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t = perf_counter()
        self.cpu = self._read()

    def _read(self) -> float | None:
        total = 0.0
        for pid in self.pids:
            c = process_cpu_s(pid)
            if c is None:
                return None
            total += c
        return total

    def delta(self) -> tuple[float, float] | None:
        """(worker-wall seconds, CPU seconds) since the last reading; None: not yet, or unread."""
        now = perf_counter()
        if now - self.t < WORKER_READ_S or self.cpu is None:
            return None
        cpu = self._read()
        if cpu is None:
            self.cpu = None
            return None
        elapsed, used = now - self.t, cpu - self.cpu
        self.t, self.cpu = now, cpu
        if used / elapsed >= 0.5 * max(1, cpu_count() - 1):     # CPUs the workers kept busy
            return elapsed * len(self.pids), elapsed * len(self.pids)
        return elapsed * len(self.pids), used


# ---- the hand-over: what taking a ready batch from a worker costs the training thread ----------

HANDOFF_MAX_BYTES = 32 << 20    # larger batches: not measured (their making dwarfs the hand-over)
HANDOFF_SAMPLES = 15


class _Tensor:
    """A tensor's shape and dtype in a batch's spec."""
    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype = shape, dtype


def batch_spec(batch: Any, depth: int = 0) -> Any:
    """The structure of `batch` (dicts, lists, tuples) with each CPU tensor as its shape and
    dtype, other leaves as they are; None when it holds no tensor, a tensor off the CPU (a
    collate that moves batches to the GPU: no worker made that), or more than
    HANDOFF_MAX_BYTES."""
    import torch
    sizes: list[int] = []

    def walk(x: Any, depth: int) -> Any:
        if depth > 8:
            raise ValueError("too deep")
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise ValueError("off the CPU")
            sizes.append(x.nelement() * x.element_size())
            return _Tensor(tuple(x.shape), x.dtype)
        if isinstance(x, Mapping):
            return {k: walk(v, depth + 1) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, depth + 1) for v in x]
        return x if isinstance(x, (int, float, str, bool, type(None))) else None
    try:
        spec = walk(batch, depth)
    except ValueError:
        return None
    return spec if sizes and sum(sizes) <= HANDOFF_MAX_BYTES else None


def _made(spec: Any) -> Any:
    import torch
    if isinstance(spec, _Tensor):
        return torch.zeros(spec.shape, dtype=spec.dtype)
    if isinstance(spec, dict):
        return {k: _made(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_made(v) for v in spec]
    return spec


class _Copies:
    """A dataset whose every item is the same batch (batch_size=None: handed over as it is)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> Any:
        return self.batch


def handoff_ms(spec: Any) -> float | None:
    """The training thread's time (ms) to take one batch of `spec`'s shapes that a worker process
    has made already: the queue read and the tensors' rebuild from shared memory. A step whose
    loader keeps up still waits this long for each batch, however many workers it has (on a
    2-core host: 1.04 and 3.09 ms for the batches of Lightning's and HF's docs scripts, whose
    data waits were 0.24 and 0.60 ms with the batches made on the training thread). Measured
    with one forked worker serving copies of the batch, each taken once the worker has it ready;
    the median of HANDOFF_SAMPLES. None when it cannot be measured."""
    import multiprocessing
    from torch.utils.data import DataLoader
    # Forked, as a Linux DataLoader's workers are (elsewhere a fork is unsafe, and the queue
    # cannot say when a batch is ready).
    if spec is None or not sys.platform.startswith("linux") or \
            "fork" not in multiprocessing.get_all_start_methods():
        return None
    it: Any = None
    try:
        copies: Any = _Copies(_made(spec))     # a map-style dataset (no torch import here)
        it = iter(DataLoader(copies, batch_size=None, num_workers=1,
                             prefetch_factor=2, multiprocessing_context="fork"))
        samples = []
        for i in range(3 + HANDOFF_SAMPLES):
            waited = perf_counter()
            while ready_batches(it) == 0 and perf_counter() - waited < 1.0:
                time.sleep(0.0005)
            if not ready_batches(it):
                return None                    # the worker is slow or gone: nothing measured
            t = perf_counter()
            next(it)
            if i >= 3:
                samples.append(perf_counter() - t)
        return statistics.median(samples) * 1e3
    except Exception:                          # a failed probe must not fail the report
        return None
    finally:
        if it is not None:
            with contextlib.suppress(Exception):
                it._shutdown_workers()


def _worker_pids(it: Any) -> list[int]:
    try:
        return [w.pid for w in it._workers if w.pid is not None]
    except (AttributeError, TypeError):
        return []


@contextlib.contextmanager
def timed_dataloaders(monitor: Any,
                      on_next: Callable[[], None] | None = None) -> Iterator[None]:
    """Time every DataLoader iterator's next() into `monitor.add_data_wait` (for steps that fetch
    their own batches), and the CPU share of the loading into `monitor.add_data_cpu`: the
    training thread's while it makes the batches (num_workers=0), else the worker processes'.
    `on_next()` runs before each next() (a step boundary). Restores DataLoader on exit."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    original = _BaseDataLoaderIter.__next__
    # id(iterator) -> (_WorkerCpu, the iterator's worker pids)
    workers: dict[int, tuple[_WorkerCpu, list[int]]] = {}

    def timed_next(self: Any) -> Any:
        if on_next is not None:
            on_next()
        if hasattr(monitor, "loader_next"):
            monitor.loader_next(self)                  # which iterator, at which batch (doctor)
        if not getattr(monitor, "observing", True):    # the doctor's unobserved steps
            t = perf_counter()
            try:
                return original(self)
            finally:
                monitor.add_data_wait(perf_counter() - t)
        t, c, own = perf_counter(), thread_time(), process_time()
        batch = None
        try:
            batch = original(self)
            return batch
        finally:
            wall = perf_counter() - t
            if hasattr(monitor, "loader_wait"):
                monitor.loader_wait(self, wall)        # which loader waited (the doctor's)
            monitor.add_data_wait(wall)
            if hasattr(monitor, "add_data_cpu"):
                if self._num_workers == 0:
                    monitor.add_data_cpu(wall, thread_time() - c, process_time() - own)
                else:
                    _add_worker_cpu(self)
            if not monitor.loader:
                monitor.loader = loader_settings(self)
            if batch is not None and hasattr(monitor, "loader_batch"):
                monitor.loader_batch(self, batch)      # its shapes, for the hand-over probe

    def _add_worker_cpu(it: Any) -> None:
        pids = _worker_pids(it)
        if not pids:
            return
        held = workers.get(id(it))
        if held is None or held[1] != pids:          # a new iterator, or restarted workers
            workers[id(it)] = (_WorkerCpu(pids), pids)
            return
        got = held[0].delta()
        if got is not None:
            monitor.add_data_cpu(*got)

    setattr(_BaseDataLoaderIter, "__next__", timed_next)
    try:
        yield
    finally:
        setattr(_BaseDataLoaderIter, "__next__", original)


class WorkerPlan:
    """How many loader workers a step needs.

    per_batch_ms: one worker's time to make a batch. With W workers and a starved step, the
    loader delivers W batches per W·step, so a worker needs W·step (the step waits for them);
    with W = 0 the training thread makes the batch itself, in the measured data wait.
    target_ms: the step time without waiting (the step minus its data wait, at least the GPU's
    work), which the loader must keep up with."""

    def __init__(self, workers: int, per_batch_ms: float, target_ms: float, cpus: int,
                 computes: bool = True, trainer_cpus: int = 1):
        self.workers = workers
        self.per_batch_ms = per_batch_ms
        self.target_ms = target_ms
        self.cpus = cpus
        self.computes = computes                  # False: loading mostly waits (I/O)
        self.needed = max(1, math.ceil(HEADROOM * per_batch_ms / max(target_ms, 1e-6)))
        # A worker that computes needs a CPU, and the training process keeps the CPUs its own
        # threads use (one for a GPU loop; torch's intra-op threads for a CPU loop: on 2 cores
        # a worker took one from torch and the loop fell from 300-396 to 166-191 it/s); one
        # that waits needs none (up to 64 workers, where their memory starts to matter).
        self.trainer_cpus = trainer_cpus
        self.most = max(0, cpus - trainer_cpus) if computes else max(64, cpus - 1)
        self.enough = self.needed <= self.most

    def step_ms(self, workers: int) -> float:
        """The step time with `workers` workers: the slower of the loader and the rest."""
        return max(self.target_ms, self.per_batch_ms / max(workers, 1))


def plan_workers(settings: dict[str, Any], data_ms: float, step_ms: float, target_ms: float,
                 cpus: int | None = None, data_cpu: float | None = None,
                 trainer_cpus: int = 1) -> WorkerPlan:
    """`data_cpu`: the CPU share of the loading, measured on the training thread (num_workers=0)
    or in the workers; under 0.5 the loading mostly waits, and workers need no CPU each."""
    workers = settings.get("num_workers") or 0
    per_batch = data_ms if workers == 0 else workers * step_ms
    computes = data_cpu is None or data_cpu >= 0.5
    cpus = cpus or cpu_count()
    return WorkerPlan(workers, per_batch, target_ms, cpus, computes, min(trainer_cpus, cpus))
