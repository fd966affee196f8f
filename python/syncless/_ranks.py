"""Cross-rank reduction on the host, after the copy (Logger(reduce=...), reduce_on="host").

The training thread never takes part: its rows go through the hand-over as on one rank, the
delivery side decodes them and puts them here, and a thread of this module's (one per Logger)
reduces them across ranks on a gloo group made once, at the Logger's construction. The
reduced rows go back to the hand-over as a job of their own and reach the sinks from there.

Why exchanges, not windows. Each rank hands a window over when its own `every` or `max_delay`
says so, and max_delay reads the rank's own clock: two ranks in lockstep hand over at
different steps. A collective per window therefore pairs different steps, or waits for a window
the other rank never makes (issue 35's deadlock). Here the ranks instead run one numbered
sequence of exchanges that does not depend on when anyone handed a window over:

    exchange e   header: all_gather of a few int64 per rank (its frontier: every row of its
                 steps up to there is here; whether it is closing; how many steps it holds in
                 the range agreed at e-1; its metric names' count and checksum)
                 data: all_gather of those steps' rows (only if some rank has any), for the
                 range (F[e-2], F[e-1]], F[e-1] being the smallest frontier of header e-1

What each rank sends is fixed by what every rank saw in the headers before, so every rank
issues the same collectives in the same order, whatever its pacing: a mismatch is impossible
by construction. Ranks are aligned by step, never by window. A rank begins its next exchange
when it has new rows, when the last one agreed a range not yet sent, when it closes, or after
`heartbeat` seconds (so a rank with nothing new still lets the others' rows through). After the
header in which every rank said it is closing, one more exchange carries the rest, and the
thread ends, on every rank at the same exchange.

Waiting. A fast rank's exchange waits in a collective for the slow ones, on this thread; its
training loop goes on. Rows waiting to be reduced are bounded (`limit` rows, 64 windows): past
it the delivery side waits for room before taking the next window (the same backpressure as a
slow sink, counted in stats.waits), so memory stays bounded and nothing is dropped. In a job
whose own collectives keep the ranks in step (DDP) the bound is never reached.

A dead rank. Every rank writes the number of the exchange it begins to the default store, and
its host and process id once. A collective that fails (a peer's connection closed) or that
close() stops waiting for at `close_timeout` ends the exchanges; the error names the ranks that
did not begin that exchange (or whose process is gone) and is raised by close().

Values. Each reduced row holds, per metric, the reduce op over the ranks that logged it at
that step (mean, sum, min, max, in float64), and `ranks/step_ms/min|median|max` and
`ranks/slowest` from each rank's own step time: the time between its rows' timestamps (the
GPU's when the rows carry one, else the host call time), per step; no sync is added for it.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import threading
import time
import zlib
from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.distributed as dist

from ._reduce import parse_reduce
from .rows import Row

__all__ = ["Ranks", "Stragglers", "STEP_MIN", "STEP_MEDIAN", "STEP_MAX", "SLOWEST"]

_log = logging.getLogger("syncless")

STEP_MIN, STEP_MEDIAN, STEP_MAX = "ranks/step_ms/min", "ranks/step_ms/median", "ranks/step_ms/max"
SLOWEST = "ranks/slowest"
SWITCH_AFTER = 3                    # see Ranks._note_slowest
PENDING_WINDOWS = 64                # rows waiting to be reduced: at most this many windows' worth
_TOP = 1 << 62                      # a closing rank's frontier: every step it will ever log
# header fields, one int64 each
_E, _FRONTIER, _CLOSING, _ROWS, _NAMES, _CRC, _NAME_BYTES = range(7)
_HEADER = 7
_made = 0                           # reducing Loggers made by this process: the store's keys


class Stragglers(NamedTuple):
    """Logger.stragglers(): which rank has been slowest, by how much, since which step."""
    rank: int             # the slowest rank at the latest reduced step with step times
    since_step: int       # the first step of its present run as the slowest
    steps: int            # reduced steps in that run
    step_ms: float        # its mean step time over the run
    median_ms: float      # the mean, over the run, of the ranks' median step time
    slower_by: float      # step_ms / median_ms - 1 (0.5: 50% slower than the median rank)
    slowest_at: dict[int, int]  # over the whole run: how many steps each rank was the slowest


class _Pending(NamedTuple):
    step: int
    clock_ms: float       # the row's timestamp in ms (GPU clock where the row has one)
    time: float
    values: dict[str, float]


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:                   # no default store: errors name no rank
        return None


class Ranks:
    """One Logger's exchange across ranks. The delivery side calls wait_room() then put(rows);
    the Logger calls start(submit), closing_by(deadline), finish(deadline), stop() and reads
    error, lost, waits, stragglers()."""

    def __init__(self, reduce: str | Mapping[str, str], every: int, heartbeat: float):
        global _made
        self.default_op, self.per_metric = parse_reduce(reduce)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # A group of its own: its collectives never pair with the model's or another Logger's.
        self.group = dist.new_group(backend="gloo")
        _made += 1
        self._tag = f"syncless/ranks/{_made}"
        self._store = _default_store()
        self._note(f"{self._tag}/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self.limit = PENDING_WINDOWS * every
        self.heartbeat = heartbeat
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[_Pending] = []
        self._last_step = -1              # the last step put here
        self._new = False                 # rows came since the last header
        self._closing = False
        self._deadline: float | None = None  # time.monotonic(): close() stops waiting then
        self._ended = False               # the thread ended (done, failed or abandoned)
        self._submit: Callable[[list[Row]], None] | None = None
        self.error: Exception | None = None
        self.lost = 0                     # rows that could not be reduced (see error)
        self.waits = 0                    # puts that waited for room (the bound)
        self.exchanges = 0
        self.collectives = 0              # on self.group, all from this module's thread
        self._exchange = 0                # the exchange under way
        self._seen: set[str] = set()      # metric names of the rows sent so far
        self._prev_clock: tuple[int, float] | None = None  # last (step, clock_ms) sent
        self._streak: list[Any] = []      # [rank, since, steps, sum_ms, sum_median]
        self._rival: list[Any] = []       # another rank slowest at the latest steps
        self._open: list[int] = []        # ranks not closing at the latest exchange's headers
        self._slowest_at: dict[int, int] = {}
        self._thread = threading.Thread(target=self._loop, name="syncless-ranks", daemon=True)

    # ---- the Logger's calls ------------------------------------------------------------------

    def start(self, submit: Callable[[list[Row]], None]) -> None:
        """submit(rows): how reduced rows go back to the hand-over (Handover.submit_reduced)."""
        self._submit = submit
        self._thread.start()

    def closing_by(self, deadline: float | None) -> None:
        """close() began: waits (for room, for other ranks) end at `deadline` at the latest."""
        with self._cond:
            self._deadline = deadline
            self._cond.notify_all()

    def finish(self, deadline: float | None) -> None:
        """Every row of this rank is here: run the last exchanges (with every rank) and end."""
        with self._cond:
            self._closing = True
            self._deadline = deadline
            self._cond.notify_all()
        wait = None if deadline is None else max(deadline - time.monotonic(), 0.0) + 2.0
        self._thread.join(wait)
        if self._thread.is_alive():       # stuck in a collective past the deadline
            self._give_up(self._missing_error("close_timeout passed"))
            return
        # The group's gloo threads end here, not in the interpreter's teardown: there a gloo
        # worker that drops a finished collective's tensors needs the GIL, which a finalizing
        # interpreter refuses, and the process aborts ("terminate called without an active
        # exception", pytorch/pytorch#179291; the core of one such abort here: a runLoop thread
        # in ~AsyncAllreduceWork, the main thread in Py_FinalizeEx's gc). destroy_process_group
        # only unregisters the group; dropping the last reference destroys it, which joins its
        # threads (torch releases the GIL for that).
        group, self.group = self.group, None
        try:
            dist.destroy_process_group(group)
        except Exception as exc:          # already gone (the job tore everything down)
            _log.debug("syncless: the ranks' group was not destroyed: %s", exc)
        del group

    def stop(self) -> None:
        """A Logger dropped without close(): exchange no more (the other ranks' close() will
        name this one)."""
        self._give_up(None)

    def stragglers(self) -> Stragglers | None:
        s = self._streak
        if not s:
            return None
        rank, since, steps, sum_ms, sum_median = s
        ms, median = sum_ms / steps, sum_median / steps
        return Stragglers(rank, since, steps, ms, median,
                          ms / median - 1 if median > 0 else math.inf, dict(self._slowest_at))

    # ---- the delivery side's calls ----------------------------------------------------------

    def wait_room(self) -> None:
        """Wait while `limit` rows wait to be reduced (never past close()'s deadline). Changes
        nothing, so an interrupt here loses nothing."""
        counted = False
        with self._cond:
            while len(self._pending) >= self.limit and not self._ended:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    return                # put() keeps the rows anyway: close() is ending
                if not counted:
                    self.waits += 1
                    counted = True
                self._cond.wait(0.05)

    def put(self, rows: list[Row]) -> None:
        """The rows of one delivered window or host-row hand-over, in step order."""
        if not rows:
            return
        add = []
        for row in rows:
            gpu_ns = row.gpu_ns
            clock = row.time * 1e3 if gpu_ns is None else gpu_ns / 1e6
            add.append(_Pending(row.step, clock, row.time, row.values))
        with self._cond:
            if self._ended:
                self.lost += len(add)
                return
            self._pending.extend(add)
            self._last_step = add[-1].step
            self._new = True
            self._cond.notify_all()

    # ---- the exchange thread -----------------------------------------------------------------

    def _loop(self) -> None:
        agreed = sent = -1                # F[e-1], F[e-2]: the range (sent, agreed] goes next
        last = False
        try:
            while True:
                self._wait_for_reason(agreed > sent or last)
                rows, header, names = self._prepare(sent, agreed)
                self._exchange = e = self.exchanges
                self._note(f"{self._tag}/at/{self.rank}", str(e))
                heads = self._gather(torch.tensor(header, dtype=torch.int64))
                self._open = [r for r, h in enumerate(heads) if not int(h[_CLOSING])]
                frontier = min(int(h[_FRONTIER]) for h in heads)
                everyone_closing = all(int(h[_CLOSING]) for h in heads)
                differ = any((int(h[_NAMES]), int(h[_CRC])) != (header[_NAMES], header[_CRC])
                             for h in heads)
                if differ and (last or max(int(h[_ROWS]) for h in heads)):
                    names = self._union(names, heads, last)
                most = max(int(h[_ROWS]) for h in heads)
                if most:
                    self._reduce(self._gather(self._packet(rows, names, most)), names)
                with self._cond:
                    cut = 0
                    while cut < len(self._pending) and self._pending[cut].step <= agreed:
                        cut += 1
                    del self._pending[:cut]
                    self._cond.notify_all()
                self.exchanges = e + 1
                sent, agreed = agreed, frontier
                if last:
                    break
                last = everyone_closing
        except _GaveUp:
            pass
        except Exception as exc:          # a peer's connection closed, or a bug: say which
            if self.error is None:
                self._give_up(self._missing_error(f"{type(exc).__name__}: {exc}"))
        finally:
            with self._cond:
                self._ended = True
                self.lost += len(self._pending)
                self._pending = []
                self._cond.notify_all()

    def _wait_for_reason(self, due: bool) -> None:
        with self._cond:
            if self._ended:
                raise _GaveUp
            if not (due or self._new or self._closing):
                self._cond.wait(self.heartbeat)
            self._new = False
            if self._ended:
                raise _GaveUp

    def _prepare(self, sent: int, agreed: int) -> tuple[list[_Pending], list[int], list[str]]:
        """This rank's rows of (sent, agreed], one per step (a step logged twice is merged, the
        later value winning), and its header."""
        with self._cond:
            closing = self._closing
            frontier = _TOP if closing else self._last_step - 1   # a step may get more rows
            rows: list[_Pending] = []
            for p in self._pending:
                if p.step > agreed:
                    break
                if p.step <= sent:
                    continue
                if rows and rows[-1].step == p.step:
                    rows[-1] = rows[-1]._replace(values={**rows[-1].values, **p.values})
                else:
                    rows.append(p)
        for p in rows:
            self._seen.update(p.values)
        names = sorted(self._seen)
        blob = "\0".join(names).encode()
        header = [0] * _HEADER
        header[_E], header[_FRONTIER], header[_CLOSING] = self.exchanges, frontier, int(closing)
        header[_ROWS], header[_NAMES], header[_CRC] = len(rows), len(names), zlib.crc32(blob)
        header[_NAME_BYTES] = len(blob)
        return rows, header, names

    def _packet(self, rows: list[_Pending], names: list[str], most: int) -> torch.Tensor:
        """(most, 3 + 2 * len(names)) float64: [step, time, step_ms, presence..., value...];
        rows past this rank's own are NaN steps."""
        n = len(names)
        out = torch.full((most, 3 + 2 * n), math.nan, dtype=torch.float64)
        col = {name: i for i, name in enumerate(names)}
        prev = self._prev_clock
        data = []
        for p in rows:
            ms = math.nan
            if prev is not None and p.step > prev[0]:
                ms = (p.clock_ms - prev[1]) / (p.step - prev[0])
            prev = (p.step, p.clock_ms)
            line = [float(p.step), p.time, ms] + [0.0] * (2 * n)
            for name, v in p.values.items():
                c = col[name]
                line[3 + c], line[3 + n + c] = 1.0, v
            data.append(line)
        self._prev_clock = prev
        if data:
            out[:len(data)] = torch.tensor(data, dtype=torch.float64)
        return out

    def _union(self, names: list[str], heads: list[torch.Tensor], last: bool) -> list[str]:
        """The ranks' names differ (one logged a metric the other has not yet, or ever): the
        columns are their union; at the last exchange a name some rank never logged is an
        error (raised by close())."""
        most = max(int(h[_NAME_BYTES]) for h in heads)
        blob = "\0".join(names).encode()
        mine = torch.zeros(most + 1, dtype=torch.uint8)
        mine[0] = 1
        mine[1:len(blob) + 1] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) \
            if blob else mine[1:1]
        everyone = []
        for h, t in zip(heads, self._gather(mine)):
            raw = bytes(t[1:1 + int(h[_NAME_BYTES])].tolist()).decode()
            everyone.append(raw.split("\0") if raw else [])
        union = sorted(set().union(*everyone))
        if last and self.error is None:
            for name in union:
                lacking = [r for r, theirs in enumerate(everyone) if name not in theirs]
                if lacking:
                    having = [r for r in range(len(everyone)) if r not in lacking]
                    self.error = ValueError(
                        f"syncless.Logger(reduce=...): metric {name!r} was logged by ranks "
                        f"{having} but never by ranks {lacking}; every rank must log the same "
                        "metric names (it was reduced over the ranks that logged it)")
                    break
        return union

    def _reduce(self, parts: list[torch.Tensor], names: list[str]) -> None:
        """parts[r]: rank r's packet. Makes the reduced rows and submits them."""
        n = len(names)
        every = torch.stack(parts)                       # (world, most, 3 + 2n)
        steps = every[:, :, 0]
        real = ~torch.isnan(steps)
        union = torch.unique(steps[real]).to(torch.int64)
        k = len(union)
        if not k:
            return
        where = torch.searchsorted(union.to(torch.float64), torch.where(real, steps, 0.0))
        world = self.world
        values = torch.zeros(world, k, n, dtype=torch.float64)
        present = torch.zeros(world, k, n, dtype=torch.bool)
        times = torch.full((world, k), math.nan, dtype=torch.float64)
        ms = torch.full((world, k), math.nan, dtype=torch.float64)
        r_idx, i_idx = real.nonzero(as_tuple=True)
        at = where[r_idx, i_idx]
        rows = every[r_idx, i_idx]
        values[r_idx, at] = rows[:, 3 + n:]
        present[r_idx, at] = rows[:, 3:3 + n] > 0
        times[r_idx, at] = rows[:, 1]
        ms[r_idx, at] = rows[:, 2]
        count = present.sum(0)                           # (k, n)
        reduced = torch.empty(k, n, dtype=torch.float64)
        for c, name in enumerate(names):
            op = self.per_metric.get(name, self.default_op)
            v, p = values[:, :, c], present[:, :, c]
            if op in ("mean", "sum"):
                r = torch.where(p, v, 0.0).sum(0)
                if op == "mean":
                    r = r / count[:, c].clamp(min=1)
            elif op == "min":
                r = torch.where(p, v, math.inf).amin(0)
            else:
                r = torch.where(p, v, -math.inf).amax(0)
            reduced[:, c] = r
        # step times: min, median (the mean of the two middle ones for an even count), max
        have = ~torch.isnan(ms)
        nms = have.sum(0)
        ordered = torch.where(have, ms, math.inf).sort(0).values
        lo = ordered.gather(0, ((nms - 1).clamp(min=0) // 2).unsqueeze(0))[0]
        hi = ordered.gather(0, (nms.clamp(min=1) // 2).unsqueeze(0))[0]
        slowest = torch.where(have, ms, -math.inf).argmax(0)
        mine = times[self.rank]
        when = torch.where(torch.isnan(mine), torch.where(torch.isnan(times), -math.inf,
                                                          times).amax(0), mine)
        out = []
        steps_l, when_l, cnt_l, red_l = union.tolist(), when.tolist(), count.tolist(), \
            reduced.tolist()
        nms_l, min_l, max_l = nms.tolist(), ordered[0].tolist(), \
            torch.where(have, ms, -math.inf).amax(0).tolist()
        med_l, slow_l = ((lo + hi) / 2).tolist(), slowest.tolist()
        for i, step in enumerate(steps_l):
            vals = {names[c]: red_l[i][c] for c in range(n) if cnt_l[i][c]}
            if nms_l[i]:
                vals[STEP_MIN], vals[STEP_MEDIAN], vals[STEP_MAX] = min_l[i], med_l[i], max_l[i]
                vals[SLOWEST] = float(slow_l[i])
                self._note_slowest(step, slow_l[i], max_l[i], med_l[i])
            out.append(Row(step, when_l[i], vals))
        submit = self._submit
        if submit is not None and not self._ended:
            submit(out)

    def _note_slowest(self, step: int, rank: int, ms: float, median: float) -> None:
        """The present straggler's run goes on until another rank is the slowest at
        SWITCH_AFTER steps in a row (so jitter between equal ranks does not end it)."""
        self._slowest_at[rank] = self._slowest_at.get(rank, 0) + 1
        s = self._streak
        if s and s[0] == rank:
            s[2] += 1
            s[3] += ms
            s[4] += median
            self._rival = []
            return
        rival = self._rival
        if rival and rival[0] == rank:
            rival[2] += 1
            rival[3] += ms
            rival[4] += median
        else:
            self._rival = rival = [rank, step, 1, ms, median]
        if not s or rival[2] >= SWITCH_AFTER:
            self._streak, self._rival = rival, []

    # ---- collectives, the store, giving up ---------------------------------------------------

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """all_gather on the group, waiting in slices so close()'s deadline is kept."""
        group = self.group
        if group is None:                 # finish() destroyed it: no collective after that
            raise _GaveUp
        parts = [torch.empty_like(t) for _ in range(self.world)]
        work = dist.all_gather(parts, t, group=group, async_op=True)
        self.collectives += 1
        while True:
            deadline = self._deadline
            piece = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(piece, 0.01)))
                return parts
            except RuntimeError as exc:
                if "timed out" not in str(exc):
                    raise
            if self._ended:
                raise _GaveUp
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._give_up(self._missing_error("close_timeout passed"))
                raise _GaveUp

    def _note(self, key: str, value: str) -> None:
        if self._store is not None:
            try:
                self._store.set(key, value)
            except Exception:             # the store's host is gone: errors name no rank
                self._store = None

    def _read(self, key: str) -> str | None:
        store = self._store
        if store is None:
            return None
        try:
            return bytes(store.get(key)).decode() if store.check([key]) else None
        except Exception:
            return None

    def _missing_error(self, why: str) -> RuntimeError:
        """Which ranks did not begin the exchange under way, or whose process is gone."""
        e, here = self._exchange, socket.gethostname()
        behind, gone = [], []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            at = self._read(f"{self._tag}/at/{rank}")
            if at is None or int(at) < e:
                behind.append(f"rank {rank} (last exchange: {'none' if at is None else at})")
            where = self._read(f"{self._tag}/pid/{rank}")
            if where is not None:
                host, pid = where.rsplit(" ", 1)
                if host == here and not _alive(int(pid)):
                    gone.append(f"rank {rank} (process {pid} is gone)")
        # A rank whose loop hangs while its exchange thread goes on begins every exchange: it
        # is the one that never began closing (CI, under a sanitizer: every rank had begun the
        # exchange under way, and the error named none).
        hung = [f"rank {r} (its exchanges go on, but it never reached close())"
                for r in self._open if r != self.rank]
        who = "; ".join(gone + [b for b in behind if b.split(" (")[0] not in
                                [g.split(" (")[0] for g in gone]]) or "; ".join(hung) or \
            "a rank the store cannot name"
        return RuntimeError(
            f"syncless.Logger(reduce=...): rank {self.rank} stopped reducing across ranks at "
            f"exchange {e}: missing {who} ({why}); it died or never reached close(). Rows not "
            "reduced by then were not delivered (stats.lost).")

    def _give_up(self, error: Exception | None) -> None:
        with self._cond:
            if error is not None and self.error is None:
                self.error = error
                _log.error("%s", error)
            self._ended = True
            self._submit = None
            self.lost += len(self._pending)
            self._pending = []
            self._cond.notify_all()


class _GaveUp(Exception):
    """The exchange thread ends: close() stopped waiting, or the Logger was dropped."""


def _alive(pid: int) -> bool:
    """Is process `pid` (on this host) running? A zombie, dead but not yet reaped by its
    parent (a launcher), is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
