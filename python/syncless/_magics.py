"""IPython magics, loaded by `%load_ext syncless` (IPython is imported only then).

    %%gputime                 one timed run of the cell: GPU ms (CUDA events) and CPU ms
    %gputime stmt             the same for one statement
    %gputimeit stmt           warm-up, repeats, median and spread: %timeit, correct on the GPU
    %%gputimeit [setup]       the cell is the statement; the line's rest runs once before

Options: -n REP, -w WARMUP (counts; default: about one second of reps, at most 100 after 25
warm-up), --no-flush (keep the L2 cache warm between reps), -d DEVICE, -o (return the Stats).
"""
from __future__ import annotations

import textwrap
from types import CodeType
from typing import Any, Callable, TypeVar

from IPython.core.magic import Magics, line_cell_magic, magics_class

from .timer import Stats, Timing, _device_name, _fmt, _parse_device, _resolve, bench, timer


_F = TypeVar("_F", bound=Callable[..., Any])
# IPython's decorator, typed (IPython leaves it unannotated): it returns the function it marks.
_line_cell_magic: Callable[[_F], _F] = line_cell_magic


def _reading(t: Timing) -> str:
    if t.device.type == "cpu":
        return f"cpu {t.ms:.3f} ms (wall clock: CUDA not in use)"
    return f"gpu {t.ms:.3f} ms, cpu {t.cpu_ms:.3f} ms ({t.device})"


def _summary(s: Stats, warmup: int, flushed: bool, device: str) -> str:
    where = "wall clock" if device == "cpu" else \
        f"CUDA events on {device}, {'L2 flushed' if flushed else 'L2 warm'}"
    return (f"{_fmt(s.median)} ms median (min {_fmt(s.min)}, p90 {_fmt(s.p90)}, max {_fmt(s.max)}"
            f" ms; {s.count} runs after {warmup} warm-up; {where})")


@magics_class
class TimerMagics(Magics):

    @property
    def _ns(self) -> dict[str, Any]:
        """The user's namespace (the shell is set once the magics are registered)."""
        assert self.shell is not None
        ns: dict[str, Any] = self.shell.user_ns
        return ns

    def _code(self, source: str, filename: str) -> CodeType:
        assert self.shell is not None
        return compile(self.shell.transform_cell(source), filename, "exec")

    def _function(self, statement: str) -> Callable[[], None]:
        """The statement as the body of a function whose globals are the user's namespace, so
        repeats pay no exec() per call."""
        assert self.shell is not None
        body = self.shell.transform_cell(statement)
        src = "def __syncless_timed():\n" + textwrap.indent(body, "    ") + "    pass\n"
        local: dict[str, Any] = {}
        exec(compile(src, "<gputimeit>", "exec"), self._ns, local)
        fn: Callable[[], None] = local["__syncless_timed"]
        return fn

    def _options(self, line: str, *spec: str) -> tuple[Any, str]:
        """IPython's parse_options (unannotated there): (options, the rest of the line)."""
        parse: Callable[..., tuple[Any, str]] = self.parse_options
        return parse(line, *spec, posix=False, strict=False, preserve_non_opts=True)

    @_line_cell_magic
    def gputime(self, line: str, cell: str | None = None) -> None:
        """Time one run of a statement or cell: GPU ms from CUDA events, CPU ms beside."""
        opts, rest = self._options(line, "d:")
        code = self._code(cell if cell is not None else rest, "<gputime>")
        ns = self._ns
        with timer(device=opts.get("d")) as t:
            exec(code, ns)
        print(_reading(t))

    @_line_cell_magic
    def gputimeit(self, line: str, cell: str | None = None) -> Stats | None:
        """Benchmark a statement or cell: warm-up, repeats, median and spread."""
        opts, rest = self._options(line, "n:w:d:o", "no-flush")
        if cell is not None:
            if rest.strip():
                exec(self._code(rest, "<gputimeit setup>"), self._ns)
            statement = cell
        else:
            statement = rest
        if not statement.strip():
            print("usage: %gputimeit [-n REP] [-w WARMUP] [--no-flush] [-d DEVICE] [-o] stmt")
            return None
        fn = self._function(statement)
        device = opts.get("d")
        flush = "no-flush" not in opts
        if "n" in opts:
            rep = int(opts["n"])
            warmup = int(opts.get("w", 25))
        else:
            with timer(device=device) as first:       # also the first warm-up call
                fn()
            rep = int(min(100, max(5, 1000.0 / max(first.ms, 1e-3))))
            warmup = int(opts["w"]) if "w" in opts else min(25, max(1, rep // 4))
        stats = bench(fn, warmup=warmup, rep=rep, flush_l2=flush, device=device)
        used = _device_name(_resolve(_parse_device(device)))     # as bench() chose it
        print(_summary(stats, warmup, flush, used))
        return stats if "o" in opts else None
