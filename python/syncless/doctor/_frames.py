"""Which stack frame is "the user's line": the first one outside torch, syncless, the standard
library and installed packages; and the library frames between it and the call (the framework
code that made a sync, which the user can only change through its settings)."""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from types import FrameType
from typing import NamedTuple

import torch

_SYNCLESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB = tuple({os.path.abspath(p) + os.sep for k in ("stdlib", "platstdlib")
                 if (p := sysconfig.get_paths().get(k))})
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_MAX_CHAIN = 40
# Code torch writes and runs: torch.compile's (inductor's cache, TORCHINDUCTOR_CACHE_DIR, by default
# <tmp>/torchinductor_<user>/), Triton's cache, and torch.fx's generated forward functions. It is
# torch's, never the user's line.
_GENERATED = tuple(os.path.abspath(p) + os.sep for p in
                   (os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR"))
                   if p)
_GENERATED_PARTS = (os.sep + "torchinductor_", os.sep + ".triton" + os.sep)


def _generated(filename: str, path: str) -> bool:
    if filename.startswith("<eval_with_key>"):
        return True
    return path.startswith(_GENERATED) or any(part in path for part in _GENERATED_PARTS)

# filename -> "user" | "torch" | "syncless" | "library"
_kinds: dict[str, str] = {}


def _kind(filename: str) -> str:
    kind = _kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_SYNCLESS):
            kind = "syncless"
        elif path.startswith(_TORCH) or _generated(filename, path):
            kind = "torch"
        elif stdlib(filename) or any(s in path for s in _INSTALLED) or _installed_elsewhere(path):
            kind = "library"
        else:
            kind = "user"
        _kinds[filename] = kind
    return kind


# sys.path entry -> the top-level names of the distributions installed in it
_tops: dict[str, frozenset[str]] = {}


def _installed_elsewhere(path: str) -> str | None:
    """The sys.path entry of a file that an installed distribution owns outside site-packages
    (`pip install --target DIR` put on PYTHONPATH, a vendored tree), else None. Files under
    the working folder or the script's are the user's even when a distribution owns them (their
    own project, installed with `pip install -e .`)."""
    if path.startswith("<"):
        return None
    home = [os.path.abspath(p) + os.sep for p in
            (os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[0] or ".")))]
    if any(path.startswith(h) for h in home):
        return None
    entry = max((e for e in (os.path.abspath(p) + os.sep for p in sys.path if p)
                 if path.startswith(e)), key=len, default=None)
    if entry is None:
        return None
    top = path[len(entry):].split(os.sep, 1)[0]
    return entry if top.removesuffix(".py") in _tops_in(entry) else None


def _tops_in(entry: str) -> frozenset[str]:
    """The top-level names of the distributions installed in the folder `entry`, read once.
    Only that folder's: every distribution on sys.path (importlib.metadata's
    packages_distributions) took 0.8 s of pure Python for 87 of them, and the doctor's stack
    sampler, reading its first library frame inside the monitored window, held the GIL the
    training loop needed for it (a 5.8 ms step measured 9-11 ms there)."""
    tops = _tops.get(entry)
    if tops is not None:
        return tops
    names: set[str] = set()
    try:
        import importlib.metadata
        for dist in importlib.metadata.distributions(path=[entry]):
            declared = dist.read_text("top_level.txt")
            if declared:
                names.update(line.strip() for line in declared.splitlines() if line.strip())
                continue
            for f in dist.files or ():          # no top_level.txt: the first part of its files
                first = f.parts[0] if f.parts else ""
                if first and first != ".." and not first.endswith((".dist-info", ".egg-info")):
                    names.add(first.removesuffix(".py"))
    except Exception:                        # a broken distribution's metadata: no extra rule
        pass
    _tops[entry] = tops = frozenset(names)
    return tops


class Frame(NamedTuple):
    """A library frame between the user's line and the call: (file, line, function)."""
    file: str
    line: int
    function: str

    @property
    def where(self) -> str:
        return f"{short(self.file)}:{self.line}"

    def code(self, before: int = 0) -> str:
        """The source line, with `before` lines above it (a condition split over lines)."""
        return "\n".join(linecache.getline(self.file, n).strip()
                         for n in range(max(1, self.line - before), self.line + 1))


class Site(NamedTuple):
    file: str
    line: int
    function: str
    code: str           # the source line, stripped
    via: str            # "file:line" of the innermost non-torch library frame, or ""
    chain: tuple[Frame, ...] = ()   # the non-torch library Frames, innermost first

    @property
    def where(self) -> str:
        return f"{short(self.file)}:{self.line}"


_shorts: dict[str, str] = {}


