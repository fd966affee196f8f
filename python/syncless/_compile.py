"""log() and timer() inside torch.compile.

Dynamo cannot trace Logger.log (C calls, host counters, wall time), and a graph break splits the
graph and, under mode="reduce-overhead", the CUDA graph. So while Dynamo traces, Logger.log
hands over to `log()` here, which puts one custom op, `syncless::log`, in the graph:

* At trace time `_site()` runs as real Python (torch._dynamo.assume_constant_result): it records
  the call site (the logger and the metric names) and returns its number, a constant of the
  graph, like the names. Tensor values are graph tensors; a Python number goes to the op as a
  float, a constant of the graph (a tensor made in the graph would be a kernel on every step;
  the gather takes the number as an immediate). The trace reads none of the logger's state
  (steps, columns), so new values and metrics logged elsewhere never recompile; a new metric
  name inside the compiled region needs no eager call first: it gets its column when the op
  first runs. Dynamo's own rules still apply to what the user passes: an explicit step= int is
  specialised at the first trace and made dynamic at the second value (one recompile).
* A Python number (lr=0.01, epoch=3) is, at a call site's first trace, a float argument of the
  op: a constant of the graph, no kernel, guarded by Dynamo. One that changes (a scheduler's lr,
  a token count) fails that guard once: the recompile traces the same site again, and a site
  whose op has run before gets its numbers as tensor math (`zeros + number`, one tiny kernel),
  in which Dynamo makes a changed number dynamic, as in the user's own arithmetic. So a
  changing number costs one recompile, where a constant op argument would recompile at every
  new value until Dynamo's recompile_limit and then run the function uncompiled. (With
  automatic dynamic shapes off, Dynamo specialises every number.) Under reduce-overhead a
  dynamic number is a host value, which a CUDA graph cannot replay: inductor splits the graph
  around it (two partitions), the cost of any host number in a CUDA-graphed step; a number
  that changes every step is cheaper logged by an eager log() after the compiled call.
* The op declares one tensor mutated: a one-element token per (logger, device), made at trace
  time and marked a static address. A mutated input keeps the op alive through functionalization
  and dead-code elimination, keeps a logger's calls in program order, and, being static, lets
  cudagraph trees capture the graph instead of skipping it. Nothing ever writes to the token.
* At run time the op's implementation is the eager path, `logger.log({name: value}, step)`: the
  same step rule, flush policy, errors and host rows as eager code. Under CUDA graph capture
  (reduce-overhead's recording) that gather is captured like a hand-captured log(): every replay
  appends one row per captured call, and its step is the ring's next step, which the GPU counts
  (every gather sets it to its step + 1). So steps stay consecutive, as in eager code, across
  several log() calls in one graph, graphs that cudagraph trees re-record (new shapes or input
  addresses) and their eager warm-up runs, and eager log() calls after replays. The host sees
  no replay, so flushes wait for the next eager log() or flush() and rows overwritten before
  one are counted in stats.lost: call log.flush(wait=False) every few hundred steps. The host
  never learns how many replays ran (reading the GPU's count would be a sync): once a graph
  captured a call, `log.steps_on_device()` is True, `log.last_step` is the last step the host
  assigned, and what needs the current step from the host (attach() or timer(log=...) without
  step=) raises and asks for step=. An explicit step= or a CPU tensor under capture would be
  replayed unchanged, so both are refused there with an error.
* What a replay costs is measured, not assumed: benchmarks/results/compile_user-*.md (a
  nanoGPT-style GPT logging inside its forward: +0.05% under reduce-overhead),
  compile_step-infer.md and compile_step-train.md (MLP steps), and the breakdown in
  compile_diag.md. The token is a static input (its address checked in C++ with
  the parameters'), its mutation stays in the graph (no copy-back) and the op adds no graph
  output; the op's share is its gather kernel, the token and the guards; the larger share is
  the rows' delivery on the logger's thread, which shares the GIL with the training thread:
  mostly a fixed cost per flush, paid in the two steps after it
  (archive/flush_profile-infer-804c223.md: ~370 us on a 147-us inference step, the same when the
  thread takes the GIL once per flush instead of twice), the rows themselves ~0.3 us each
  (hotpath_probe.txt, archive/compile_step-flush1000.md). Logger(delivery="caller") delivers them
  at the next flush on the training thread instead: 0.8-1.6% faster than the thread on that step
  (archive/compile_step-eb9cc3f.md, compile_step-infer.md), no difference resolved on the
  training one.
* A row's time is the host time when the op ran, as in eager code; a row written by a CUDA
  graph replay had no host call, so its time is that of the flush that found it.

syncless.timer() inside a compiled region is a graph break with a stated reason (an error under
fullgraph=True): its events would mark points in a graph that inductor reorders and fuses across,
and a CUDA graph cannot record timing events; time the compiled call from outside.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch

from ._ring import DeviceRing

__all__ = ["tracing", "track", "log", "timer_new"]

# The check on the eager hot path: a Python function returning False (tens of ns), which Dynamo
# folds to True. torch.compiler.is_compiling() costs several times more (it asks TorchScript).
tracing = getattr(torch.compiler, "is_dynamo_compiling", None) or (lambda: False)

_loggers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def track(logger: Any) -> None:
    """Called by Logger.__init__: the trace-time code finds a logger by id()."""
    _loggers[id(logger)] = logger


# ---- call sites --------------------------------------------------------------------------------

class _Site:
    __slots__ = ("logger_id", "logger", "names", "numbers", "device", "host_tensors", "token",
                 "ran")

    def __init__(self, logger: Any, names: tuple[str, ...], numbers: tuple[bool, ...],
                 device: str, host_tensors: bool, token: torch.Tensor):
        self.logger_id = id(logger)
        self.logger = weakref.ref(logger)
        self.names = names
        self.numbers = numbers              # per name: a Python number (a graph constant)?
        self.device = device
        self.host_tensors = host_tensors    # read at capture, replayed unchanged: refused there
        self.token = token
        self.ran = False                    # has the op run (see _ran_before)


class _Tokens:
    """Site i's token is attribute t<i>: Dynamo then guards that attribute alone, where a list or
    dict of tokens would be guarded whole and every new site would recompile every graph."""


_sites: list[_Site] = []
_keys: dict[tuple[Any, ...], int] = {}
_by_site = _Tokens()
_tokens: "weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()
# per logger: the names of the call sites whose op ran
_ran: "weakref.WeakKeyDictionary[Any, set[tuple[str, ...]]]" = weakref.WeakKeyDictionary()


def _token(logger: Any, device: str) -> torch.Tensor:
    per_device = _tokens.setdefault(logger, {})
    token = per_device.get(device)
    if token is None:
        token = torch.zeros(1, dtype=torch.uint8, device=device)
        # Static: cudagraph trees capture graphs that mutate static inputs and skip the rest.
        torch._dynamo.mark_static_address(token, guard=True)
        per_device[device] = token
    return token


_F = TypeVar("_F", bound=Callable[..., Any])


def _trace_time(fn: _F) -> _F:
    """torch._dynamo.assume_constant_result, which only sets this flag (torch 2.0 to 2.13):
    Dynamo then calls fn for real while tracing and puts its result in the graph as a constant.
    Set here by hand because importing torch._dynamo takes seconds, and syncless is imported
    by DataLoader workers and scripts that never compile."""
    setattr(fn, "_dynamo_marked_constant", True)
    return fn


@_trace_time
def _number_device(logger_id: int, cuda: Optional[str]) -> str:
    """Trace time: where a Python number's tensor goes: the values' GPU, else the logger's."""
    if cuda is not None:
        return cuda
    logger = _loggers.get(logger_id)
    return "cpu" if logger is None else str(logger.device)


