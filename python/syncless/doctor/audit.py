"""syncless.audit(): every host-device sync in a block, with its line and the time it blocked.

    with syncless.audit() as a:
        for _ in range(20):
            train_step()
    print(a.report())

How: CUPTI's callback API (syncless._cupti) sees every CUDA runtime and driver call of the thread
that entered the block, times the outermost ones and reports those that made the CPU wait for the
GPU: explicit synchronizes (stream, device, event), synchronous copies, "async" copies that
blocked (pageable host memory) and cudaFree. Each is attributed to the first frame of the user's
code. Where CUPTI cannot subscribe (torch.profiler or Nsight holds it, no libcupti), torch's sync
debug mode is the fallback; the report then says what it cannot see.
"""
from __future__ import annotations

import atexit
import glob
import os
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, TextIO

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _cupti
from ._frames import Site, outside_syncless, user_site
from .report import ReportText, audit_repr, render_audit

__all__ = ["audit", "Audit", "SyncSite", "SyncError"]

# The kinds of call syncless._cupti reports, defined once in csrc/cupti.c. Importing _cupti
# loads only its own small module: libcupti is opened by load(), at the first audit.
SYNC, COPY, ASYNC_COPY, FREE, SLOW = (_cupti.SYNC, _cupti.COPY, _cupti.ASYNC_COPY, _cupti.FREE,
                                      _cupti.SLOW)
_SYNC_KINDS = (SYNC, COPY, ASYNC_COPY, FREE)

FALLBACK_MISSES = ("torch.cuda.synchronize(), Event.synchronize() and pageable non_blocking "
                   "copies are not seen, and no sync's blocked time is measured")


class SyncError(RuntimeError):
    """Raised by audit(strict=True) at the first host-device sync in the block."""


@dataclass
class SyncSite:
    """One line of user code that synchronised, aggregated over the block."""
    site: Site
    what: dict[str, int] = field(default_factory=dict)    # {"cudaStreamSynchronize": count, ...}
    count: int = 0
    blocked_ns: int = 0
    kinds: set[int] = field(default_factory=set)

    @property
    def where(self) -> str:
        return self.site.where

    def blocked_ms(self) -> float:
        return self.blocked_ns / 1e6

    def fix(self) -> str:
        return suggest_fix(self.site.code, self.kinds, self.what)


