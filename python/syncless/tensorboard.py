"""torch's TensorBoard SummaryWriter, with add_scalar and add_scalars that never sync.

    from syncless.tensorboard import SummaryWriter      # was: from torch.utils.tensorboard ...
    writer.add_scalar("loss", loss, step)                # CUDA tensor: one kernel launch, no sync

Each add_scalar / add_scalars call is one row of a `syncless.Logger`: the value is gathered on the
device in stream order, while the tag, global_step and walltime (time.time() at the call unless
given) stay on the host, keyed by the row. Every `every` calls (or on the first call after
`max_delay` seconds) the rows are copied back and written through torch's own add_scalar, on the
logger's delivery thread, in call order, at their original step and walltime. flush(), close(),
the context manager's exit and interpreter exit deliver everything first.

Every other method is torch's, unchanged: it writes at once, so in the event file its events may
precede scalars logged before it. Readers group events by tag and step, so nothing they show
changes. Not for use inside CUDA graph capture (use syncless.Logger there).
"""
from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

import torch

try:
    from torch.utils.tensorboard import SummaryWriter as _TorchWriter
except ImportError as exc:                       # torch raises this when tensorboard is missing
    raise ImportError("syncless.tensorboard needs tensorboard: "
                      "pip install syncless[tensorboard]") from exc

from ._deferred import Deferred

__all__ = ["SummaryWriter"]

_log = logging.getLogger("syncless")
_writers: "weakref.WeakSet[SummaryWriter]" = weakref.WeakSet()

_ONE, _MANY = 0, 1
_IN_ROW = object()             # global_step / walltime given as a tensor: read from the row
_COLUMNS = tuple(str(i) for i in range(256))


def _one_element(tag: str, value: Any) -> Any:
    """What the logger can take (a tensor or a real number), read without a sync."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"scalar {tag!r} must hold one element, got shape "
                             f"{tuple(value.shape)}")
        return value
    if isinstance(value, (int, float)):
        return value
    # numpy scalars and arrays, caffe2 blob names: torch's own conversion, on the host.
    from torch.utils.tensorboard._convert_np import make_np
    array = make_np(value)
    if array.size != 1:
        raise ValueError(f"scalar {tag!r} must hold one element, got shape {array.shape}")
    return float(array.reshape(-1)[0])


class SummaryWriter(_TorchWriter):
    """`torch.utils.tensorboard.SummaryWriter` whose add_scalar and add_scalars take CUDA tensors
    without a sync. Same constructor, plus:

    every: rows per device-to-host copy (one copy per `every` scalar calls).
    max_delay: seconds after which the next scalar call hands over the rows anyway, so a slow
        loop still shows up in TensorBoard (None: only every `every` calls, flush and close).

    `latest` ({tag: value}) and `latest_step` hold the most recent values written, a few steps
    behind the loop; `syncless.tqdm(..., log=writer)` shows them.
    """

    def __init__(self, log_dir: Any = None, comment: str = "", purge_step: int | None = None,
                 max_queue: int = 10, flush_secs: int = 120, filename_suffix: str = "", *,
                 every: int = 50, max_delay: float | None = 2.0):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        super().__init__(log_dir, comment, purge_step, max_queue, flush_secs, filename_suffix)
        self.every = every
        self.max_delay = max_delay
        self.latest: dict[str, float] = {}
        self.latest_step = -1
        self._deferred = Deferred(self._replay, every, max_delay)
        _writers.add(self)

    # ---- the deferred path (the caller's thread) ---------------------------------------------

    def add_scalar(self, tag: str, scalar_value: Any, global_step: Any = None,
                   walltime: float | None = None, new_style: bool = False,
                   double_precision: bool = False) -> None:
        metrics = {"v": _one_element(tag, scalar_value)}
        if isinstance(global_step, torch.Tensor):
            metrics["s"], global_step = global_step, _IN_ROW
        if isinstance(walltime, torch.Tensor):
            metrics["w"], walltime = walltime, _IN_ROW
        self._deferred.put(metrics, (_ONE, tag, global_step, walltime, new_style, double_precision))

    def add_scalars(self, main_tag: str, tag_scalar_dict: dict, global_step: Any = None,
                    walltime: float | None = None) -> None:
        names = list(tag_scalar_dict)
        if len(names) > 254:
            raise ValueError(f"add_scalars({main_tag!r}): at most 254 values per call, got "
                             f"{len(names)}")
        metrics = {_COLUMNS[i]: _one_element(f"{main_tag}/{name}", tag_scalar_dict[name])
                   for i, name in enumerate(names)}
        if isinstance(global_step, torch.Tensor):
            metrics["s"], global_step = global_step, _IN_ROW
        if isinstance(walltime, torch.Tensor):
            metrics["w"], walltime = walltime, _IN_ROW
        self._deferred.put(metrics, (_MANY, main_tag, global_step, walltime, names, None))

    # ---- delivery (the logger's thread) ------------------------------------------------------

    def _replay(self, record: tuple, row) -> None:
        kind, tag, step, wall, extra1, extra2 = record
        values = row.values
        if step is _IN_ROW:
            step = int(values["s"])
        if wall is None:
            wall = row.time
        elif wall is _IN_ROW:
            wall = values["w"]
        if kind == _ONE:
            value = values["v"]
            _TorchWriter.add_scalar(self, tag, value, step, wall, extra1, extra2)
            self.latest[tag] = value
        else:
            scalars = {name: values[_COLUMNS[i]] for i, name in enumerate(extra1)}
            _TorchWriter.add_scalars(self, tag, scalars, step, wall)
            for name, value in scalars.items():
                self.latest[f"{tag}/{name}"] = value
        if step is not None:
            self.latest_step = int(step)

    def _write_scalar(self, tag: str, value: float, step: int, walltime: float) -> None:
        """For syncless.sinks.TensorBoard: a value that is already a float, written at once."""
        _TorchWriter.add_scalar(self, tag, value, step, walltime)

    # ---- draining ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Write every scalar logged so far, then flush the event files to disk."""
        self._deferred.flush()
        super().flush()

    def close(self) -> None:
        self._deferred.close()
        super().close()


@atexit.register
def _flush_all() -> None:
    # Registered after syncless.logger's own hook, so it runs first (atexit is LIFO).
    for writer in list(_writers):
        try:
            writer.flush()
        except Exception as exc:
            _log.error("syncless: flushing %r at exit failed: %s", writer, exc)
