"""syncless.doctor(train_step): the script doctor's phases and guarantees for a step function.

The doctor writes the loop (fetch a batch, call the step, mark the step's end) and runs it through
the same ScriptSession as `python -m syncless doctor script.py`: a warm-up that lasts past the
loader's initial prefetch and past compiles, a window timed unobserved (the step the user has,
and the periodic work apart from it), then the monitor, the probe, the audit and the kernel trace.
One implementation: what the report says of a script it says of a step function."""
from __future__ import annotations

import sys
from time import perf_counter, process_time, thread_time
from typing import Any, Callable, Iterable, Iterator, TextIO

from ._boundary import MARKER
from ._loader import loader_settings
from ._session import ScriptSession
from ._session_report import diagnosis
from .diagnose import Diagnosis

__all__ = ["doctor"]


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("doctor(): the loader yielded no batches")


def doctor(train_step: Callable[..., Any], steps: int = 30, *,
           loader: Iterable[Any] | None = None, warmup: int = 3,
           audit_steps: int | None = None, probe: bool = True, trace: str | None = None,
           plain_steps: int | None = None,
           file: TextIO | None | str = "stdout") -> Diagnosis:
    """Diagnose a training step: `syncless.doctor(train_step, steps=30)` calls train_step()
    (or train_step(batch) for each batch of `loader`), prints the report to `file` (None: don't)
    and returns the Diagnosis.

    The steps run through these phases: at least `warmup` steps unmeasured (more while the
    loader still serves its initial prefetch, num_workers x prefetch_factor batches, or a step is
    still a warm-up's), `plain_steps` (default `steps`) timed unobserved, `steps` monitored, 3
    probed (CUDA), `audit_steps` (default min(steps, 10), at least 3) audited, 3 traced (CUDA,
    or `trace=PATH`: the torch.profiler trace written there)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if isinstance(file, str) and file != "stdout":
        raise ValueError(f"file must be 'stdout', None or a text stream, got {file!r}")
    for name, value in (("warmup", warmup), ("audit_steps", audit_steps),
                        ("plain_steps", plain_steps)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    session = ScriptSession(warmup, steps, 3 if probe else 0,
                            audit_steps or max(3, min(steps, 10)), trace, 3, None, plain_steps)
    if loader is not None:
        session.feed.loader = loader_settings(loader)
    session.drive(_loop(session, train_step, loader))
    d = diagnosis(session, boundary="train_step() call")
    if loader is None and not d.summary.loader and d.summary.data_ms == 0:
        d.notes.insert(0, "data wait not measured: train_step fetches no DataLoader batch; pass "
                          "loader= (train_step(batch) is then called per batch)")
    if file is not None:
        print(d.report(), file=sys.stdout if isinstance(file, str) else file)
        d._printed = True
    return d


def _loop(session: ScriptSession, train_step: Callable[..., Any],
          loader: Iterable[Any] | None) -> Callable[[], None]:
    """The loop the session drives: a batch, the step, the step's end; until the session is done
    (it raises at the last phase's end). A DataLoader's next() (or its iterator's) the session
    times itself (its DataLoader hook); another iterable's is timed here."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    fire = session.bounds.fire
    if loader is None:
        def loop() -> None:
            while True:
                train_step()
                fire(MARKER)
        return loop
    batches = _cycle(loader)
    hooked = isinstance(loader, (DataLoader, _BaseDataLoaderIter))

    def fetch() -> Any:
        if hooked:
            return next(batches)
        t, c, own = perf_counter(), thread_time(), process_time()
        batch = next(batches)
        wall = perf_counter() - t
        session.feed.add_data_wait(wall)
        session.feed.add_data_cpu(wall, thread_time() - c, process_time() - own)
        return batch

    def loop_over_batches() -> None:
        while True:
            train_step(fetch())
            fire(MARKER)
    return loop_over_batches
