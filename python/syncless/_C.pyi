"""Type stub for syncless._C, the C core (csrc/). Policy lives in the Python package.

Import it as ``from syncless._torch import _C``: that module binds it to torch."""
from typing import Any, Callable, TypeVar, final

_R = TypeVar("_R", bound=tuple[Any, ...])

from typing_extensions import Self, disjoint_base

class CudaError(RuntimeError): ...

KINDS: dict[str, int]
"""{torch dtype name: the gather kernel's kind number} for every dtype a metric may have."""
MAX_CELLS: int
"""Metrics one log() call may carry (one gather launch)."""
HEADER_BYTES: int
"""Bytes before row 0 of a device ring (the write counter and replay counters)."""
ROW_HEADER_WORDS: int
"""8-byte words before a row's presence mask: seq, tag, step, time, gpu_ns."""
COLUMN_BLOCK: int
"""A ring's columns come in blocks of this many (one 64-bit presence word)."""
CAPTURED_TAG: int
"""Bit of a row's tag set when the row was written by a CUDA graph replay."""
TIMER_CPU: int
"""TimerBase._mode: time on the host clock."""
TIMER_CUDA: int
"""TimerBase._mode: the CUDA device current at each use."""
TIMER_AUTO: int
"""TimerBase._mode: the host clock until CUDA is up, then the current device."""
TIMER_AFTER: int
"""TimerBase._hooks bit: call the timer's _after(reading) at each exit."""
TIMER_BEFORE: int
"""TimerBase._hooks bit: call the timer's _before(reading) at each entry."""
PAIR_FRESH: int
"""EventPair._state: made, not started."""
PAIR_STARTED: int
"""EventPair._state: the start is recorded."""
PAIR_STOPPED: int
"""EventPair._state: the end is recorded (the reading can be taken)."""

def bind_torch(tensor_type: type, parameter_type: type, dtype_kinds: dict[Any, int],
               exchange_capsule: Any, raw_stream: Any,
               resolve: Callable[[str, Any], Any], number: Callable[[str, Any], float],
               real_types: dict[type, bool]) -> bool: ...
def read_host_values(metrics: dict[str, Any]) -> tuple[int, dict[str, float] | None]: ...
def learn_neg_bit(probes: list[Any]) -> bool: ...
def ring_nbytes(capacity: int, columns: int) -> int: ...

# ---- the device ring and its host windows (csrc/ring.c) ----------------------------------------

GATHER_NEW_COLUMN: int
"""Ring.gather's answer when a metric has no column in the ring yet: nothing was launched."""

def tally(rows: list[Any], latest: dict[str, float] | None,
          nonfinite: dict[str, int] | None, /) -> None:
    """For rows made in Python (dicts, or syncless.Row), what Window.decode does for its own:
    each metric's last value into `latest`, its NaN/Inf count into `nonfinite`."""

@final
class Ring:
    """Ring(device, address, capacity, columns): a logger's device ring."""
    def __new__(cls, device: int, address: int, capacity: int, columns: int) -> Ring: ...
    @property
    def columns(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    def gather(self, metrics: dict[str, Any], columns: dict[str, int], tag: int, step: int,
               time: float, /) -> bool | int:
        """One launch writes the row; step -1: the ring's next step (GPU-counted). True:
        captured into a CUDA graph; False: launched; GATHER_NEW_COLUMN: a metric has no
        column in this ring, nothing launched."""
    def clear(self, next_step: int, /) -> None: ...
    def capturing(self) -> bool: ...
    def wrote(self, tag: int, /) -> bool: ...
    def copy_to(self, window: Window, /) -> None: ...

@final
class Window:
    """Window(device, address, nbytes): pinned host memory a ring is copied into."""
    def __new__(cls, device: int, address: int, nbytes: int) -> Window: ...
    def wait(self) -> None: ...
    def ready(self) -> bool: ...
    def decode(self, from_seq: int, names: list[str], nonfinite: dict[str, int],
               row_type: type[_R], replay_time: float, latest: dict[str, float] | None = ...,
               gpu: list[tuple[int, bool]] | None = ..., /) -> tuple[int, list[_R]]: ...

@disjoint_base
class EventPair:
    def __new__(cls, device: int) -> Self: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def elapsed(self) -> float: ...
    def poll(self) -> float | None: ...
    @property
    def name(self) -> str | None: ...
    @property
    def _device(self) -> int: ...            # a CUDA ordinal, -1: the host clock
    @property
    def _state(self) -> int: ...             # PAIR_FRESH, PAIR_STARTED or PAIR_STOPPED
    @property
    def _cpu_ms(self) -> float: ...          # NaN while running
    @property
    def _ms(self) -> float: ...              # NaN until known

def event_floor(device: int, n: int, /) -> dict[str, float]: ...

@disjoint_base
class TimerBase:
    name: str | None
    _mode: int
    _hooks: int
    _series: Any
    _log: Any
    _step: Any
    @property
    def last(self) -> EventPair | None: ...
    @property
    def _open(self) -> list[EventPair]: ...
    def __enter__(self) -> EventPair: ...
    def __exit__(self, *exc_info: object) -> bool: ...

def bind_timer(timing: type[EventPair], auto_device: Callable[[int], int], /) -> None: ...
def forget_cuda() -> None: ...
