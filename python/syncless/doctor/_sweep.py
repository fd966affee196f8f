"""How many loader workers a step needs, measured rather than modelled: side loaders of the
user's own dataset, sampler, batch size and collate with k workers, each timed making batches as
fast as the training thread takes them, while the training loop waits.

A model (one worker's batch time over the step, capped by the CPUs) gets both kinds of loader
wrong: workers that wait on storage need no CPU each (a 10-ms sleep per sample, batch 4, on 2
cores: 41.8 ms/step with no worker, 21.0 with 2, 10.4 with 4, 5.6 with 8, where the model
allowed one), and workers that decode compete for the CPUs with each other and with torch's own
threads, so a count that the batch time asks for can deliver less than it promises.

k doubles from the loader's own count (1 for none: a loader the step waits for needs more
workers, never fewer) while each doubling still cuts the batch period to GAIN or less, until the
loader keeps up with the step, or the count reaches max_workers(), or the time is spent: SWEEP_S,
or where one worker's batches are slow, what the doublings that the step's pace asks for take
(each count serves about PREFETCH + ROUNDS batches a worker), up to SWEEP_MAX_S (imagenet's
FakeData, 256 images a batch: 545 ms a batch, and 8 s measured only 1 and 2 workers). A sweep
whose time ran out while doublings still halved the period extrapolates from its last count
(Sweep.extrapolate), and says so.
Each k's side loader starts its workers as the user's would (forked on Linux, the loader's own
multiprocessing context where it has one), serves the batches it asks for at the start (two per
worker: their start and first batches), then rounds of one batch per worker (at least ROUNDS and
MIN_S), each timed: the period is the median round's time over k (a burst of the host's load in
one round does not move it); its workers' CPU time is read from /proc on the way. A batch that
takes longer than the time left ends the sweep (DataLoader's timeout), never the doctor. The
user's RNG states (torch's, Python's, numpy's, the sampler's generator) are put back after the
sweep: it must not change the order the loop sees next."""
from __future__ import annotations

import contextlib
import math
import random
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Iterator

from ._loader import cpu_count, process_cpu_s

__all__ = ["Recipe", "recipe", "Sweep", "sweep", "sweeper", "max_workers"]

SWEEP_S = 8.0        # the whole sweep ...
SWEEP_MAX_S = 30.0   # ... or, for slow batches, what the doublings to the step's pace take
K_S = 2.0            # one worker count, past its prefetch, at most ...
MIN_S = 0.5          # ... and at least (a loaded host's bursts even out over it)
ROUNDS = 3           # rounds of k batches timed per count, at least
GAIN = 0.85          # a doubling that does not cut the period to 85% ends the sweep (saturated)
CLOSE = 1.05         # the count prescribed: the fewest workers within 5% of the best step
PREFETCH = 2         # the side loaders' prefetch_factor (DataLoader's default)
COMPUTES = 0.25       # a worker on a CPU this share of its time computes (else it waits; a
                     # computing one on a loaded 2-core host read 0.43)


def max_workers(cpus: int) -> int:
    """The most workers the sweep tries: waiting workers need no CPU each, but each holds a
    process's memory, and the training thread takes every batch they make from their queue (on
    a loaded 2-core host 16 waiting workers read 2.6 to 5.6 ms/batch from one sweep to the next,
    8 of them 5.1 to 5.6): four per CPU, at least 8, at most 64."""
    return min(64, max(8, 4 * cpus))


@dataclass
class Recipe:
    """What makes a side loader like the user's: the same dataset, batches (sampler and batch
    size, or the batch sampler), collate, worker setup and pinning (its thread copies each batch
    on the taking process's CPU); only the worker count differs."""
    dataset: Any
    index_sampler: Any              # the batch sampler (auto collation) or the sampler
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    iterable: bool                  # an IterableDataset: no sampler of its own
    worker_init_fn: Any = None
    context: Any = None             # the loader's multiprocessing context (None: torch's default)
    pin_memory: bool = False
    workers: int = 0                # the user's own count: the sweep starts there

    def loader(self, workers: int, timeout: float = 0.0) -> Any:
        """A side loader of `workers` workers; `timeout`: seconds a batch may take (a worker
        that hangs raises, and the sweep ends, instead of hanging the doctor)."""
        from torch.utils.data import DataLoader
        kw: dict[str, Any] = {"num_workers": workers, "collate_fn": self.collate_fn,
                              "worker_init_fn": self.worker_init_fn,
                              "timeout": timeout if workers else 0.0,
                              "pin_memory": self.pin_memory}
        if workers:
            kw["multiprocessing_context"] = self.context
            kw["prefetch_factor"] = PREFETCH
        if self.iterable:
            size = getattr(self.index_sampler, "batch_size", None) if self.auto_collation \
                else None
            return DataLoader(self.dataset, batch_size=size, drop_last=self.drop_last, **kw)
        if self.auto_collation:
            return DataLoader(self.dataset, batch_sampler=_Cycled(self.index_sampler), **kw)
        return DataLoader(self.dataset, batch_size=None, sampler=_Cycled(self.index_sampler),
                          **kw)


