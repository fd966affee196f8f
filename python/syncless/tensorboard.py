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
changes. A call during CUDA graph capture raises RuntimeError (use syncless.Logger there).
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

from ._deferred import Deferred, Failures, check_name

__all__ = ["SummaryWriter"]

_log = logging.getLogger("syncless")
_writers: "weakref.WeakSet[SummaryWriter]" = weakref.WeakSet()

_ONE, _MANY = 0, 1


def _scalar(value: Any) -> Any:
    """What the logger can take: tensors and numbers as they are (it checks them and names the
    tag in its error); numpy scalars and arrays through torch's own conversion, on the host."""
    if isinstance(value, (torch.Tensor, int, float)) or type(value).__module__ != "numpy":
        return value
    from torch.utils.tensorboard._convert_np import make_np
    array = make_np(value)
    return float(array.reshape(-1)[0]) if array.size == 1 else torch.from_numpy(array)


def _global_step(step: Any) -> int:
    try:
        return int(step)                    # what torch's add_scalar does with it
    except (TypeError, ValueError):
        raise TypeError(f"global_step must be an integer, got {type(step).__name__} "
                        f"{step!r}") from None


def _describe(record: tuple) -> tuple[str, str]:
    return record[1], f"{'add_scalar' if record[0] == _ONE else 'add_scalars'}({record[1]!r})"


class SummaryWriter(_TorchWriter):
    """`torch.utils.tensorboard.SummaryWriter` whose add_scalar and add_scalars take CUDA tensors
    without a sync. Same constructor, plus:

    every: rows per device-to-host copy (one copy per `every` scalar calls).
    max_delay: seconds after which the next scalar call hands over the rows anyway, so a slow
        loop still shows up in TensorBoard (None: only every `every` calls, flush and close).

    `latest` ({tag: value}) and `latest_step` hold the most recent values written, a few steps
    behind the loop; `syncless.tqdm(..., log=writer)` shows them. Bad input (a tensor with
    several elements, a complex one, a non-integer step tensor, a tag that is not UTF-8) raises
    at the call, naming the tag; a scalar torch refuses at delivery is reported once per tag
    and counted in `errors`, and every other scalar is written.
    """

    def __init__(self, log_dir: Any = None, comment: str = "", purge_step: int | None = None,
                 max_queue: int = 10, flush_secs: int = 120, filename_suffix: str = "", *,
                 every: int = 50, max_delay: float | None = 2.0):
        self._deferred = Deferred(self._replay, _describe,
                                  Failures("syncless.tensorboard", "writer.errors"), every,
                                  max_delay, step_name="global_step", step_of=_global_step)
        super().__init__(log_dir, comment, purge_step, max_queue, flush_secs, filename_suffix)
        self.every = every
        self.max_delay = max_delay
        self.latest: dict[str, float] = {}
        self.latest_step = -1
        _writers.add(self)

    @property
    def errors(self) -> int:
        """Scalars torch refused at delivery (each tag reported once in the log)."""
        return self._deferred.errors

    # ---- the deferred path (the caller's thread) ---------------------------------------------

    def add_scalar(self, tag: str, scalar_value: Any, global_step: Any = None,
                   walltime: float | None = None, new_style: bool = False,
                   double_precision: bool = False) -> None:
        check_name(tag, "tag")
        if type(scalar_value) is not torch.Tensor:
            scalar_value = _scalar(scalar_value)
        self._deferred.put((_ONE, tag, new_style, double_precision), (scalar_value,), (tag,),
                           global_step, walltime)

    def add_scalars(self, main_tag: str, tag_scalar_dict: dict, global_step: Any = None,
                    walltime: float | None = None) -> None:
        check_name(main_tag, "tag")
        names = tuple(tag_scalar_dict)
        for name in names:
            check_name(name, "tag")
        self._deferred.put((_MANY, main_tag, names),
                           [_scalar(tag_scalar_dict[name]) for name in names],
                           [f"{main_tag}/{name}" for name in names], global_step, walltime)

    # ---- delivery (the logger's thread) ------------------------------------------------------

    def _replay(self, record: tuple, values: list, step: Any, wall: float) -> None:
        if record[0] == _ONE:
            _, tag, new_style, double_precision = record
            value = values[0]
            _TorchWriter.add_scalar(self, tag, value, step, wall, new_style, double_precision)
            self.latest[tag] = value
        else:
            _, tag, names = record
            scalars = dict(zip(names, values))
            _TorchWriter.add_scalars(self, tag, scalars, step, wall)
            for name, value in scalars.items():
                self.latest[f"{tag}/{name}"] = value
        if step is not None:
            self.latest_step = step

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
