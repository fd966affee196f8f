"""Where a step ends, in a script the doctor did not write.

Detectors, strongest first: the user's marker (`syncless.step()`), a source line
(`--step-at FILE:LINE`), `optimizer.step()`, `backward()`, a DataLoader's `next()`, and the end of
the outermost nn.Module call (inference). All listen from the start; the strongest kind seen so far
is the boundary, and a stronger one appearing (the first optimizer.step() comes after the first
backward()) restarts the count. Calls recorded into a CUDA graph are not boundaries: they do not
run now. Only one detector set is live at a time (the marker and the hooks reach it through a
global).

Nothing the detectors attach may change what the script can do with its own objects: the hooks on
the model are module-level functions (a pickle of the model would name them, not fail on them),
and while they are on it, a pickle or a copy of the model (`torch.save(model)`, `copy.deepcopy`
for an EMA, a spawned worker's copy) leaves them out, so its file and its copies are the ones the
script makes without the doctor. Every patch is undone by remove()."""
from __future__ import annotations

import os
import sys
from types import CodeType, FrameType
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from ._frameworks import stack_framework

__all__ = ["KINDS", "Boundaries", "step", "parse_step_at"]

# The boundary kinds, strongest first, as the report names them.
MARKER, STEP_AT, OPTIMIZER, BACKWARD, LOADER, MODULE = KINDS = (
    "syncless.step()", "--step-at", "optimizer.step()", "backward()", "DataLoader next()",
    "the outermost nn.Module call")

# Not a boundary: every optimizer's step() (the boundary counts only the first optimizer's).
ANY_OPTIMIZER = "optimizer.step() of any optimizer"

_active: "Boundaries | None" = None


def step() -> None:
    """Mark the end of a training (or inference) step for `python -m syncless doctor`, in loops
    without optimizer.step() or with more than one per step. Free when no doctor runs."""
    if _active is not None:
        _active.fire(MARKER)


def parse_step_at(text: str) -> tuple[str, int]:
    """FILE:LINE -> (absolute path, line); ValueError naming what is wrong (no such file, a line
    past its end, a line without code: such a line never runs, and the steps would silently end
    at another boundary)."""
    path, sep, line = text.rpartition(":")
    if not sep or not path or not line.isdigit() or int(line) < 1:
        raise ValueError(f"expected FILE:LINE with a line number >= 1, got {text!r}")
    if not os.path.isfile(path):
        raise ValueError(f"file not found: {path}")
    n = int(line)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    if n > len(lines):
        raise ValueError(f"{path} has {len(lines)} lines: line {n} is past its end")
    code = lines[n - 1].strip()
    if not code or code.startswith("#"):
        raise ValueError(f"line {n} of {path} has no code ({'a comment' if code else 'blank'}): "
                         "name a line that runs once per step")
    return os.path.abspath(path), n


def _capturing() -> bool:
    # torch.cuda.is_initialized() has no annotations in torch
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return initialized and torch.cuda.is_current_stream_capturing()