class _Cycled:
    """The user's sampler (or batch sampler) over and over: a small dataset must not run out
    within a count's rounds (16 workers ask for 80 batches and more)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        while True:
            empty = True
            for x in self.sampler:
                empty = False
                yield x
            if empty:
                return


def recipe(obj: Any) -> Recipe | None:
    """The Recipe of a DataLoader or of one of its iterators; None for anything else."""
    from torch.utils.data import DataLoader, IterableDataset
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    if isinstance(obj, DataLoader):
        return Recipe(obj.dataset, obj._index_sampler, obj._auto_collation, obj.collate_fn,
                      obj.drop_last, isinstance(obj.dataset, IterableDataset),
                      obj.worker_init_fn, obj.multiprocessing_context, bool(obj.pin_memory),
                      int(obj.num_workers))
    if isinstance(obj, _BaseDataLoaderIter):
        context = None
        workers = getattr(obj, "_workers", None) or []
        method = getattr(workers[0], "_start_method", None) if workers else None
        if method:
            import multiprocessing
            context = multiprocessing.get_context(method)
        return Recipe(obj._dataset, obj._index_sampler, obj._auto_collation, obj._collate_fn,
                      obj._drop_last, isinstance(obj._dataset, IterableDataset),
                      getattr(obj, "_worker_init_fn", None), context,
                      bool(getattr(obj, "_pin_memory", False)),
                      int(getattr(obj, "_num_workers", 0)))
    return None


@dataclass
class Sweep:
    """What the sweep measured: per worker count, the batch period (ms between batches the
    training thread took) and the CPU share of each worker."""
    period_ms: dict[int, float] = field(default_factory=dict)
    cpu_share: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    batches: dict[int, int] = field(default_factory=dict)    # taken, per worker count
    ended: str = ""                 # why it stopped: "the sweep <ended>"

    @property
    def computes(self) -> bool:
        """The workers compute (a CPU each) rather than wait: read where they had the CPUs to
        themselves (the fewest workers measured)."""
        if not self.cpu_share:
            return True
        return self.cpu_share[min(self.cpu_share)] >= COMPUTES

    def predicted_ms(self, workers: int, target_ms: float) -> float:
        """The step with `workers` (measured): the slower of the loader and the step's own time."""
        return max(self.period_ms[workers], target_ms)

    def choose(self, target_ms: float, most: int) -> int | None:
        """The fewest measured workers (at most `most`) whose step is within CLOSE of the best;
        None when none was measured there."""
        ks = [k for k in sorted(self.period_ms) if k <= most]
        if not ks:
            return None
        best = min(self.predicted_ms(k, target_ms) for k in ks)
        return next(k for k in ks if self.predicted_ms(k, target_ms) <= CLOSE * best)

    def extrapolate(self, target_ms: float, most: int) -> tuple[int, float] | None:
        """(workers, batch period) that keep up with a step of `target_ms` (at most `most`),
        from the last count measured, when the sweep's time ran out while each doubling still
        cut the period to GAIN or less; None otherwise."""
        if not self.ended.startswith("ran out of time") or len(self.period_ms) < 2:
            return None
        last = max(self.period_ms)
        before = self.period_ms.get(last // 2)
        period = self.period_ms[last]
        if before is None or period > GAIN * before or period <= target_ms:
            return None
        k = min(most, math.ceil(period * last / max(target_ms, 1e-9)))
        return (k, period * last / k) if k > last else None

    def text(self) -> str:
        """`1: 40.1, 2: 20.3, 4: 10.2 ms/batch (2.1 s)`"""
        return (", ".join(f"{k}: {ms:.1f}" for k, ms in sorted(self.period_ms.items()))
                + f" ms/batch ({self.seconds:.1f} s)")

    def as_dict(self) -> dict[str, Any]:
        return {"period_ms": dict(self.period_ms), "cpu_share": dict(self.cpu_share),
                "seconds": self.seconds, "batches": self.batches, "ended": self.ended}


@contextlib.contextmanager
def _rng_kept(r: Recipe) -> Iterator[None]:
    """Puts back every RNG state the side loaders draw from: torch's (the loader's base seed, a
    RandomSampler without a generator), Python's and numpy's (a custom sampler's), and the
    generator of the sampler."""
    import torch
    gens = []
    for s in (r.index_sampler, getattr(r.index_sampler, "sampler", None)):
        g = getattr(s, "generator", None)
        if isinstance(g, torch.Generator):
            gens.append((g, g.get_state()))
    state = torch.get_rng_state()
    py = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(state)
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)
        for g, s in gens:
            g.set_state(s)