@_trace_time
def _ran_before(logger_id: int, names: tuple[str, ...]) -> bool:
    """Trace time: has an op of this call site (logger, names) run? Then this trace is most
    likely a recompile, maybe for a number that changed: its numbers become tensor math. Set
    when the op runs, never while tracing, so a trace that Dynamo restarts takes the same path."""
    logger = _loggers.get(logger_id)
    return logger is not None and names in _ran.get(logger, ())


@_trace_time
def _site(logger_id: int, names: tuple[str, ...], devices: tuple[Any, ...]) -> int:
    """Trace time, real Python: the number of the call site (the graph's constant)."""
    logger = _loggers.get(logger_id)
    if logger is None:
        raise RuntimeError("syncless: log() inside torch.compile on an object that is not a "
                           "live syncless.Logger")
    # Bad names, closed loggers and mixed devices are refused when the op runs, by the eager
    # path, with its errors: an exception raised here would reach the user wrapped by Dynamo.
    devices = tuple(str(d) for d in devices)             # torch.device objects, or "number"
    cuda = [d for d in devices if d.startswith("cuda")]
    host_tensors = "cpu" in devices
    numbers = tuple(d == "number" for d in devices)
    # The token lives with the values; a call of numbers only, with the logger (a CPU token in
    # a CUDA graph would make cudagraph trees skip the graph).
    device = cuda[0] if cuda else "cpu" if host_tensors else str(logger.device)
    if cuda:
        # Allocate the ring now, as eager code would at its first CUDA log(): the first run of
        # a reduce-overhead graph (its warm-up) allocates from the CUDA graphs' private pool.
        logger.device_ring(torch.device(device).index)
    key = (logger_id, names, devices)
    index = _keys.get(key)
    if index is not None and _sites[index].logger() is logger:
        return index
    index = len(_sites)
    _sites.append(_Site(logger, names, numbers, device, host_tensors, _token(logger, device)))
    setattr(_by_site, f"t{index}", _sites[index].token)
    _keys[key] = index
    return index


