"""The data side of a script's steps: every DataLoader next() the doctor times (through
timed_dataloaders), which loader it was, how long the step waited, and which loader feeds the
steps (an evaluation loader every N steps is not the one more workers would help)."""
from __future__ import annotations

import dataclasses
import statistics
import weakref
from typing import Any, NamedTuple, Protocol

from ._loader import batch_spec, loader_settings
from ._series import Series, split
from ._sweep import Recipe, recipe
from .monitor import MonitorSummary, StepMonitor


class Owner(Protocol):
    """What a Feed reads of the session it serves."""
    phase: str | None
    monitor: StepMonitor

__all__ = ["Feed", "StepContext", "LoaderRecord", "split_steps"]


class StepContext(NamedTuple):
    """What one step of a phase did beside its duration."""
    start: float                     # perf_counter when the step began (the doctor returned)
    end: float                       # ... and when it ended (the doctor was called)
    forward: int                     # forward-only model calls (autograd off)
    epochs: int                      # DataLoader iterators started (or reset)
    wait_ms: float                   # time in DataLoader next()
    nexts: dict[int, int]            # id(dataset) -> next() calls
    waits: dict[int, float]          # id(dataset) -> seconds in them (monitored steps only)


def split_steps(durations: list[float], contexts: list[StepContext]) -> Series:
    """Steps split into the steady step and its stalls. A step that waited for its batch, past
    the median wait by at least half its extra time, and started no epoch, is no stall: a
    loader too slow for the step makes steps wait in turn (two workers in step with each other:
    a long wait every other step), and that is the steady step."""
    if not durations or len(contexts) != len(durations):
        return split(durations)
    median_d = statistics.median(durations)
    median_wait = statistics.median(c.wait_ms for c in contexts)
    steady = {i for i, c in enumerate(contexts) if c.epochs == 0 and
              c.wait_ms - median_wait >= 0.5 * (durations[i] - median_d)}
    return split(durations, steady)


@dataclasses.dataclass
class LoaderRecord:
    """One loader (by its dataset) over the monitored steps."""
    dataset: Any
    calls: int = 0                   # next() calls
    wait_s: float = 0.0              # time in them
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    data_wall_s: float = 0.0         # data wait whose CPU time was read ...
    data_cpu_s: float = 0.0          # ... and that CPU time
    spec: Any = None                 # its first monitored batch's shapes (batch_spec), or None
    specced: bool = False
    recipe: Recipe | None = None     # how to make side loaders like it (the worker sweep)

    @property
    def name(self) -> str:
        return type(self.dataset).__name__


