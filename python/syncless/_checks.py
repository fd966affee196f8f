"""The argument checks every entry point shares, and the `every` defaults, each chosen once.

`every` is how many calls share one device-to-host copy: larger is fewer copies (each one
`cuMemcpyDtoHAsync` and an event record, a few microseconds on the training thread), smaller is
values that reach the sinks sooner. `max_delay` bounds the lateness whatever `every` is, so the
defaults only matter in fast loops; they differ where the reader of the values differs (see
each constant).
"""
from __future__ import annotations

from typing import Any

LOGGER_EVERY = 100
"""syncless.Logger: rows go to files and callbacks read after the fact, so copies are made rare."""
ADAPTER_EVERY = 50
"""The wandb and TensorBoard drop-ins, and the HF Trainer's per-step Logger: a dashboard someone
watches while the run goes, so half the Logger's window (still one copy per 50 calls)."""
LIGHTNING_EVERY = 16
"""Lightning's callback: the progress bar and every Lightning logger read these values, and a
Lightning batch costs milliseconds of host time anyway, so the copy is made every 16 batches to
keep the bar a few steps behind at most."""


def check_every(every: Any, name: str = "every") -> int:
    """`every` itself, or ValueError: a positive int (a bool is not a count: True is refused)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{name} must be a positive int, got {every!r}")
    return every


def check_max_delay(max_delay: Any, name: str = "max_delay") -> float | None:
    """`max_delay` itself, or ValueError: None (no time bound) or seconds >= 0."""
    if max_delay is not None and (isinstance(max_delay, bool)
                                  or not isinstance(max_delay, (int, float))
                                  or not max_delay >= 0):
        raise ValueError(f"{name} must be None or a number of seconds >= 0, got {max_delay!r}")
    return max_delay