def short(path: str) -> str:
    """A path as the report prints it: relative to the working folder when that is short, else
    from the installed package's folder (`transformers/trainer.py`) or the standard library's
    (`multiprocessing/connection.py`). Kept per path: the stack sampler asks it each sample."""
    got = _shorts.get(path)
    if got is None:
        got = _shorts[path] = _short(path)
    return got


def _short(path: str) -> str:
    for marker in _INSTALLED:
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker):]
    for stdlib in _STDLIB:                       # the standard library's: `selectors.py`
        if path.startswith(stdlib):
            return path[len(stdlib):]
    if _kind(path) == "library" and (entry := _installed_elsewhere(path)):
        return path[len(entry):]                 # `wandb/util.py` from a --target folder
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(".." + os.sep + "..") else path


def stdlib(filename: str) -> bool:
    """Is this file the standard library's (logging, json, ...)?"""
    return filename.startswith("<frozen") or os.path.abspath(filename).startswith(_STDLIB)


def user_site(frame: FrameType | None) -> Site | None:
    """The first user frame from `frame` outwards; None when the call came from syncless itself
    (its own bookkeeping, never the user's sync)."""
    chain: list[Frame] = []
    f = frame
    while f is not None:
        code = f.f_code
        kind = _kind(code.co_filename)
        if kind == "user":
            line = f.f_lineno or code.co_firstlineno
            text = linecache.getline(code.co_filename, line).strip()
            via = chain[0].where if chain else ""
            return Site(code.co_filename, line, code.co_name, text, via, tuple(chain))
        if kind == "syncless":
            return None
        if kind == "library" and not code.co_filename.startswith("<frozen") \
                and len(chain) < _MAX_CHAIN:
            chain.append(Frame(code.co_filename, f.f_lineno or code.co_firstlineno,
                               code.co_name))
        f = f.f_back
    return None


def sampled_site(frame: FrameType | None) -> tuple[str, int, str] | None:
    """(file, line, innermost library "file:line" or "") of the first user frame from `frame`
    outwards, skipping syncless' own frames (the doctor's hooks run inside the user's step)."""
    via = ""
    f = frame
    while f is not None:
        code = f.f_code
        kind = _kind(code.co_filename)
        if kind == "user":
            return code.co_filename, f.f_lineno or code.co_firstlineno, via
        if kind == "library" and not via and not code.co_filename.startswith("<frozen"):
            via = f"{short(code.co_filename)}:{f.f_lineno}"
        f = f.f_back
    return None


def caller_site(depth: int = 1) -> Site | None:
    return user_site(sys._getframe(depth + 1))


def outside_syncless(frame: FrameType | None) -> bool:
    f = frame
    while f is not None:
        if _kind(f.f_code.co_filename) == "syncless":
            return False
        f = f.f_back
    return True


def _codes(*functions: object) -> frozenset[object]:
    return frozenset(c for fn in functions if (c := getattr(fn, "__code__", None)) is not None)


# What a CUDA graph of the model takes over: its modules' calls (forward) and autograd's backward
# (for CUDA the engine's device threads run it while this frame waits in it).
_MODEL_CODES = _codes(torch.nn.Module._call_impl, torch.nn.Module._wrapped_call_impl,
                      torch.autograd.backward,
                      getattr(torch.autograd.graph, "_engine_run_backward", None))
_OPTIM = os.path.join(_TORCH, "optim") + os.sep


_foreigns: dict[str, bool] = {}


def _foreign(filename: str) -> bool:
    """Code neither torch's nor the standard library's (the user's, a framework's, syncless')."""
    got = _foreigns.get(filename)
    if got is None:
        got = _foreigns[filename] = _kind(filename) != "torch" and not stdlib(filename)
    return got


def step_part(frame: FrameType | None) -> str:
    """Which part of a training step a stack sample is in: "model" (inside a module's call or
    autograd's backward: what torch.compile(model, mode="reduce-overhead") captures in a graph),
    "optimizer" (torch.optim's own code: a graph of the whole step captures it too) or "other"
    (the loop's own Python, the framework's, logging, data). The optimizer's frames count only
    with no user or framework frame inside them: a training step run in optimizer.step()'s
    closure (Lightning's) is not the optimizer's work."""
    part, f = "other", frame
    while f is not None:
        code = f.f_code
        if code in _MODEL_CODES:
            return "model"
        if part == "other" and code.co_filename.startswith(_OPTIM):
            part = "optimizer"
        elif part == "other" and _foreign(code.co_filename):
            part = "outside"         # the user's or a framework's code between: not the optimizer
        f = f.f_back
    return "optimizer" if part == "optimizer" else "other"