class Feed:
    """timed_dataloaders' target for a ScriptSession. Its state restarts with the session's
    (reset()), except the first loader's settings."""

    def __init__(self, session: Owner) -> None:
        self.s = session
        self._settings: dict[str, Any] = {}
        self.reset()

    def reset(self) -> None:
        # Per dataset, over the monitored steps, in the order first seen.
        self.loaders: dict[int, LoaderRecord] = {}
        self._last: LoaderRecord | None = None
        self.wait_s = 0.0                         # time in DataLoader next() this step
        self.step_nexts: dict[int, int] = {}      # id(dataset) -> next() calls this step
        self.step_waits: dict[int, float] = {}    # id(dataset) -> seconds in them (monitored)
        self.names: dict[int, str] = {}           # id(dataset) -> its type's name
        self.epoch_starts = 0                     # DataLoader iterators started (or reset)
        self._iterator: weakref.ref[Any] | None = None   # the iterator next()'d last

    def new_step(self) -> None:
        self.wait_s = 0.0
        self.step_nexts, self.step_waits = {}, {}

    # ---- called by timed_dataloaders -----------------------------------------------------------

    @property
    def observing(self) -> bool:
        """False in the unobserved window: the DataLoader's next() is not timed there."""
        return self.s.phase != "plain"

    def add_data_wait(self, seconds: float) -> None:
        self.wait_s += seconds
        if self.s.phase != "plain":
            self.s.monitor.add_data_wait(seconds)

    def loader_next(self, iterator: Any) -> None:
        """Before each next() of a DataLoader iterator: a new epoch when it has yielded nothing
        yet (a new iterator, or a persistent one reset); the last one is the one whose initial
        prefetch the warm-up uses up."""
        if getattr(iterator, "_num_yielded", 1) == 0:
            self.epoch_starts += 1
        key = id(getattr(iterator, "_dataset", iterator))
        self.step_nexts[key] = self.step_nexts.get(key, 0) + 1
        if key not in self.names:
            self.names[key] = type(getattr(iterator, "_dataset", iterator)).__name__
        if self._iterator is None or self._iterator() is not iterator:
            self._iterator = weakref.ref(iterator)

    def loader_wait(self, iterator: Any, seconds: float) -> None:
        """One next() of a DataLoader iterator: which loader (its dataset) and how long."""
        if self.s.phase != "monitor":
            self._last = None
            return
        dataset = getattr(iterator, "_dataset", iterator)
        rec = self.loaders.get(id(dataset))
        if rec is None:
            rec = self.loaders[id(dataset)] = LoaderRecord(dataset,
                                                           settings=loader_settings(iterator),
                                                           recipe=recipe(iterator))
        rec.calls += 1
        rec.wait_s += seconds
        self._last = rec
        self.step_waits[id(dataset)] = self.step_waits.get(id(dataset), 0.0) + seconds

    def loader_batch(self, iterator: Any, batch: Any) -> None:
        """A batch a DataLoader iterator yielded in a monitored step: the first one's shapes,
        for the hand-over probe."""
        rec = self._last
        if rec is not None and not rec.specced:
            rec.spec, rec.specced = batch_spec(batch), True

    def feeding_recipe(self) -> Recipe | None:
        """How to make side loaders like the one that feeds the steps (the most next() calls)."""
        recs = sorted(self.loaders.values(), key=lambda r: -r.calls)
        return recs[0].recipe if recs else None

    def handoff_spec(self) -> Any:
        """The shapes of a batch of the loader that feeds the steps (the most next() calls)."""
        recs = sorted(self.loaders.values(), key=lambda r: -r.calls)
        return recs[0].spec if recs else None

    def add_data_cpu(self, wall: float, cpu: float, own: float | None = None) -> None:
        # The monitored steps' only: in the warm-up, spawned workers still import torch (CPU
        # they spend once, not per batch).
        if self.s.phase == "monitor":
            self.s.monitor.add_data_cpu(wall, cpu, own)
            if self._last is not None:
                self._last.data_wall_s += wall
                self._last.data_cpu_s += cpu

    @property
    def loader(self) -> dict[str, Any]:
        return self._settings

    @loader.setter
    def loader(self, settings: dict[str, Any]) -> None:
        self._settings = settings
        self.s.monitor.loader = settings

    # ---- what the warm-up and the report ask ---------------------------------------------------

    def queue(self) -> tuple[Any, int, int, int]:
        """The last DataLoader iterator next()'d: (it, its workers, the batches its initial
        prefetch queues: num_workers x prefetch_factor, batches it has yielded)."""
        it = self._iterator() if self._iterator is not None else None
        workers = (getattr(it, "_num_workers", 0) or 0) if it is not None else 0
        if not workers:
            return it, 0, 0, 0
        return (it, workers, workers * (getattr(it, "_prefetch_factor", None) or 2),
                getattr(it, "_num_yielded", 0))

    def feeding(self, contexts: list[StepContext]) -> int | None:
        """id() of the dataset whose loader feeds the steps: the most next() calls."""
        calls: dict[int, int] = {}
        for c in contexts:
            for k, n in c.nexts.items():
                calls[k] = calls.get(k, 0) + n
        return max(calls, key=lambda k: calls[k]) if calls else None

    def feeding_only(self, m: MonitorSummary, notes: list[str], monitored: list[StepContext],
                     stalled: set[int]) -> MonitorSummary:
        """The data wait of the loader that feeds the steps (the most next() calls), not of
        others (an evaluation loader every N steps): more workers for the training loader
        would not shorten those; their waits count to the step body, with a note."""
        if len(self.loaders) < 2 or not m.steps:
            return m
        recs = sorted(self.loaders.values(), key=lambda r: -r.calls)   # stable: first seen wins
        feeding, others = recs[0], recs[1:]
        # Their waits in the steady steps only: those in stalls are periodic work, apart.
        ids = {id(r.dataset) for r in others}
        moved = sum(w for i, c in enumerate(monitored) if i not in stalled
                    for k, w in c.waits.items() if k in ids) * 1e3 / m.steps
        if moved == 0:
            return m
        notes.append(
            f"{len(others)} other DataLoader{'s' if len(others) > 1 else ''} ("
            + ", ".join(f"{r.name}: {r.calls / m.steps:.3g} next()/step" for r in others)
            + f") blocked {moved:.3f} ms/step (an evaluation loop?): counted to the step body; "
            f"the data wait is that of the loader feeding the steps ({feeding.name}, "
            f"{feeding.calls / m.steps:.3g} next()/step)")
        data_cpu = feeding.data_cpu_s / feeding.data_wall_s if feeding.data_wall_s > 0 else None
        loader = m.loader if feeding is next(iter(self.loaders.values())) else feeding.settings
        return dataclasses.replace(m, data_ms=max(0.0, m.data_ms - moved),
                                   cpu_ms=m.cpu_ms + moved, data_cpu=data_cpu, loader=loader)
