"""Where delivered metrics go.

A sink is any object with `write(rows)`; `flush()` and `close()` are optional. `rows` is a list of
`syncless.Row(step, time, values)` in step order, `values` a dict of plain floats: a sink never
sees a tensor and can never cause a sync. Sinks run on the logger's delivery thread, one window
at a time. A sink that raises is reported once and skipped for that window; the others go on.

    class Stdout:
        def write(self, rows):
            for r in rows:
                print(r.step, r.values)

Backends that need an optional package (TensorBoard, W&B) import it on construction and raise an
ImportError with the install hint when it is missing.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from typing import Any, Callable, TextIO

__all__ = ["Callback", "JSONL", "CSV", "Print", "TensorBoard", "WandB"]


def _open(path: str, mode: str, newline: str | None = None) -> TextIO:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return open(path, mode, newline=newline, encoding="utf-8")


class Callback:
    """Call fn(step, time, values) for every delivered row."""

    def __init__(self, fn: Callable[[int, float, dict], Any]):
        self.fn = fn

    def write(self, rows) -> None:
        for row in rows:
            self.fn(row.step, row.time, row.values)

    def __repr__(self) -> str:
        return f"Callback({getattr(self.fn, '__qualname__', self.fn)!r})"


class JSONL:
    """One JSON object per step: {"step": 7, "time": 1733000000.12, "loss": 0.5, ...}.
    NaN and Inf are written as JSON's NaN/Infinity extensions (Python's json reads them)."""

    def __init__(self, path: str | os.PathLike, mode: str = "a"):
        self.path = os.fspath(path)
        self._f = _open(self.path, mode)

    def write(self, rows) -> None:
        lines = [json.dumps({"step": r.step, "time": r.time, **r.values}) for r in rows]
        self._f.write("\n".join(lines) + "\n")

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __repr__(self) -> str:
        return f"JSONL({self.path!r})"


class CSV:
    """step,time,<metric>... with a column per metric; when a new metric appears the file is
    rewritten once with the wider header (earlier rows leave the new column empty)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.columns: list[str] = []
        self._f = _open(self.path, "w", newline="")
        self._writer = csv.writer(self._f)

    def write(self, rows) -> None:
        new = []
        for r in rows:
            for name in r.values:
                if name not in self.columns and name not in new:
                    new.append(name)
        if new:
            self._widen(new)
        cols = self.columns
        self._writer.writerows(
            [r.step, repr(r.time)] + [repr(r.values[c]) if c in r.values else "" for c in cols]
            for r in rows)

    def _widen(self, new: list[str]) -> None:
        self._f.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            old = list(csv.reader(f))[1:]
        pad = [""] * len(new)
        self.columns += new
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["step", "time"] + self.columns)
            w.writerows(row + pad for row in old)
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._f)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __repr__(self) -> str:
        return f"CSV({self.path!r})"


class Print:
    """One compact line per window: the last value and the window mean of each metric."""

    def __init__(self, file: TextIO | None = None, digits: int = 4):
        self.file = file
        self.digits = digits

    def write(self, rows) -> None:
        last: dict[str, float] = {}
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for r in rows:
            for k, v in r.values.items():
                last[k] = v
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
        g = f".{self.digits}g"
        parts = [f"{k} {last[k]:{g}} (mean {sums[k] / counts[k]:{g}})" for k in last]
        span = f"{rows[0].step}-{rows[-1].step}" if len(rows) > 1 else f"{rows[0].step}"
        print(f"step {span} | " + " | ".join(parts), file=self.file or sys.stdout, flush=True)

    def __repr__(self) -> str:
        return "Print()"


def _missing(package: str, extra: str) -> ImportError:
    return ImportError(f"this sink needs {package}: pip install syncless[{extra}]")


class TensorBoard:
    """Write every row as scalars to a TensorBoard event file, at its step and wall time (the
    host time of the log() call). Pass a log directory (extra keyword arguments go to torch's
    SummaryWriter) or an existing writer: torch's, tensorboardX's or syncless.tensorboard's."""

    def __init__(self, log_dir: str | os.PathLike | Any = None, **writer_kwargs: Any):
        if log_dir is not None and hasattr(log_dir, "add_scalar"):
            self.writer, self._owned = log_dir, False
        else:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise _missing("tensorboard", "tensorboard") from exc
            self.writer, self._owned = SummaryWriter(log_dir, **writer_kwargs), True
        # A syncless writer would defer these floats a second time; write them directly.
        self._add = getattr(self.writer, "_write_scalar", self.writer.add_scalar)

    def write(self, rows) -> None:
        add = self._add
        for r in rows:
            for name, v in r.values.items():
                add(name, v, r.step, r.time)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()

    def __repr__(self) -> str:
        return f"TensorBoard({getattr(self.writer, 'log_dir', '?')!r})"


class WandB:
    """Log every row to a W&B run (the active one at delivery by default) at its step, with
    `_timestamp` the host time of the log() call. The logger's steps become the run's steps:
    wandb ignores a step below the run's current one, so let the logger own the step count.
    Consecutive rows of one step go in one run.log call. The run is not finished on close()."""

    def __init__(self, run: Any = None):
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb") from exc
        self._wandb = wandb
        self._run = run

    @property
    def run(self):
        run = self._run or self._wandb.run
        if run is None:
            raise RuntimeError("syncless.sinks.WandB: no W&B run; call wandb.init() first or "
                               "pass run=")
        return run

    def write(self, rows) -> None:
        run = self.run
        step, data = None, {}
        for r in rows:
            if r.step != step and data:
                run.log(data, step=step)
                data = {}
            step = r.step
            data.update(r.values)
            data["_timestamp"] = r.time
        if data:
            run.log(data, step=step)

    def __repr__(self) -> str:
        return "WandB()"
