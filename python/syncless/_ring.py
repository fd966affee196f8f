"""The device ring and the pinned window a copy of it lands in: the one thing the training side
hands to the delivery side.

`DeviceRing` is made and written by the training thread (logger.py: its gather launches, its
replacement by a wider ring); `_handover` copies it into a `Window`, and `_delivery` decodes that
window. The delivery side never writes a `DeviceRing`: where its next decode starts (the read
position) is its own, kept per ring by `serial` (see Delivery._read).
"""
from __future__ import annotations

import itertools

import torch

from ._torch import _C

__all__ = ["DeviceRing", "Window"]

_COLUMN_BLOCK = _C.COLUMN_BLOCK      # the ring grows its columns in blocks of one mask word
_serials = itertools.count()


class DeviceRing:
    """One device ring (it is replaced by a wider one when new metrics outgrow its columns),
    with columns for `metrics` metrics at least, in whole blocks. Written by the training
    thread only: `captured` once a CUDA graph captured a gather (its steps are then counted on
    the device), `current` False once a wider ring replaced it (its windows are let go)."""

    def __init__(self, device: int, capacity: int, metrics: int, next_step: int):
        columns = max(_COLUMN_BLOCK, -(-metrics // _COLUMN_BLOCK) * _COLUMN_BLOCK)
        nbytes = _C.ring_nbytes(capacity, columns)
        self.serial = next(_serials)                         # names it to the delivery side
        self.device = device
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.ring = _C.Ring(device, self.memory.data_ptr(), capacity, columns)
        self.ring.clear(next_step)                           # async memsets, ordered first
        self.nbytes = nbytes
        self.capacity = capacity
        self.captured = False                                # steps are counted on the device
        self.current = True                                  # False once a wider ring replaced it


class Window:
    """Pinned host memory one copy of a device ring lands in."""
    __slots__ = ("pinned", "win", "nbytes")

    def __init__(self, device: int, nbytes: int):
        # Pinned memory: an async copy into pageable memory would block the caller.
        self.pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.win = _C.Window(device, self.pinned.data_ptr(), nbytes)
        self.nbytes = nbytes