def suggest_fix(code: str, kinds: set[int], what: dict[str, int]) -> str:
    """The concrete change for one sync site, from the CUDA calls seen and the source line."""
    names = " ".join(what)
    pageable = ("the host tensor is pageable, so the 'async' copy blocks: pin it "
                "(DataLoader(pin_memory=True) or t.pin_memory() once) and keep non_blocking=True")
    if "non_blocking" in code:
        return pageable
    # .item() and its kin read into pageable host memory with cudaMemcpyAsync, which waits
    # for the GPU's queue when it is busy: an "async" copy that blocked, but a host read.
    # float(x), int(x): the builtins, not x.float() (a cast) nor print( (which holds "int(")
    host_read = re.search(r"\.item\(\)|\.tolist\(\)|(?<![\w.])(float|int)\(|\.cpu\(\)|\.numpy\(\)",
                          code)
    # Logging calls that read the tensor (torch's TensorBoard writer is torch's code, so the
    # user's line is the call; wandb's own frames are matched in _frameworks).
    tensorboard = re.search(r"\.add_scalars?\(", code)
    wandb = re.search(r"\bwandb\.log\(", code)
    printed = re.search(r"\bprint\(|\bf[\"']|\.format\(|\blog(ger|ging)?\.(info|debug|warning)\(",
                        code)
    if ASYNC_COPY in kinds and not (host_read or tensorboard or wandb or printed):
        return pageable
    if re.search(r"cuda\.synchronize\(|DeviceSynchronize|CtxSynchronize", code + names):
        return ("remove the explicit synchronize; time GPU work with syncless.timer() (CUDA "
                "events) and let stream order do the rest")
    if "EventSynchronize" in names or ".synchronize()" in code:
        return ("don't wait on the event in the loop: poll event.query() or read the timing "
                "later (syncless.timer() does this without a wait)")
    if tensorboard:
        return ("SummaryWriter.add_scalar reads the value on the host: `from syncless.tensorboard "
                "import SummaryWriter` takes the same calls without a sync (pass the tensor "
                "itself, not .item())")
    if wandb:
        return ("`import syncless.wandb as wandb` takes the same wandb.log() calls without a "
                "sync (pass the tensors themselves, not .item())")
    if printed and not host_read:
        return ("formatting a tensor (print, f-string, logging) reads it on the host: log it "
                "with syncless.Logger (sinks=syncless.sinks.Print() prints each window), or "
                "print every N steps")
    if host_read:
        return ("log the tensor itself with syncless.Logger (one kernel, zero syncs) instead "
                "of reading it on the host every step")
    if re.search(r"nonzero|masked_select|\[.*(mask|>|<|==).*\]|unique\(", code):
        return ("data-dependent shapes sync: use torch.where / masked ops with fixed shapes "
                "(e.g. x * mask, torch.where(mask, x, 0)) instead of boolean indexing")
    if re.search(r"torch\.tensor\(|torch\.as_tensor\(", code):
        return ("build the constant once on the device outside the loop (or torch.full(..., "
                "device=)) instead of torch.tensor(..., device=) every step")
    if re.search(r"^\s*(if|while|assert)\b|\bbool\(", code):
        return ("a Python branch on a GPU value syncs: keep the decision on the device "
                "(torch.where) or check it every N steps")
    if FREE in kinds:
        return ("the caching allocator returned memory to CUDA (cudaFree syncs the device): "
                "avoid torch.cuda.empty_cache() in the loop and keep memory headroom")
    return "move this host read out of the step, or do it every N steps"