# ---- the op ------------------------------------------------------------------------------------

_CAPTURED_STEP = ("log(step=...) inside a CUDA graph (torch.compile mode='reduce-overhead'): a "
                  "replay cannot take a step from the host; without step= every replay takes "
                  "the next step, counted on the GPU. Drop step= or compile without CUDA graphs")
_CAPTURED_HOST = ("metrics {names!r}: a CPU tensor inside a CUDA graph would log its value at "
                  "capture on every replay; log it outside the graph or move it to the GPU")


def _run(index: int, values: list[torch.Tensor], numbers: list[float],
         step: Optional[int]) -> None:
    site = _sites[index]
    logger = site.logger()
    if logger is None:
        logger = _loggers.get(site.logger_id)
        if logger is None:
            raise RuntimeError("syncless: the Logger this compiled code logs to no longer exists")
    if not site.ran:
        site.ran = True
        _ran.setdefault(logger, set()).add(site.names)
    if step is not None or site.host_tensors:
        bound: DeviceRing | None = logger.device_ring()
        if bound is not None and bound.ring.capturing():
            raise RuntimeError(_CAPTURED_STEP if step is not None
                               else _CAPTURED_HOST.format(names=site.names))
    tensors, floats = iter(values), iter(numbers)
    # A number is a constant of the graph: the gather takes it as an immediate (no kernel).
    logger.log({name: next(floats) if number else next(tensors)
                for name, number in zip(site.names, site.numbers)}, step)


def _define_op() -> Any:
    """syncless::log, defined with torch.library.Library and a CompositeExplicitAutograd
    kernel: a call the compiled code makes (every step without CUDA graphs) goes through the
    C++ dispatcher's fallbacks to `_run`. torch.library.custom_op would wrap it in its Python
    autograd and view handling: ~200 us a call on a 2-core host against ~10 us this way
    (measured with an input that requires grad, as a training step's loss does)."""
    if not hasattr(torch.library, "register_fake"):          # torch < 2.4
        return None
    ns = getattr(torch.ops, "syncless", None)
    if ns is None or not hasattr(ns, "log"):                 # once per process
        library: Callable[[str, str], Any] = torch.library.Library   # (unannotated in torch)
        lib = library("syncless", "FRAGMENT")
        # SymInt: an explicit step= that Dynamo made dynamic reaches the op without a guard
        lib.define("log(Tensor(a!) token, Tensor[] values, float[] numbers, SymInt site, "
                   "SymInt? step) -> ()")
        lib.impl("log", _log_kernel, "CompositeExplicitAutograd")
        torch.library.register_fake("syncless::log", _log_fake, lib=lib)
        _libraries.append(lib)                               # its registrations live with it
    return torch.ops.syncless.log.default


def _log_kernel(token: torch.Tensor, values: list[torch.Tensor], numbers: list[float],
                site: int, step: Optional[int]) -> None:
    _run(site, values, numbers, step)


