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
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter as _TorchWriter
    from torch.utils.tensorboard._convert_np import make_np
except ImportError as exc:                       # torch raises this when tensorboard is missing
    raise ImportError("syncless.tensorboard needs tensorboard: "
                      "pip install tensorboard (from a syncless checkout: "
                      "pip install -e '.[tensorboard]')") from exc

from ._checks import ADAPTER_EVERY
from ._deferred import Deferred, Failures

__all__ = ["SummaryWriter", "ScalarShapeError"]

_log = logging.getLogger("syncless")
_writers: "weakref.WeakSet[SummaryWriter]" = weakref.WeakSet()

_ONE, _MANY = 0, 1


# The writer accepts and refuses what torch's does, with torch's exception types, at the call:
# torch converts a value with make_np(value).squeeze() and float(), asserts one element, puts the
# tag in a protobuf string field, the step through int() into an int64 field and the walltime
# into a double field. The same conversions run here on host values; a tensor value keeps its
# device and is only checked by its metadata.

class ScalarShapeError(AssertionError, ValueError):
    """A value with other than one element: torch raises AssertionError, syncless ValueError;
    this is both, so either `except` catches it."""


_good_tags: set[str] = set()                  # tags the protobuf field took before


def _check_tag(tag: Any) -> None:
    if type(tag) is str and tag in _good_tags:
        return
    if isinstance(tag, str):
        try:
            tag.encode("utf-8")
        except UnicodeEncodeError as exc:    # the field's own error, naming the tag
            exc.reason = f"{exc.reason}; tag {tag!r} is not valid UTF-8 text"
            raise
    try:
        Summary.Value(tag=tag)           # torch's field: what it takes (bytes, None) and not
    except TypeError:
        raise TypeError(f"tag must be str, got {type(tag).__name__} {tag!r}") from None
    if type(tag) is str and len(_good_tags) < 100_000:
        _good_tags.add(tag)


def _shape_error(tag: Any, shape: tuple[int, ...]) -> ScalarShapeError:
    return ScalarShapeError(f"metric {tag!r} must hold one element, got shape {shape}")


def _scalar(tag: Any, value: Any) -> Any:
    """A float as torch's add_scalar makes it from a host value, or a tensor checked by its
    metadata (no sync): the Logger reads it on the device."""
    if type(value) is float:
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _shape_error(tag, tuple(value.shape))
        if value.dtype.is_complex:
            raise TypeError(f"metric {tag!r}: float() argument must be a string or a real "
                            f"number, not 'complex' (torch refuses a {value.dtype} tensor)")
        return value
    array = make_np(value).squeeze()     # NotImplementedError for what torch cannot convert
    if array.ndim != 0:
        raise _shape_error(tag, array.shape)
    return float(array)                  # ValueError / TypeError, as in torch


def _global_step(step: Any) -> Any:
    """int(step), as torch's add_event does, in the int64 range of the event's field; a
    one-element tensor rides in the row and is truncated there like int(tensor)."""
    if isinstance(step, torch.Tensor):
        return step
    try:
        value = int(step)
    except (TypeError, ValueError, OverflowError) as exc:
        raise type(exc)(f"global_step must be an integer, got {type(step).__name__} "
                        f"{step!r}") from None
    if not -2**63 <= value < 2**63:
        raise ValueError(f"global_step {value} is out of the int64 range of TensorBoard's "
                         "event step (Value out of range)")
    return value


def _step_tensor(step: torch.Tensor) -> None:
    if step.dtype.is_complex:            # int() of a complex tensor: a RuntimeError in torch
        raise RuntimeError(f"global_step: a {step.dtype} tensor cannot be converted to int64")


def _walltime(walltime: Any) -> Any:
    """A host walltime as the event's double field takes it (torch's TypeError otherwise)."""
    if walltime is None or type(walltime) is float or isinstance(walltime, torch.Tensor):
        if isinstance(walltime, torch.Tensor) and walltime.dtype.is_complex:
            raise RuntimeError(f"walltime: a {walltime.dtype} tensor cannot be converted to "
                               "a double")
        return walltime
    return Event(wall_time=walltime).wall_time


