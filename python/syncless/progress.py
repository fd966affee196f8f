"""A tqdm progress bar whose postfix shows logged metrics without ever reading a tensor.

    log = syncless.Logger(every=50)
    for batch in syncless.tqdm(loader, log=log):      # was: tqdm(loader) + set_postfix(loss=...)
        ...
        log(loss=loss)

The postfix is built only when tqdm redraws (at most every `mininterval` seconds), from
`log.latest`: the values the logger has already delivered, so it runs `every` steps or so behind
the loop and costs nothing per iteration. `log` can be a syncless.Logger, a
syncless.tensorboard.SummaryWriter, the syncless.wandb module, or anything with a `latest` dict.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Iterable, Sequence

__all__ = ["tqdm"]

_log = logging.getLogger("syncless")

_classes: dict[str, type] = {}


def _bar_class() -> type:
    cls = _classes.get("tqdm")
    if cls is not None:
        return cls
    try:
        import tqdm.std                                  # a missing tqdm fails here, by name
        # tqdm.auto's class adds tqdm.asyncio, whose __init__ calls iter(iterable) at once: a
        # second iterator nobody uses, which draws a seed from a shuffled DataLoader (other
        # batches than plain tqdm) and starts a worker pool. tqdm.auto minus that layer.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tqdm.std.TqdmExperimentalWarning)
            from tqdm.autonotebook import tqdm as base
    except ImportError as exc:
        raise ImportError("syncless.tqdm needs tqdm: pip install tqdm "
                          "(from a syncless checkout: pip install -e '.[progress]')") from exc
    # The bar: the class below on tqdm's (imported only now, so syncless never needs tqdm).
    cls = _classes["tqdm"] = type("SynclessTqdm", (_Postfix, base),
                                  {"__module__": __name__, "__doc__": _Postfix.__doc__})
    return cls


# tqdm ships no types: to the type checker the bar's base is Any.
_TqdmBase: Any = object


class _Postfix(_TqdmBase):  # type: ignore[misc]  # (its base is tqdm's, see _bar_class)
    """tqdm, plus log=, keys= and fmt=; the postfix follows log.latest."""

    def __init__(self, *args: Any, log: Any = None, keys: Sequence[str] | None = None,
                 fmt: str = ".4g", **kwargs: Any):
        self._sl_keys = _check(log, keys, fmt)
        self._sl_log = log
        self._sl_fmt = fmt
        self._sl_seen: Any = None
        self._sl_failed = False
        super().__init__(*args, **kwargs)

    def _sl_update_postfix(self) -> None:
        log = getattr(self, "_sl_log", None)
        if log is None:
            return
        latest = dict(log.latest)            # one C-level copy: the delivery thread writes it
        if latest == self._sl_seen:
            return
        self._sl_seen = latest
        keys = self._sl_keys if self._sl_keys is not None else latest
        fmt = self._sl_fmt
        parts = []
        for key in keys:
            if key in latest:
                value = latest[key]
                text = format(value, fmt) if isinstance(value, float) else str(value)
                parts.append(f"{key}={text}")
        step = getattr(log, "delivered_step", None)
        if isinstance(step, int) and step >= 0 and parts:
            parts.append(f"@{step}")
        self.postfix = ", ".join(parts)

    def __aiter__(self) -> Any:
        """`async for`, as tqdm.auto allows it, with the one iterator made here."""
        source = self.iterable
        if hasattr(source, "__aiter__"):
            self._sl_next, self._sl_await = source.__aiter__().__anext__, True
        else:
            self._sl_next, self._sl_await = iter(source).__next__, False
        return self

    async def __anext__(self) -> Any:
        try:
            value = self._sl_next()
            if self._sl_await:
                value = await value
        except (StopIteration, StopAsyncIteration):
            self.close()
            raise StopAsyncIteration from None
        except BaseException:
            self.close()
            raise
        self.update()
        return value

    def display(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self._sl_update_postfix()
        except Exception as exc:            # a redraw must never stop the training loop
            if not self._sl_failed:
                self._sl_failed = True
                _log.error("syncless.tqdm: building the postfix from %r failed: %s: %s "
                           "(reported once; the bar goes on)", self._sl_log,
                           type(exc).__name__, exc)
        return super().display(*args, **kwargs)


def _check(log: Any, keys: Any, fmt: Any) -> tuple[str, ...] | None:
    """Refuse, at construction, what would otherwise fail at every redraw; the keys as a tuple."""
    if log is not None and not hasattr(log, "latest"):
        raise TypeError(f"log must have a `latest` dict (a syncless.Logger, "
                        f"syncless.tensorboard.SummaryWriter, syncless.wandb), got "
                        f"{type(log).__name__}")
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of metric names, got the str {keys!r} "
                        f"(keys=[{keys!r}] shows one)")
    names: tuple[str, ...] | None = None if keys is None else tuple(keys)
    if names is not None and not all(isinstance(k, str) for k in names):
        raise TypeError(f"keys must be metric names (str), got {list(names)!r}")
    try:
        format(1.5, fmt)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fmt {fmt!r} is not a format spec for a float: {exc}") from None
    return names


def tqdm(iterable: Iterable[Any] | None = None, *args: Any, log: Any = None,
         keys: Sequence[str] | None = None, fmt: str = ".4g", **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm(iterable, ...)` whose postfix shows `log.latest` (a few steps late).
    The iterable is iterated once, by the loop (plain tqdm's batches, for a shuffled loader too).

    keys: which metrics to show, in order (default: all, in order of first delivery).
    fmt: format spec for float values.
    """
    return _bar_class()(iterable, *args, log=log, keys=keys, fmt=fmt, **kwargs)
