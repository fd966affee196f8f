"""What a sink is and what it receives: `Row`, the field names every row reserves, and the check
of a `sinks=` argument that Logger and the integrations share.

A sink is any object with `write(rows)` (and optionally `flush()` and `close()`); `rows` is a
list of `Row`. The names in `RESERVED` are every row's own fields (the JSONL and CSV sinks write
them beside the metrics), so no metric may take them.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = ["Row", "RESERVED", "check_sinks"]


class _RowFields(NamedTuple):
    step: int
    time: float
    values: dict[str, float]


STEP, TIME = _RowFields._fields[:2]      # "step", "time": the names files write them under
RESERVED = frozenset((STEP, TIME))


class Row(_RowFields):
    """One logged step as sinks receive it: plain Python floats, never tensors.

    `step`, `time` (host wall time of the log() call; for a row replayed by a CUDA graph, the
    time of the flush that found it) and `values` ({name: float}; absent metrics are absent).
    `gpu_ns` is the GPU's clock (%globaltimer, ns) when the gather kernel wrote the row, for a
    Logger(gpu_time=True); otherwise None.
    """
    gpu_ns: int | None = None
    late: bool = False               # True for a row made only of late values (see attach)

    def _with(self, values: dict[str, float]) -> Row:
        row = Row(self.step, self.time, values)
        if self.gpu_ns is not None:
            row.gpu_ns = self.gpu_ns
        return row


def check_sinks(sinks: Any) -> list[Any]:
    """`sinks` as a list of sinks: one sink, or an iterable of them. A path, or an object
    without write(), is refused with the fix."""
    if hasattr(sinks, "write"):
        return [sinks]
    if isinstance(sinks, (str, bytes, os.PathLike)):
        raise TypeError(f"sinks takes sink objects, got the path {sinks!r}; for a file write "
                        f"sinks=[syncless.sinks.JSONL({os.fsdecode(sinks)!r})] (or sinks.CSV)")
    try:
        sinks = list(sinks)
    except TypeError:
        raise TypeError(f"sinks must be a sink (an object with write(rows)) or a list of them, "
                        f"got {type(sinks).__name__}") from None
    for s in sinks:
        if not callable(getattr(s, "write", None)):
            raise TypeError(f"sink {s!r} has no write(rows) method")
    return list(sinks)
