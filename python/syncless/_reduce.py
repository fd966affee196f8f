"""Cross-rank reduction of a logger's window: one collective per flush, no barrier.

On the GPU the whole ring (every metric column of every row, presence included) is packed into
one float64 tensor per reduce op and all-reduced asynchronously with torch.distributed on the
current stream's order; the result is unpacked back into the ring before the device-to-host copy
is enqueued, so the copy sees reduced values and the host never waits. Host rows (CPU values,
gloo) are reduced the same way on the CPU.

Metric names must agree across ranks. They are compared (names and row counts, over a gloo
group, CPU only) whenever they changed since the last flush, so a rank that logs a different set
of metrics gets a clear error at that flush instead of a hang inside a collective of mismatched
size.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ._torch import _C
from .rows import Row

# [(reduce op, the columns it takes, as an index tensor; None: all of them)]
_Groups = list[tuple[str, torch.Tensor | None]]

OPS = ("mean", "sum", "min", "max")


def parse_reduce(reduce: str | Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """(the default op, {metric: op}) of a `reduce=` argument, or ValueError naming the metric;
    RuntimeError before torch.distributed is initialised (both reduce_on= paths need it)."""
    if isinstance(reduce, str):
        default, per_metric = reduce, {}
    else:
        default, per_metric = "mean", dict(reduce)
    for name, op in [("default", default), *per_metric.items()]:
        if op not in OPS:
            raise ValueError(f"reduce for {name!r} must be one of {OPS}, got {op!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("Logger(reduce=...) needs torch.distributed initialised first "
                           "(dist.init_process_group)")
    return default, per_metric


class Reducer:
    """reduce_on="device": the window's all-reduce enqueued on the training stream at each flush
    (the host path, the default, is `_ranks`)."""

    def __init__(self, reduce: str | Mapping[str, str]):
        self.default, self.per_metric = parse_reduce(reduce)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # A CPU group for the schema check, so comparing names never touches a GPU.
        self.cpu_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.checked = 0                 # how many names were last agreed on
        self._cache_key: tuple[int, torch.device] | None = None
        self._cache: _Groups = []

    def op(self, name: str) -> str:
        return self.per_metric.get(name, self.default)

    def check_schema(self, names: list[str], rows: int) -> None:
        if len(names) == self.checked and rows < 0:
            return
        mine = (sorted(names), rows)       # column order may differ; the set may not
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.cpu_group)
        for rank, (their_names, their_rows) in enumerate(everyone):
            if their_names != mine[0]:
                missing = sorted(set(their_names) ^ set(mine[0]))
                raise ValueError(
                    f"syncless.Logger(reduce=...): rank {rank} logs metrics {their_names} but "
                    f"rank {self.rank} logs {mine[0]} (differ: {missing}); every rank must log "
                    "the same metric names")
            if their_rows != rows:
                raise ValueError(f"syncless.Logger(reduce=...): rank {rank} has {their_rows} "
                                 f"rows in this window, rank {self.rank} has {rows}; every rank "
                                 "must log the same number of steps")
        self.checked = len(names)

    def _groups(self, names: list[str], device: torch.device) -> _Groups:
        """[(op, column index tensor or None for all columns)], cached per schema and device."""
        key = (len(names), device)
        if self._cache_key != key:
            # Packets list columns in name order: ranks may have met the names in other orders.
            groups: dict[str, list[int]] = {}
            col_of = {name: col for col, name in enumerate(names)}
            for name in sorted(names):
                groups.setdefault(self.op(name), []).append(col_of[name])
            if len(groups) == 1 and names == sorted(names):
                self._cache = [(op, None) for op in groups]
            else:
                # pinned + non_blocking: building an index on the GPU must not sync
                self._cache = [(op, torch.tensor(cols).pin_memory().to(device, non_blocking=True)
                                if device.type == "cuda" else torch.tensor(cols))
                               for op, cols in groups.items()]
            self._cache_key = key
        return self._cache

    def _reduce(self, values: torch.Tensor, present: torch.Tensor, names: list[str],
                group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """values/present: (rows, columns); returns reduced values and any-rank presence.
        One packet per reduce op: [values with absent cells neutral | presence]."""
        out = values.clone()
        seen_all = present.clone()
        works = []
        for op, idx in self._groups(names, values.device):
            v = values if idx is None else values.index_select(1, idx)
            p = present if idx is None else present.index_select(1, idx)
            pf = p.to(v.dtype)
            if op in ("mean", "sum"):
                packet = torch.cat([torch.where(p, v, torch.zeros_like(v)), pf], dim=1)
                rop = dist.ReduceOp.SUM
            elif op == "min":   # MIN of -presence is -(any rank present)
                packet = torch.cat([torch.where(p, v, torch.full_like(v, math.inf)), -pf], dim=1)
                rop = dist.ReduceOp.MIN
            else:
                packet = torch.cat([torch.where(p, v, torch.full_like(v, -math.inf)), pf], dim=1)
                rop = dist.ReduceOp.MAX
            work = dist.all_reduce(packet, rop, group=group, async_op=True)
            works.append((op, idx, v.shape[1], packet, work))
        for op, idx, n, packet, work in works:
            work.wait()        # NCCL: the current stream waits on the collective; the host does not
            reduced, count = packet[:, :n], packet[:, n:]
            if op == "min":
                count = -count
            if op == "mean":
                reduced = reduced / count.clamp(min=1)
            if idx is None:
                out, seen_all = reduced, count > 0
            else:
                out.index_copy_(1, idx, reduced)
                seen_all.index_copy_(1, idx, count > 0)
        return out, seen_all

    # ---- device ring ------------------------------------------------------------------------

    def reduce_ring(self, memory: torch.Tensor, capacity: int, columns: int,
                    names: list[str]) -> None:
        """Reduce a ring in place on the current stream (no host wait)."""
        self.check_schema(names, -1)
        # The layout is the C side's (layout.h): header, then rows of [row header | presence
        # mask, one bit per column in 64-bit words | one float64 per column].
        block = _C.COLUMN_BLOCK
        mask_words = columns // block
        mask = _C.ROW_HEADER_WORDS                       # first mask word of a row
        first = mask + mask_words                        # first value word of a row
        rows = memory[_C.HEADER_BYTES:].view(torch.float64).view(capacity, first + columns)
        bits = rows[:, mask:first].view(torch.int64)
        shifts = torch.arange(block, device=memory.device, dtype=torch.int64)
        present = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(capacity, columns)
        n = len(names)
        values = rows[:, first:first + n]
        reduced, any_present = self._reduce(values, present[:, :n], names)
        rows[:, first:first + n] = reduced
        full = torch.zeros(capacity, columns, dtype=torch.int64, device=memory.device)
        full[:, :n] = any_present.to(torch.int64)
        words = (full.view(capacity, mask_words, block) << shifts).sum(-1)
        rows[:, mask:first] = words.view(torch.float64)

    # ---- host rows --------------------------------------------------------------------------

    def reduce_rows(self, rows: list[Row], names: list[str]) -> list[Row]:
        """rows: the logger's Row tuples; returns them with reduced values (same type)."""
        self.check_schema(names, len(rows))
        n = len(names)
        values = torch.zeros(len(rows), n, dtype=torch.float64)
        present = torch.zeros(len(rows), n, dtype=torch.bool)
        col = {name: i for i, name in enumerate(names)}
        for i, row in enumerate(rows):
            for name, v in row.values.items():
                values[i, col[name]] = v
                present[i, col[name]] = True
        reduced, any_present = self._reduce(values, present, names, group=self.cpu_group)
        out = []
        for i, row in enumerate(rows):
            vals = reduced[i].tolist()
            keep = any_present[i].tolist()
            out.append(row._replace(values={names[c]: vals[c] for c in range(n) if keep[c]}))
        return out