class Boundaries:
    """Calls `on_boundary(kind, restart)` at every step boundary of the strongest kind seen;
    restart=True when that kind just became the strongest."""

    def __init__(self, on_boundary: Callable[[str, bool], None],
                 step_at: tuple[str, int] | None = None):
        self.on_boundary = on_boundary
        self.step_at = step_at
        self.kind: str | None = None
        self.seen = dict.fromkeys(KINDS + (ANY_OPTIMIZER,), 0)
        self.optimizer: torch.optim.Optimizer | None = None   # the first stepped: one per step
        # every optimizer stepped, in order of first step
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model: torch.nn.Module | None = None   # the first module called from outside any other
        self.autocast: bool | None = None      # was autocast on in any call of the model
        self.optimizer_made = False            # a torch optimizer was constructed
        self.framework = ""                    # the loop's: "transformers", "lightning", ...
        self.forward_only = 0                  # model calls with autograd off (evaluation)
        self._optimizer_init: Any = None       # Optimizer.__init__ while it is replaced
        self._handles: list[RemovableHandle] = []
        self._optimizer_hook: RemovableHandle | None = None
        self._backward: Any = None             # torch.autograd.backward while it is replaced
        self._module_call: Any = None          # nn.Module.__call__ while it is replaced
        self._reduce_ex: Any = None            # set while nn.Module.__reduce_ex__ is ours
        self._hook_ids: set[int] = set()       # the ids of the hooks on the model
        self._line: _LineWatch | None = None   # --step-at's watcher

    # ---- the decision ---------------------------------------------------------------------------

    def fire(self, kind: str) -> None:
        if _capturing():
            return
        self.seen[kind] += 1
        if self.kind is None or KINDS.index(kind) < KINDS.index(self.kind):
            self.kind = kind
            self.on_boundary(kind, True)
        elif kind == self.kind:
            self.on_boundary(kind, False)

    def loader_next(self) -> None:
        self.fire(LOADER)

    # ---- detectors ------------------------------------------------------------------------------

    def install(self) -> None:
        global _active
        _active = self
        self._optimizer_hook = register_optimizer_step_post_hook(self._on_optimizer)
        # The first module call, through nn.Module.__call__ itself until it comes: a global
        # module hook would make torch.compile'd modules warn that global hooks are set (a
        # warning the script does not have without the doctor, an error under -W error).
        global _torch_module_call
        _torch_module_call = self._module_call = torch.nn.Module.__call__
        setattr(torch.nn.Module, "__call__", _first_module_call)
        if "__reduce_ex__" not in vars(torch.nn.Module):      # (another tool's: left alone)
            self._reduce_ex = _ABSENT
            setattr(torch.nn.Module, "__reduce_ex__", _reduce_without_hooks)
        original = self._backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> None:
            out = original(*args, **kwargs)
            if _active is self:                # a reference the script kept outlives us
                self.fire(BACKWARD)
            return out

        setattr(torch.autograd, "backward", backward)
        # An optimizer made but not stepped yet: the model calls that come first (nanoGPT's
        # estimate_loss() at iteration 0, Lightning's sanity check) are an evaluation, not the
        # step (ScriptSession waits for the training step).
        init = self._optimizer_init = torch.optim.Optimizer.__init__

        def optimizer_init(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            init(optimizer, *args, **kwargs)
            self.optimizer_made = True

        setattr(torch.optim.Optimizer, "__init__", optimizer_init)
        if self.step_at is not None:
            self._line = _LineWatch(*self.step_at, fire=lambda: self.fire(STEP_AT))

    def remove(self) -> None:
        global _active
        self._restore_module_call()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hook_ids.clear()
        if self._reduce_ex is not None:
            if vars(torch.nn.Module).get("__reduce_ex__") is _reduce_without_hooks:
                delattr(torch.nn.Module, "__reduce_ex__")
            self._reduce_ex = None
        if _active is self:
            _active = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self._backward is not None:
            setattr(torch.autograd, "backward", self._backward)
            self._backward = None
        if self._optimizer_init is not None:
            setattr(torch.optim.Optimizer, "__init__", self._optimizer_init)
            self._optimizer_init = None
        if self._line is not None:
            self._line.remove()
            self._line = None

    def reinstall_optimizer_hook(self) -> None:
        """Move the optimizer hook behind hooks registered since (see ScriptSession)."""
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        self._optimizer_hook = register_optimizer_step_post_hook(self._on_optimizer)

    def _on_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
            self.framework = stack_framework(sys._getframe(1))
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        if not _capturing():
            self.seen[ANY_OPTIMIZER] += 1
        if optimizer is self.optimizer:
            self.fire(OPTIMIZER)

    def _restore_module_call(self) -> None:
        if self._module_call is not None:
            if torch.nn.Module.__call__ is _first_module_call:   # not one the script set since
                setattr(torch.nn.Module, "__call__", self._module_call)
            self._module_call = None

    def _on_first_module(self, module: torch.nn.Module) -> None:
        # The first module called is the outermost one (nothing else runs yet). Module.__call__
        # is torch's again at once; hooks on the model stay, registered before its call runs
        # (a forward hook: the call's end is the boundary; a pre-hook: autocast at each call).
        self._restore_module_call()
        self.model = module
        for handle in (module.register_forward_hook(_model_returned),
                       module.register_forward_pre_hook(_model_called)):
            self._handles.append(handle)
            self._hook_ids.add(handle.id)

    def _on_model_call(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():          # no_grad, inference_mode: forward only
            self.forward_only += 1
        if not self.autocast:
            try:
                self.autocast = torch.is_autocast_enabled("cuda")
            except TypeError:                            # torch < 2.4
                self.autocast = torch.is_autocast_enabled()


_ABSENT = object()
_torch_module_call: Any = None       # nn.Module.__call__ as torch has it, while ours replaces it

# The model's hooks and the first-call detector: module-level functions that find the live
# detector set through `_active`, so that nothing on the model refers to the doctor's state.


def _first_module_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    b = _active
    if b is not None and b.model is None and not _capturing():
        b._on_first_module(module)
    return _torch_module_call(module, *args, **kwargs)


def _model_called(module: torch.nn.Module, args: Any) -> None:
    b = _active
    if b is not None and b.model is module:
        b._on_model_call(module, args)


def _model_returned(module: torch.nn.Module, args: Any, output: Any) -> None:
    b = _active
    if b is not None and b.model is module:
        b.fire(MODULE)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


def _reduce_without_hooks(module: torch.nn.Module, protocol: int) -> Any:
    """nn.Module.__reduce_ex__ while the doctor's hooks are on the model: the model's state as it
    would be without them (pickle, torch.save, copy.deepcopy, copy.copy all reduce through
    here), so that a saved model loads where syncless is not installed and an EMA copy carries
    no hook of ours."""
    reduced = object.__reduce_ex__(module, protocol)
    b = _active
    ours: set[int] = b._hook_ids if b is not None and b.model is module else set()
    if not ours or not isinstance(reduced, tuple) or len(reduced) < 3:
        return reduced
    given: Any = reduced[2]
    if not isinstance(given, dict):
        return reduced
    state = dict(given)
    for name in _HOOK_DICTS:
        hooks: Any = state.get(name)
        if isinstance(hooks, dict) and id(hooks) == id(getattr(module, name, None)):
            state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in ours)
    return (*reduced[:2], state, *reduced[3:])


class _LineWatch:
    """--step-at FILE:LINE: calls `fire()` each time that line runs (sys.monitoring on 3.12+,
    else a trace function on that file's frames)."""

    def __init__(self, path: str, line: int, fire: Callable[[], None]) -> None:
        self._tool: int | None = None          # the sys.monitoring tool id (3.12+)
        self._saved_trace: tuple[Any] | None = None
        def same(f: str) -> bool:
            return f == path or (not os.path.isabs(f) and os.path.abspath(f) == path)

        if sys.version_info >= (3, 12):
            mon = sys.monitoring
            tool = next((t for t in (mon.PROFILER_ID, 3, 4, mon.DEBUGGER_ID)
                         if mon.get_tool(t) is None), None)
            if tool is None:
                raise RuntimeError("--step-at: every sys.monitoring tool id is taken")
            mon.use_tool_id(tool, "syncless doctor")
            self._tool = tool

            def started(code: CodeType, offset: int) -> Any:
                # Code of other files is never looked at again (DISABLE is per code location).
                if not same(code.co_filename):
                    return mon.DISABLE
                mon.set_local_events(tool, code, mon.events.LINE)
                return None

            def at_line(code: CodeType, n: int) -> Any:
                if n != line:
                    return mon.DISABLE
                fire()
                return None

            mon.register_callback(tool, mon.events.PY_START, started)
            mon.register_callback(tool, mon.events.LINE, at_line)
            mon.set_events(tool, mon.events.PY_START)
            return

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == line:
                fire()
            return local

        def call(frame: FrameType, event: str, arg: Any) -> Any:
            return local if same(frame.f_code.co_filename) else None

        self._saved_trace = (sys.gettrace(),)
        sys.settrace(call)

    def remove(self) -> None:
        if sys.version_info >= (3, 12) and self._tool is not None:
            mon, tool = sys.monitoring, self._tool
            mon.set_events(tool, 0)
            mon.register_callback(tool, mon.events.PY_START, None)
            mon.register_callback(tool, mon.events.LINE, None)
            mon.free_tool_id(tool)
            mon.restart_events()            # locations this tool DISABLEd are live again
            self._tool = None
        if self._saved_trace is not None:
            sys.settrace(self._saved_trace[0])
            self._saved_trace = None