def _cpu(pids: list[int]) -> float | None:
    total = 0.0
    for pid in pids:
        c = process_cpu_s(pid)
        if c is None:
            return None
        total += c
    return total


def _time(r: Recipe, k: int, deadline: float) -> tuple[float, float | None, int] | None:
    """(ms per batch, CPU share per worker, batches taken) of a side loader of `k` workers; None
    when the loader ran out or the time did before one timed round."""
    it: Any = None
    taken = 0
    try:
        with warnings.catch_warnings():          # torch's "more workers than CPUs": meant
            warnings.simplefilter("ignore")       # (waiting workers need none)
            it = iter(r.loader(k, timeout=max(1.0, deadline - perf_counter())))
        pids = [w.pid for w in getattr(it, "_workers", []) if w.pid is not None]
        # The batches asked for at the start (prefetch_factor per worker) are made together
        # while the workers start: taken untimed, the timed rounds are the steady ones.
        for _ in range(k * PREFETCH):
            if perf_counter() > deadline:
                return None
            next(it)
            taken += 1
        t0, c0 = perf_counter(), _cpu(pids)
        n = 0
        ends = [t0]                              # each round's end
        while perf_counter() < deadline:
            if n % k == 0:                       # whole rounds: waiting workers deliver together
                now = perf_counter()
                if n:
                    ends.append(now)
                if n >= ROUNDS * k and now - t0 >= MIN_S or n >= k and now - t0 >= K_S:
                    break
            try:
                next(it)
            except StopIteration:
                break
            n += 1
        taken += n
        if n < 2:
            return None
        wall = perf_counter() - t0
        c1 = _cpu(pids)
        share = (c1 - c0) / (wall * k) if c0 is not None and c1 is not None else None
        # The median round: a burst of the host's load in one round does not move it.
        rounds = [b - a for a, b in zip(ends, ends[1:])]
        period = statistics.median(rounds) / k if len(rounds) >= ROUNDS else wall / n
        return period * 1e3, share, taken
    except StopIteration:
        return None
    finally:
        if it is not None and hasattr(it, "_shutdown_workers"):
            with contextlib.suppress(Exception):
                it._shutdown_workers()


def sweep(r: Recipe, target_ms: float, cpus: int, budget_s: float = SWEEP_S) -> Sweep:
    """Time side loaders of r with k, 2k, 4k ... workers, from the loader's own count k (1 for
    none), until one keeps up with a step of `target_ms` (its own time, without the wait), the
    period stops falling (GAIN), max_workers(cpus) is reached or `budget_s` is spent. A loader
    the step waits for needs more workers than it has, never fewer: imagenet's 4 workers on an
    H100 swept 1: 940, 2: 358, 4: 251, 8: 130, 16: 72 ms/batch in 32 s, 9 s of it below 4."""
    out = Sweep()
    began = perf_counter()
    deadline = began + budget_s
    top = max_workers(cpus)
    first = k = max(1, min(r.workers, top))
    with _rng_kept(r):
        while True:
            try:
                got = _time(r, k, deadline)
            except Exception as e:                   # the user's dataset failed in a worker
                out.ended = f"stopped: a side loader of {k} workers failed: {type(e).__name__}: {e}"
                break
            if got is None:
                out.ended = (f"ran out of time at {k} workers" if perf_counter() > deadline
                             else f"stopped: the dataset ran out at {k} workers")
                break
            period, share, taken = got
            if k == first and period > target_ms > 0:
                # Slow batches: time for the doublings to the step's pace, each count serving
                # about PREFETCH + ROUNDS batches a worker (a worker's batch: k periods).
                doublings = math.ceil(math.log2(period / target_ms))
                need = (PREFETCH + ROUNDS) * k * period / 1e3 * (doublings + 1)
                deadline = began + max(budget_s, min(SWEEP_MAX_S, need))
            out.batches[k] = taken
            previous = out.period_ms.get(k // 2) if k > first else None
            out.period_ms[k] = period
            if share is not None:
                out.cpu_share[k] = share
            if period <= target_ms:
                out.ended = f"stopped at {k} workers: they keep up with the step"
                break
            if previous is not None and period > GAIN * previous:
                out.ended = (f"stopped at {k} workers: doubling cut the period by less than "
                             f"{1 - GAIN:.0%}")
                break
            if 2 * k > top:
                out.ended = f"stopped at {k} workers, the most it tries on {cpus} CPUs"
                break
            k *= 2
    out.seconds = perf_counter() - began
    return out


def sweeper(r: Recipe | None, cpus: int | None = None) -> Callable[[float], Sweep | None] | None:
    """The sweep of `r` for the step's own time it is given, run once (later calls: the same
    Sweep); None without a recipe."""
    if r is None:
        return None
    done: list[Sweep] = []

    def run(target_ms: float) -> Sweep:
        if not done:
            done.append(sweep(r, target_ms, cpus or cpu_count()))
        return done[0]
    return run