def _describe(record: tuple[Any, ...]) -> tuple[str, str]:
    return record[1], f"{'add_scalar' if record[0] == _ONE else 'add_scalars'}({record[1]!r})"


class SummaryWriter(_TorchWriter):
    """`torch.utils.tensorboard.SummaryWriter` whose add_scalar and add_scalars take CUDA tensors
    without a sync. Same constructor, plus:

    every: rows per device-to-host copy (one copy per `every` scalar calls; default 50, a
        positive int).
    max_delay: seconds after which the next scalar call hands over the rows anyway, so a slow
        loop still shows up in TensorBoard (None: only every `every` calls, flush and close).

    `latest` ({tag: value}) and `latest_step` hold the most recent values written, a few steps
    behind the loop; `syncless.tqdm(..., log=writer)` shows them. Bad input (a tensor with
    several elements, a complex one, a tag that is not UTF-8) raises at the call, naming the
    tag, with the exception type torch's writer raises (a value of other than one element:
    ScalarShapeError, both torch's AssertionError and a ValueError); what torch accepts (a
    number in a str, numpy scalars, Decimal, a float step) is written as torch writes it. A
    refusal that depends on a tensor's value (a NaN step tensor) cannot be known at the call
    without a sync: it is reported at delivery, once per tag, and counted in `errors`; every
    other scalar is written.
    """

    def __init__(self, log_dir: Any = None, comment: str = "", purge_step: int | None = None,
                 max_queue: int = 10, flush_secs: int = 120, filename_suffix: str = "", *,
                 every: int = ADAPTER_EVERY, max_delay: float | None = 2.0):
        self._deferred = Deferred(self._replay, _describe,
                                  Failures("syncless.tensorboard", "writer.errors"), every,
                                  max_delay, step_name="global_step", step_of=_global_step,
                                  step_tensor=_step_tensor)
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
        _check_tag(tag)
        if type(scalar_value) is not torch.Tensor:
            scalar_value = _scalar(tag, scalar_value)
        elif scalar_value.numel() != 1 or scalar_value.dtype.is_complex:
            _scalar(tag, scalar_value)                  # raises torch's exception type
        if type(global_step) is int and not -2**63 <= global_step < 2**63:
            _global_step(global_step)                   # raises as the event's field would
        self._deferred.put((_ONE, tag, new_style, double_precision), (scalar_value,), (tag,),
                           global_step, _walltime(walltime))

    def add_scalars(self, main_tag: str, tag_scalar_dict: dict[str, Any], global_step: Any = None,
                    walltime: float | None = None) -> None:
        items = tag_scalar_dict.items()                 # torch's AttributeError for a non-dict
        if not items:
            return                                      # torch writes nothing either
        if not isinstance(main_tag, str):               # torch: main_tag.replace(...) fails
            raise AttributeError(f"main_tag must be str, got {type(main_tag).__name__} "
                                 f"{main_tag!r} (it has no attribute 'replace')")
        _check_tag(main_tag)
        names = tuple(tag for tag, _ in items)
        for name in names:
            if not isinstance(name, str):               # torch: logdir + "_" + tag fails
                raise TypeError(f"add_scalars({main_tag!r}): tags must be str, got "
                                f"{type(name).__name__} {name!r}")
            _check_tag(name)
        values = [_scalar(f"{main_tag}/{name}", value) for name, value in items]
        if type(global_step) is int and not -2**63 <= global_step < 2**63:
            _global_step(global_step)
        self._deferred.put((_MANY, main_tag, names), values,
                           [f"{main_tag}/{name}" for name in names], global_step,
                           _walltime(walltime))

    # ---- delivery (the logger's thread) ------------------------------------------------------

    def _replay(self, record: tuple[Any, ...], values: list[float], step: Any,
                wall: float) -> None:
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