def _log_fake(token: torch.Tensor, values: list[torch.Tensor], numbers: list[float], site: int,
              step: Optional[int]) -> None:
    return None


_libraries: list[Any] = []
_log_op = _define_op()


# ---- what Dynamo traces ------------------------------------------------------------------------

def _traced_log() -> Callable[[Any, Mapping[str, Any], Any], None]:
    """Logger.log while Dynamo traces, as a closure: what it uses is in its cells, so the trace
    reads no global of this module (Dynamo would then reach this module both as the logger's
    `_compile` and under its own name, and guard that they are one object with a Python lambda
    run before every call of the compiled code) and guards one object per cell. Python numbers
    go to the op as floats, graph constants, not as tensors made in the graph (a kernel each),
    until the site's op has run (see the top)."""
    op = _log_op
    site_of, number_device, tokens, ran_before = _site, _number_device, _by_site, _ran_before
    Tensor, full, zeros, float64 = torch.Tensor, torch.full, torch.zeros, torch.float64

    def log(logger: Any, metrics: Mapping[str, Any], step: Any) -> None:
        if op is None:
            raise RuntimeError("syncless: log() inside torch.compile needs torch >= 2.4 "
                               f"(torch.library.register_fake); this is torch {torch.__version__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        names = tuple(metrics)
        again = ran_before(id(logger), names)       # numbers as tensor math (see the top)
        values: list[Any] = []
        numbers: list[float] = []
        kinds: list[Any] = []                        # per name: a device, "number" or None
        cuda: torch.device | None = None
        for v in metrics.values():
            if isinstance(v, Tensor):
                values.append(v)
                kinds.append(v.device)
                if cuda is None and v.device.type == "cuda":
                    cuda = v.device
            elif isinstance(v, (int, float)) and not again:     # bool too
                numbers.append(float(v))             # a guarded constant of the graph
                kinds.append("number")
            else:
                # A number at a site whose op has run, or anything else (a NumPy number, a bad
                # value): a graph value on the values' GPU, else the logger's device (a CPU op
                # would make a CUDA graph skip): a number by tensor math, in which Dynamo can
                # make it dynamic; the rest by torch.full, which refuses what is not a number.
                values.append(v)
                kinds.append(None)
        if None in kinds:
            device = number_device(id(logger), None if cuda is None else str(cuda))
            j = 0
            for i, k in enumerate(kinds):
                if k == "number":
                    continue
                if k is None:
                    v = values[j]
                    values[j] = (zeros((), dtype=float64, device=device) + v
                                 if isinstance(v, (int, float)) else
                                 full((), v, dtype=float64, device=device))
                    kinds[i] = values[j].device
                j += 1
        index = site_of(id(logger), names, tuple(kinds))
        op(getattr(tokens, f"t{index}"), values, numbers, index, step)

    return log


log = _traced_log()


# ---- the timer ---------------------------------------------------------------------------------

_TIMER_REASON = ("syncless.timer() inside torch.compile: its CUDA events would mark points in "
                 "a graph that inductor reorders and fuses across, and a CUDA graph cannot "
                 "record timing events; time the compiled call from outside the compiled code")


class _Disabled:
    """The timer's eager functions wrapped in torch.compiler.disable, made at the first trace
    that meets a timer (torch.compiler.disable imports torch._dynamo: seconds)."""
    new: Callable[..., Any]         # timer_new's eager half, once made


_disabled = _Disabled()


@_trace_time
def _make_disabled() -> int:
    if not hasattr(_disabled, "new"):
        disable: Callable[..., Callable[..., Any]] = torch.compiler.disable   # (unannotated)

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            try:
                return disable(fn, reason=_TIMER_REASON)
            except TypeError:                             # torch < 2.8: no reason=
                return disable(fn)
        _disabled.new = wrap(lambda cls, name, device, log, step:
                             cls()(name) if callable(name) else cls(name, device, log, step))
    return 0


def timer_new(cls: type, name: Any, device: Any, log: Any, step: Any) -> Any:
    """syncless.timer(...) while Dynamo traces: a graph break, then the eager factory."""
    _make_disabled()
    return _disabled.new(cls, name, device, log, step)