def _cupti_candidates() -> list[str]:
    """libcupti files shipped with torch's wheels (nvidia-cuda-cupti-*) or a CUDA toolkit,
    the one matching torch's CUDA major version first."""
    found: list[str] = []
    roots = [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    for root in roots:
        found += glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcupti.so*"))
        found += glob.glob(os.path.join(root, "nvidia", "*", "*", "lib", "libcupti.so*"))
    found += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcupti.so*"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += glob.glob(os.path.join(home, "lib64", "libcupti.so*"))
            found += glob.glob(os.path.join(home, "extras", "CUPTI", "lib64", "libcupti.so*"))
    major = (torch.version.cuda or "").split(".")[0]
    want = f"libcupti.so.{major}" if major else "libcupti.so"
    seen: dict[str, None] = {}
    for path in sorted(found, key=lambda p: (want not in os.path.basename(p), p)):
        seen.setdefault(path)
    return list(seen)


_cupti_lock = threading.Lock()


def _try_cupti() -> tuple[Any, str]:
    """(the _cupti module, "") when CUPTI can be used, else (None, why not)."""
    if torch._C._autograd._profiler_enabled():
        return None, "torch.profiler is active and holds CUPTI"
    if not _cupti.loaded():
        try:
            _cupti.load(_cupti_candidates())
        except OSError as e:
            return None, str(e)
    return _cupti, ""


def _stop_at_exit() -> None:
    try:
        _cupti.stop()
    except Exception:                             # interpreter teardown: nothing left to do
        pass


atexit.register(_stop_at_exit)


class Audit:
    """The sync finder; use through syncless.audit()."""

    def __init__(self, *, strict: bool = False, steps: int | None = None,
                 copy_threshold_us: float = 50.0, slow_threshold_ms: float = 1.0):
        self.strict = strict
        self.steps = steps
        self.copy_threshold_us = copy_threshold_us
        self.slow_threshold_ms = slow_threshold_ms
        self.backend = "none"            # "cupti" | "torch-sync-debug" | "none"
        self.reason = ""                 # why not CUPTI (or why nothing can sync)
        self.misses = ""                 # what the backend in use cannot see
        self.sites: dict[tuple[Any, ...], SyncSite] = {}
        self.slow: dict[tuple[Any, ...], SyncSite] = {}   # long non-sync calls (allocation)
        self.unattributed = 0
        self.kernels = 0
        self.graph_launches = 0
        self.optimizer_steps = 0
        self.optimizers: list[torch.optim.Optimizer] = []
        self.elapsed_s = 0.0
        self._cupti: Any = None          # syncless._cupti while it audits
        # ((frame id, f_lasti), SyncSite, kind) of the last event
        self._last: tuple[tuple[int, int], SyncSite, int] | None = None
        self._raised = False
        self._saved_trace: tuple[Any] | None = None   # sys.gettrace() before strict's raise
        self._thread: int | None = None
        self._fallback: _SyncDebug | None = None
        self._hook: Any = None
        self._launch0 = (0, 0)
        self._t0 = 0.0
        self._active = False

    # ---- the block ---------------------------------------------------------------------------

    def __enter__(self) -> "Audit":
        if self._active:
            raise RuntimeError("this audit is already running")
        self._active = True
        self._thread = threading.get_ident()
        self._hook = register_optimizer_step_post_hook(self._on_optimizer)
        if not torch.cuda.is_available():
            self.backend, self.reason = "none", (
                "CUDA is not available: work on CPU tensors never waits for a GPU, so there is "
                "no host-device sync to find")
        else:
            _start_finder(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed_s += time.perf_counter() - self._t0
        self._active = False
        try:
            if self._cupti is not None:
                k, g = self._cupti.launches()
                self.kernels += k - self._launch0[0]
                self.graph_launches += g - self._launch0[1]
                self._cupti.stop()
                self._cupti = None
            elif self._fallback is not None:
                self._fallback.stop()
                self._fallback = None
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._saved_trace is not None:
                sys.settrace(self._saved_trace[0])
                self._saved_trace = None

    def _on_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self.optimizer_steps += 1
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    # ---- CUPTI path: called by syncless._cupti with the GIL, on the audited thread ------------

    def _on_sync(self, name: str, kind: int, start_ns: int, blocked_ns: int) -> None:
        frame = sys._getframe(1)
        site = user_site(frame)
        if site is None:
            if kind in _SYNC_KINDS and outside_syncless(frame):
                self.unattributed += 1
            return
        if kind == SLOW:
            self._add(self.slow, site, name, kind, blocked_ns, True)
            return
        key = (id(frame), frame.f_lasti)
        # One Python operation can make two calls (a blocking D2H copy into pageable memory,
        # then the stream sync): count it once, with both calls' time.
        merge = (self._last is not None and self._last[0] == key and kind == SYNC
                 and self._last[2] in (ASYNC_COPY, COPY))
        entry = self._add(self.sites, site, name, kind, blocked_ns, not merge)
        self._last = (key, entry, kind)
        if self.strict and not self._raised:
            self._raised = True
            _raise_in(self, frame, site, name)

    def _add(self, table: dict[tuple[Any, ...], SyncSite], site: Site, name: str, kind: int,
             ns: int, new: bool) -> SyncSite:
        # Syncs made by library code group by the library line (the user's line is where the
        # framework was entered, the same for all of them).
        lib = site.chain[0] if site.chain else None
        key = (site.file, site.line) + ((lib.file, lib.line) if lib else ())
        entry = table.get(key)
        if entry is None:
            entry = table[key] = SyncSite(site)
        entry.what[name] = entry.what.get(name, 0) + 1
        entry.kinds.add(kind)
        entry.blocked_ns += ns
        entry.count += new
        return entry

    # ---- results ------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.steps or self.optimizer_steps or 1

    def ranked(self) -> list[SyncSite]:
        return sorted(self.sites.values(), key=lambda s: (-s.blocked_ns, -s.count))

    def syncs_per_step(self) -> float:
        return sum(s.count for s in self.sites.values()) / self.step_count

    def blocked_ms_per_step(self) -> float:
        return sum(s.blocked_ns for s in self.sites.values()) / 1e6 / self.step_count

    def report(self) -> ReportText:
        return ReportText(render_audit(self))

    def __repr__(self) -> str:
        return audit_repr(self, self._active)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython shows a finished audit as its report; one running or not run yet as repr()."""
        p.text(repr(self) if cycle or self._active or not self.elapsed_s else self.report())

    def _repr_html_(self) -> str | None:
        return None if self._active or not self.elapsed_s else self.report()._repr_html_()


def _start_finder(a: Audit) -> None:
    """CUPTI's callbacks where they subscribe, else torch's sync debug mode."""
    cupti, why = _try_cupti()
    if cupti is not None:
        with _cupti_lock:
            try:
                cupti.start(a._on_sync, a.copy_threshold_us, a.slow_threshold_ms * 1e3)
                a._cupti, a.backend = cupti, "cupti"
                a._launch0 = cupti.launches()
            except RuntimeError as e:
                why = str(e)
    if a._cupti is None:
        a.backend, a.reason, a.misses = "torch-sync-debug", why, FALLBACK_MISSES
        a._fallback = _SyncDebug(a)
        a._fallback.start()


def _raise_in(a: Audit, frame: FrameType, site: Site, name: str) -> None:
    """Raise SyncError in the user's frame right after the call that synced returns: a local
    trace function fires on that frame's next opcode (the CUDA call itself cannot be interrupted
    from CUPTI)."""
    message = (f"{name} synchronised with the GPU at {site.where}: `{site.code}` "
               f"(inside syncless.audit(strict=True), a no-sync zone)")
    found: FrameType | None = frame
    while found is not None and (found.f_code.co_filename != site.file
                                 or found.f_lineno != site.line):
        found = found.f_back
    target = found or frame

    def raiser(f: FrameType, event: str, arg: Any) -> Any:
        if f is target and event in ("opcode", "line", "return"):
            f.f_trace = None
            sys.settrace(a._saved_trace[0] if a._saved_trace else None)
            a._saved_trace = None
            raise SyncError(message)
        return raiser if f is target else None

    a._saved_trace = (sys.gettrace(),)
    target.f_trace_opcodes = True
    target.f_trace = raiser
    sys.settrace(lambda f, e, arg: None)


class _SyncDebug:
    """The fallback: torch's sync debug mode, whose warnings on the audited thread are its
    syncs (no time blocked, and some syncs unseen: FALLBACK_MISSES)."""

    def __init__(self, a: Audit) -> None:
        self.a = a
        self._ctx: warnings.catch_warnings[Any] | None = None
        self._saved_show: Any = None

    def start(self) -> None:
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("always", message=r".*synchroniz", category=UserWarning)
        self._saved_show = warnings.showwarning
        warnings.showwarning = self._on_warning
        torch.cuda.set_sync_debug_mode("error" if self.a.strict else "warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._saved_show
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def _on_warning(self, message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        if "synchroniz" not in str(message) or threading.get_ident() != self.a._thread:
            self._saved_show(message, category, filename, lineno, file, line)
            return
        site = user_site(sys._getframe(1))
        if site is not None:
            self.a._add(self.a.sites, site, "torch sync debug warning", SYNC, 0, True)


def audit(fn: Callable[[], Any] | None = None, steps: int | None = None, *,
          strict: bool = False, **kw: Any) -> Audit:
    """Find every host-device sync: `with syncless.audit() as a: ...` then `a.report()`, or
    `syncless.audit(train_step, steps=20)` to run a step function and return the finished audit.
    strict=True raises SyncError at the first sync, naming the line."""
    a = Audit(strict=strict, steps=steps, **kw)
    if fn is None:
        return a
    with a:
        for _ in range(steps or 1):
            fn()
    a.steps = steps or 1
    return a
