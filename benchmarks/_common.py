"""The harness every benchmark shares: the run context, timed blocks, interleaved rounds, medians
with their spread and the 95% confidence interval of a median ratio, the environment record, and
the JSON + markdown writer. No benchmark logic lives here.

A standalone script is `python -m benchmarks.<name> [--device cpu|cuda] [--quick] [--out DIR]`:
it parses with `arg_parser()`, records `env_info()`, and ends with `write_results()`, which puts
<out>/<name>.json (the numbers and the environment) and <out>/<name>.md (the same, for people)
side by side."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import shlex
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


@dataclass
class Ctx:
    """What every section receives: where to run, how long to spend, and where to leave notes."""
    device: torch.device
    quick: bool = False
    seed: int = 0
    notes: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        self.notes.append(text)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---- statistics ----------------------------------------------------------------------------------

def quantile(xs: Iterable[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method), q in [0, 1]."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(xs: Iterable[float]) -> dict:
    """Median with the interquartile range and the extremes: the spread shown beside a number."""
    s = [float(x) for x in xs if x is not None and not math.isnan(x)]
    if not s:
        return {"n": 0, "median": None, "p25": None, "p75": None, "min": None, "max": None}
    return {"n": len(s), "median": quantile(s, 0.5), "p25": quantile(s, 0.25),
            "p75": quantile(s, 0.75), "min": min(s), "max": max(s)}


def median_ci(xs: Iterable[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: the order statistics x(l), x(n+1-l)
    with the largest l such that P(Binomial(n, 1/2) < l) <= (1 - level) / 2. Unlike the IQR it
    narrows as rounds are added. None when there are too few values for the level."""
    s = sorted(float(x) for x in xs if x is not None and not math.isnan(x))
    n = len(s)
    tail, l, cdf = (1 - level) / 2, 0, 0.0
    while True:
        cdf_next = cdf + math.comb(n, l) / 2 ** n       # P(B <= l)
        if cdf_next > tail:
            break
        cdf, l = cdf_next, l + 1
    if l == 0:
        return None
    return s[l - 1], s[n - l]


def paired_ratios(values: dict, name: str, base: str) -> list[float]:
    """Per-round ratio of a variant to the baseline measured in the same round. Pairing by round
    removes slow drift (clocks, thermals, other tenants) that a ratio of medians would keep."""
    return [v / b for v, b in zip(values[name], values[base]) if v and b]


def beyond_spread(ratio: dict) -> bool:
    """True when the interquartile range of a ratio excludes 1: a difference worth claiming."""
    if not ratio or ratio.get("n", 0) < 5:
        return False
    return ratio["p25"] > 1.0 or ratio["p75"] < 1.0


def interleave(variants: dict[str, Callable[[], float]], rounds: int, rng: random.Random,
               errors: dict | None = None) -> dict[str, list[float]]:
    """Run each variant once per round, in a fresh random order each round; collect what each
    call returns (a time). A variant that raises is recorded in `errors` and dropped."""
    errors = {} if errors is None else errors
    out: dict[str, list[float]] = {name: [] for name in variants}
    live = [name for name in variants if name not in errors]
    for _ in range(rounds):
        order = live[:]
        rng.shuffle(order)
        for name in order:
            if name in errors:
                continue
            try:
                out[name].append(variants[name]())
            except Exception as exc:                      # record it, keep the suite going
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"  ! {name} failed: {errors[name]}", flush=True)
        live = [n for n in live if n not in errors]
    return out


def ratio_summary(values: dict, name: str, base: str) -> dict:
    """The per-round ratio name/base: median [IQR] and the 95% CI of the median ("ci95")."""
    ratios = paired_ratios(values, name, base)
    out = summarize(ratios)
    out["ci95"] = median_ci(ratios)
    return out


def clock() -> float:
    return time.perf_counter()


def block_us(fn: Callable[[], Any], n: int, sync: Callable[[], None]) -> float:
    """Host µs per call of `fn` over n calls. The device is idle at the start (synchronize before
    the clock) and the clock stops before the closing synchronize: the number is what the call
    costs the host, not the GPU work it queues (a call that reads a value pays its sync inside)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / n * 1e6


def calls_for(fn: Callable[[], Any], target_s: float, sync: Callable[[], None],
              lo: int = 3, hi: int = 2000) -> int:
    """How many calls of `fn` fill about target_s seconds (runs it four times: warm-up and probe)."""
    fn()
    per = max(block_us(fn, 3, sync) * 1e-6, 1e-7)
    return max(lo, min(hi, round(target_s / per)))


# ---- environment ---------------------------------------------------------------------------------

def syncs_per_call(fn: Callable[[], Any], calls: int) -> float:
    """Host-device syncs per call of `fn` that torch's sync-debug mode reports over `calls` calls.
    The mode misses torch.cuda.synchronize() and Event.synchronize(); its own "prototype
    feature" notice is not a sync, so only the sync text is counted."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing cuda operation" in str(w.message).lower() for w in seen) / calls


