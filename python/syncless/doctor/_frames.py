"""Which stack frame is "the user's line": the first one outside torch, syncless, the standard
library and installed packages."""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from typing import NamedTuple

import torch

_SYNCLESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB = tuple({os.path.abspath(p) + os.sep for k in ("stdlib", "platstdlib")
                 if (p := sysconfig.get_paths().get(k))})
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)

# filename -> "user" | "torch" | "syncless" | "library"
_kinds: dict[str, str] = {}


def _kind(filename: str) -> str:
    kind = _kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_SYNCLESS):
            kind = "syncless"
        elif path.startswith(_TORCH):
            kind = "torch"
        elif filename.startswith("<frozen") or path.startswith(_STDLIB) or \
                any(s in path for s in _INSTALLED):
            kind = "library"
        else:
            kind = "user"
        _kinds[filename] = kind
    return kind


class Site(NamedTuple):
    file: str
    line: int
    function: str
    code: str           # the source line, stripped
    via: str            # "file:line" of the innermost non-torch library frame, or ""

    @property
    def where(self) -> str:
        return f"{_short(self.file)}:{self.line}"


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(".." + os.sep + "..") else path


def user_site(frame) -> Site | None:
    """The first user frame from `frame` outwards; None when the call came from syncless itself
    (its own bookkeeping, never the user's sync)."""
    via = ""
    f = frame
    while f is not None:
        code = f.f_code
        kind = _kind(code.co_filename)
        if kind == "user":
            line = f.f_lineno or code.co_firstlineno
            text = linecache.getline(code.co_filename, line).strip()
            return Site(code.co_filename, line, code.co_name, text, via)
        if kind == "syncless":
            return None
        if kind == "library" and not via and not code.co_filename.startswith("<frozen"):
            via = f"{_short(code.co_filename)}:{f.f_lineno}"
        f = f.f_back
    return None


def caller_site(depth: int = 1) -> Site | None:
    return user_site(sys._getframe(depth + 1))
