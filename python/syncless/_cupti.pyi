"""Type stub for syncless._cupti, the CUPTI callback sync finder (csrc/cupti.c)."""
from typing import Callable, Final, Sequence

# The kinds of call reported to start()'s callback (enum in csrc/cupti.c).
SYNC: Final[int]        # an explicit synchronize: stream, device, context or event
COPY: Final[int]        # a synchronous memcpy
ASYNC_COPY: Final[int]  # an "async" memcpy that blocked (pageable host memory)
FREE: Final[int]        # cudaFree / cuMemFree: an implicit device-wide sync
SLOW: Final[int]        # any other call that blocked for long (allocation, module load, ...)

def load(paths: Sequence[str], /) -> str:
    """Open libcupti (one already loaded by torch first, else the first of `paths` that opens);
    returns the name or path used. OSError when none opens."""
def start(report: Callable[[str, int, int, int], object], copy_threshold_us: float,
          slow_threshold_us: float, /) -> None:
    """Audit the calling thread: report(name, kind, start_ns, blocked_ns) per blocking call."""
def stop() -> tuple[int, int]:
    """Unsubscribe; returns (calls reported, report callbacks that raised)."""
def launches() -> tuple[int, int]:
    """(kernel launches, graph launches) seen so far on any thread, while active."""
def active() -> bool: ...
def loaded() -> bool: ...