class SyncCount:
    """The host-device syncs torch's sync-debug mode reports between start() and stop(), and
    where they come from: `count`, and `sites` ("file:line" -> count, the file as `short` names
    it). start() and stop() go in a framework's hooks (a training step's first and last), which
    is why this is a pair of calls and not a context manager; stop() without start() does
    nothing. The tests' sync-counting callbacks and benchmarks/frameworks.py share it."""

    def __init__(self, short: Callable[[str], str] = os.path.basename):
        self.short = short
        self.count = 0
        self.sites: dict[str, int] = {}
        self._ctx: Any = None
        self._seen: list = []

    @property
    def running(self) -> bool:
        return self._ctx is not None

    def start(self) -> None:
        self._ctx = warnings.catch_warnings(record=True)
        self._seen = self._ctx.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._ctx is None:
            return
        torch.cuda.set_sync_debug_mode(0)
        self._ctx.__exit__(None, None, None)
        self._ctx = None
        for w in self._seen:
            # Only the sync text: the mode's own "prototype feature" notice is not a sync.
            if "synchroniz" in str(w.message):
                self.count += 1
                key = f"{self.short(w.filename)}:{w.lineno}"
                self.sites[key] = self.sites.get(key, 0) + 1
        self._seen = []


def _nvidia_smi(field_: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field_}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _git_head() -> str | None:
    """This checkout's commit; None where it is not a checkout of its own (a copied tree inside
    another repository would otherwise report that repository's commit)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", "--short",
                              "HEAD"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    if len(out) == 2 and os.path.realpath(out[0]) == os.path.realpath(root):
        return out[1]
    return None


def env_info(device: torch.device, argv: list[str], prog: str = "benchmarks.run") -> dict:
    """What a result depends on: versions, host, GPU, driver, and the command that made it."""
    info = {
        "date": _dt.date.today().isoformat(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", prog, *argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    try:
        import syncless
        info["syncless"] = getattr(syncless, "__version__", "?")
    except Exception as exc:
        info["syncless"] = f"import failed: {exc}"
    info["git"] = _git_head()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["cuda_runtime"] = torch.version.cuda
        info["driver"] = _nvidia_smi("driver_version")
        try:
            v = torch._C._cuda_getDriverVersion()           # e.g. 13000 -> CUDA driver API 13.0
            info["driver_cuda_api"] = f"{v // 1000}.{(v % 1000) // 10}"
        except Exception:
            pass
    else:
        info["gpu"] = "cpu"
        info["cpu"] = platform.processor() or platform.machine()
    return info


ENV_KEYS = ("gpu", "driver", "driver_cuda_api", "cuda_runtime", "torch", "python", "syncless",
            "git", "cpu_count", "platform")


def env_table(env: dict) -> str:
    return md_table(["", ""], [[k, env[k]] for k in ENV_KEYS if env.get(k) is not None])


def slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s or "unknown"


# ---- formatting ----------------------------------------------------------------------------------

def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def pct(ratio: float | None, digits: int = 1) -> str:
    """A ratio as a signed percentage change: 1.088 -> '+8.8%'."""
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return "n/a"
    return f"{(ratio - 1) * 100:+.{digits}f}%"


def pct_spread(s: dict | None) -> str:
    """Median change with its interquartile range: '+8.8% [+6.1, +11.0]'."""
    if not s or s.get("median") is None:
        return "n/a"
    return (f"{pct(s['median'])} [{(s['p25'] - 1) * 100:+.1f}, {(s['p75'] - 1) * 100:+.1f}]")


def pct_ci(ci: list | tuple | None) -> str:
    """A ratio's confidence interval as percentage changes: '[-0.3, +1.1]'."""
    if not ci:
        return "n/a"
    return f"[{(ci[0] - 1) * 100:+.1f}, {(ci[1] - 1) * 100:+.1f}]"


def num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x == 0:
        return "0"
    mag = abs(x)
    if mag >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def num_spread(s: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    """'12.3 [11.9–12.8]': median with its interquartile range."""
    if not s or s.get("median") is None:
        return "n/a"
    return (f"{num(s['median'] * scale, digits)} "
            f"[{num(s['p25'] * scale, digits)}–{num(s['p75'] * scale, digits)}]")


def clean(o: Any) -> Any:
    """JSON-safe copy: NaN/Inf become null, tuples lists, anything unknown its str()."""
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if o is None or isinstance(o, (bool, int, str)):
        return o
    return str(o)


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(data), f, indent=1, allow_nan=False)
        f.write("\n")


# ---- standalone scripts --------------------------------------------------------------------------

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def arg_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options every standalone benchmark takes; a script adds its own."""
    first, _, rest = doc.strip().partition("\n\n")
    p = argparse.ArgumentParser(description=" ".join(first.split()), epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes: seconds, not minutes")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved rounds (default {rounds}; fewer with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", nargs="?", const=RESULTS, default=None,
                   help="directory for <name>.json and <name>.md (bare --out: benchmarks/results)")
    return p


def pick_device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def write_results(out: str | None, name: str, data: dict, text: str,
                  echo: bool = True) -> list[str]:
    """Write <out>/<name>.json and <out>/<name>.md (the markdown headed by the environment);
    print the markdown (unless echo=False). Returns the paths written."""
    env = data.get("env", {})
    md = (f"# {name}: {env.get('gpu', '?')} ({env.get('date', '?')})\n\n"
          f"`{env.get('command', '?')}`" + ("  (quick mode: smoke-test sizes, not for quoting)"
                                           if data.get("quick") else "")
          + "\n\n" + env_table(env) + "\n\n" + text.rstrip() + "\n")
    if echo:
        print("\n" + md, flush=True)
    if not out:
        return []
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"{name}.json"), os.path.join(out, f"{name}.md")]
    write_json(paths[0], data)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(md)
    print("wrote " + ", ".join(paths), flush=True)
    return paths
