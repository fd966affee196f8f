"""The demo (`syncless demo`): the same training loop logged two ways.

A small classifier trains for a few hundred steps (on the GPU if there is one) and logs four
metrics per step: first the usual way (`.item()` on each), then with syncless.Logger. For each it
prints the host-device syncs per step, the step time, and checks that the logged values are
identical. Both runs write their metrics to JSONL files in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

import syncless

METRICS = ("loss", "accuracy", "confidence", "grad_norm")
DESCRIPTION = (__doc__ or "").split("\n\n", 1)[1]

Record = Callable[[int, "dict[str, torch.Tensor]"], None]   # record(step, metrics)
Problem = tuple[torch.Tensor, torch.Tensor, torch.nn.Module, torch.optim.Optimizer]


class Run(NamedTuple):
    """One way of logging: record each step, done() at the end, and the rows it logged."""
    record: Record
    done: Callable[[], None]
    rows: list[tuple[int, dict[str, float]]]


Factory = Callable[..., Run]                  # factory(path=None) -> Run


def make_problem(device: torch.device, seed: int = 0) -> Problem:
    width = 1024 if device.type == "cuda" else 256      # keep the CPU run short
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 256, generator=g)
    w = torch.randn(256, 10, generator=g)
    y = (x @ w + 0.5 * torch.randn(4096, 10, generator=g)).argmax(1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(),
                                torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return x.to(device), y.to(device), model, opt


def train(steps: int, device: torch.device, record: Record, batch: int = 256,
          problem: Problem | None = None) -> None:
    """Run the loop; `record(step, metrics)` is the only thing that differs between runs."""
    x, y, model, opt = problem or make_problem(device)
    n = x.shape[0]
    for step in range(steps):
        i = (step * batch) % n
        xb, yb = x[i:i + batch], y[i:i + batch]
        logits = model(xb)
        loss = F.cross_entropy(logits, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # (torch leaves it unannotated)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            probs = logits.softmax(1)
            accuracy = (logits.argmax(1) == yb).float().mean()
            confidence = probs.max(1).values.mean()
        record(step, {"loss": loss, "accuracy": accuracy, "confidence": confidence,
                      "grad_norm": grad_norm})


def count_syncs(device: torch.device, record_factory: Factory, steps: int = 5) -> float | None:
    """Syncs per step as torch's sync debug mode sees them (GPU only)."""
    if device.type != "cuda":
        return None
    record, done, _rows = record_factory()
    problem = make_problem(device)          # copying the data to the GPU is not the loop's cost
    record(0, {"warm": torch.zeros((), device=device)})   # first use: allocate, JIT
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train(steps, device, record, problem=problem)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    done()
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def naive_factory(path: str | None = None) -> Run:
    rows: list[tuple[int, dict[str, float]]] = []

    def record(step: int, metrics: dict[str, torch.Tensor]) -> None:
        rows.append((step, {k: v.item() for k, v in metrics.items()}))

    def done() -> None:
        if path:
            with open(path, "w") as f:
                for step, values in rows:
                    f.write(json.dumps({"step": step, **values}) + "\n")

    return Run(record, done, rows)


def syncless_factory(path: str | None = None) -> Run:
    rows: list[tuple[int, dict[str, float]]] = []
    sinks: list[Any] = [
        syncless.sinks.Callback(lambda step, t, values: rows.append((step, values)))]
    if path:
        sinks.append(syncless.sinks.JSONL(path, mode="w"))
    log = syncless.Logger(every=100, sinks=sinks)

    def record(step: int, metrics: dict[str, torch.Tensor]) -> None:
        log.log(metrics, step=step)

    return Run(record, log.close, rows)


def timed(device: torch.device, steps: int, factory: Factory,
          path: str) -> tuple[float, list[tuple[int, dict[str, float]]]]:
    record, done, rows = factory(path)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    train(steps, device, record)
    done()                                  # the syncless run's close() delivers everything
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, rows


def _steps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (cpu, cuda, cuda:1)") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"the demo runs on cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available here (use --device cpu)")
    return device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (`syncless demo` is a subcommand built from them)."""
    gpu = torch.cuda.is_available()
    parser.add_argument("--steps", type=_steps, default=300 if gpu else 100, metavar="N",
                        help="training steps of each run (default: 300 with a GPU, 100 "
                             "without)")
    parser.add_argument("--device", type=_device, default="cuda" if gpu else "cpu", metavar="D",
                        help="where the model trains: cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--out", default="runs", metavar="DIR",
                        help="folder for demo-naive.jsonl and demo-syncless.jsonl, created if "
                             "missing (default: %(default)s)")


def main(argv: list[str] | None = None, prog: str = "python -m syncless.demo") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Train both ways, print syncs and step time, and check the logged values are the same."""
    device = args.device
    os.makedirs(args.out, exist_ok=True)

    print(f"syncless demo: {args.steps} steps of a 3-layer MLP on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    # Warm-up (kernels, allocator, JIT): as long as a run, up to 20 steps.
    train(min(20, args.steps), device, lambda step, metrics: None)
    syncs = {"naive": count_syncs(device, naive_factory),
             "syncless": count_syncs(device, syncless_factory)}
    # Two interleaved rounds, best of each: the first run of a process pays warm-up costs.
    best: dict[str, tuple[float, list[tuple[int, dict[str, float]]]]] = {}
    for _ in range(2):
        for name, factory in (("naive", naive_factory), ("syncless", syncless_factory)):
            ms, rows = timed(device, args.steps, factory,
                             os.path.join(args.out, f"demo-{name}.jsonl"))
            if name not in best or ms < best[name][0]:
                best[name] = (ms, rows)
    (ms_naive, naive_rows), (ms_sl, sl_rows) = best["naive"], best["syncless"]

    def fmt_syncs(v: float | None) -> str:
        return "n/a on CPU" if v is None else f"{v:g}"

    print(f"\n{'':24}{'syncs/step':>12}{'ms/step':>10}")
    print(f"{'.item() per metric':24}{fmt_syncs(syncs['naive']):>12}{ms_naive:>10.3f}")
    print(f"{'syncless.Logger':24}{fmt_syncs(syncs['syncless']):>12}{ms_sl:>10.3f}")
    same = naive_rows == sl_rows
    if same:
        print(f"\nlogged values identical: yes ({len(sl_rows)} steps x {len(METRICS)} metrics)")
    else:
        diffs = [abs(a[1][k] - b[1][k]) for a, b in zip(naive_rows, sl_rows) for k in METRICS]
        print(f"\nlogged values identical: NO (steps {len(naive_rows)} vs {len(sl_rows)}, "
              f"max |diff| {max(diffs, default=float('nan')):.3g})")
    if device.type != "cuda":
        print("(no GPU here: there are no syncs to remove, so the two step times should match)")
    print(f"metrics written to {args.out}/demo-naive.jsonl and {args.out}/demo-syncless.jsonl")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
