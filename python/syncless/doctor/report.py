"""Findings (what costs time, and the change that removes it) and the text reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .monitor import cpu_count

__all__ = ["Finding", "starvation_finding", "launch_finding", "sync_findings", "render_audit",
           "render_doctor"]

STARVED_SHARE = 0.10       # data wait >= 10% of the step ...
STARVED_IDLE = 0.10        # ... while the GPU idles >= 10% of it
LAUNCH_MIN_KERNELS = 8
LAUNCH_MIN_IDLE = 0.10     # launch-bound only if the step's GPU work leaves >= 10% of it idle
SYNC_MIN_SHARE = 0.005     # a sync site costing < 0.5% of the step (and < 1 per step) is noise


@dataclass
class Finding:
    kind: str                  # "starvation" | "sync" | "launch-bound"
    title: str
    cost_ms: float             # per step, what fixing it can save at most
    detail: str
    fixes: list = field(default_factory=list)
    where: str = ""            # file:line for a sync


def starvation_finding(data_ms: float, step_ms: float, idle: float | None,
                       loader: dict) -> Finding | None:
    if step_ms <= 0 or data_ms / step_ms < STARVED_SHARE or data_ms < 0.05:
        return None
    if idle is not None and idle < STARVED_IDLE:
        return None            # the GPU stayed busy: waiting for data cost nothing
    cost = data_ms if idle is None else min(data_ms, idle * step_ms)
    return Finding("starvation", "DataLoader starvation", cost,
                   f"the step waits {data_ms:.2f} ms for data ({data_ms / step_ms:.0%} of "
                   f"{step_ms:.2f} ms)" + ("" if idle is None else f"; the GPU idles {idle:.0%}"),
                   loader_fixes(loader))


def loader_fixes(s: dict) -> list:
    cpus = cpu_count()
    if not s:
        return ["the iterator itself is slow: wrap the dataset in a DataLoader with "
                f"num_workers={max(1, min(8, cpus - 1))} (this machine has {cpus} CPUs), "
                "pin_memory=True, persistent_workers=True"]
    fixes = []
    workers = s.get("num_workers") or 0
    if workers == 0:
        fixes.append(f"num_workers=0 loads every batch on the training thread: set num_workers="
                     f"{max(1, min(8, cpus - 1))} (this machine has {cpus} CPUs) so batches "
                     "are prepared in parallel while the GPU works")
    elif workers < cpus - 1:
        fixes.append(f"num_workers={workers} cannot keep up: raise it toward "
                     f"{min(2 * workers, cpus - 1)} (this machine has {cpus} CPUs)")
    else:
        fixes.append(f"all {cpus} CPUs already run workers ({workers}): make each sample cheaper "
                     "(decode/augment on the GPU, cache preprocessed data, smaller images)")
    if workers > 0 and not s.get("persistent_workers"):
        fixes.append("persistent_workers=True: workers are restarted every epoch otherwise")
    if workers > 0 and (s.get("prefetch_factor") or 2) <= 2:
        fixes.append("prefetch_factor=4 to absorb slow batches")
    if not s.get("pin_memory") and _cuda():
        fixes.append("pin_memory=True, then .to(device, non_blocking=True): the host-to-device "
                     "copy overlaps compute instead of blocking the step")
    return fixes


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def launch_finding(cpu_ms: float, gpu_ms: float | None, kernels: float | None, step_ms: float,
                   optimizers: list = ()) -> Finding | None:
    if gpu_ms is None or gpu_ms <= 0 or cpu_ms < gpu_ms:
        return None
    if step_ms > 0 and gpu_ms > (1 - LAUNCH_MIN_IDLE) * step_ms:
        return None            # the GPU is busy: a host blocked by a full launch queue is not slow
    if kernels is not None and kernels < LAUNCH_MIN_KERNELS:
        return None
    per_kernel = f", {gpu_ms * 1e3 / kernels:.0f} µs of GPU work per kernel" if kernels else ""
    count = f"{kernels:.0f} kernels per step" if kernels else "kernels"
    cost = max(0.0, min(step_ms, cpu_ms) - gpu_ms)
    fixes = ["capture the step in a CUDA graph: torch.compile(model, mode=\"reduce-overhead\"), "
             "or torch.cuda.graphs / torch.cuda.make_graphed_callables for the whole step "
             "(one launch replaces all of them)"]
    for opt in optimizers:
        d = getattr(opt, "defaults", {})
        if "fused" in d and not d.get("fused"):
            fixes.append(f"{type(opt).__name__}(..., fused=True): one kernel per step for the "
                         "optimizer instead of several per parameter")
            break
    else:
        fixes.append("use a fused or foreach optimizer (e.g. AdamW(fused=True))")
    fixes.append("fuse small ops (torch.compile, fused layers such as "
                 "F.scaled_dot_product_attention), or raise the batch size so each kernel "
                 "does more work")
    return Finding("launch-bound", "Launch-bound", cost,
                   f"the CPU needs {cpu_ms:.2f} ms to enqueue a step whose GPU work takes "
                   f"{gpu_ms:.2f} ms ({count}{per_kernel}): the GPU waits for launches", fixes)


def sync_findings(audit: Any, step_ms: float | None) -> list:
    out = []
    steps = audit.step_count
    for s in audit.ranked():
        ms = s.blocked_ns / 1e6 / steps
        per_step = s.count / steps
        if step_ms and per_step < 1 and ms < SYNC_MIN_SHARE * step_ms:
            continue
        what = ", ".join(s.what)
        blocked = f", blocking {ms:.3f} ms/step" if audit.backend == "cupti" else ""
        via = f" (via {s.site.via})" if s.site.via else ""
        out.append(Finding("sync", f"Sync at {s.where}", ms,
                           f"`{s.site.code}`{via}: {what}, {per_step:g}×/step{blocked}",
                           [s.fix()], s.where))
    return out


# ---- rendering ------------------------------------------------------------------------------

def _table(rows: list, header: list) -> list:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _backend_lines(audit: Any) -> list:
    if audit.backend == "cupti":
        return ["sync finder: CUPTI callbacks (every CUDA runtime/driver call of this thread)"]
    if audit.backend == "torch-sync-debug":
        return [f"sync finder: torch sync debug mode (CUPTI unavailable: {audit.reason})",
                f"  missed in this mode: {audit.misses}"]
    return [f"sync finder: off ({audit.reason})"]


def render_audit(audit: Any) -> str:
    steps = audit.step_count
    lines = [f"syncless audit: {steps} step(s), {audit.elapsed_s * 1e3:.1f} ms"]
    lines += _backend_lines(audit)
    sites = audit.ranked()
    if not sites:
        lines.append("no host-device syncs found" if audit.backend != "none"
                     else "no host-device syncs possible")
    else:
        timed = audit.backend == "cupti"
        rows = [[s.where, s.site.code[:48], " + ".join(s.what), s.count, f"{s.count / steps:g}",
                 f"{s.blocked_ns / 1e6 / steps:.3f}" if timed else "n/a"] for s in sites]
        lines += _table(rows, ["file:line", "code", "what synced", "count", "count/step",
                               "ms blocked/step"])
        lines.append("fixes:")
        for s in sites:
            lines.append(f"  {s.where}: {s.fix()}")
    if audit.unattributed:
        lines.append(f"{audit.unattributed} sync(s) outside Python code (torch internals)")
    if audit.slow:
        slow = ", ".join(f"{' + '.join(s.what)} at {s.where} ({s.blocked_ns / 1e6:.1f} ms)"
                         for s in sorted(audit.slow.values(), key=lambda s: -s.blocked_ns)[:3])
        lines.append(f"slow CUDA calls that are not syncs: {slow}")
    return "\n".join(lines)


def render_doctor(d: Any) -> str:
    """The doctor's one report: the time budget, the findings ranked by cost, the changes."""
    m = d.summary
    ran = [f"+{d.warmup} warm-up"]
    if d.audit.elapsed_s:                  # 0 when the audit did not run (a script that ended)
        ran.append(f"{d.audit.step_count} audited")
    if d.probe_steps:
        ran.append(f"{d.probe_steps} probed")
    lines = [f"syncless doctor: {m.steps} measured steps ({', '.join(ran)})", ""]
    step = d.step_ms
    lines.append(f"where a step's {step:.2f} ms go" + (" (host wall, GPU drained at both ends)"
                                                       if d.gpu else " (CPU only)"))
    sync_ms = d.sync_ms
    rows = [["data wait", f"{m.data_ms:.3f}", f"{m.data_ms / step:.0%}" if step else "-"],
            ["CPU (enqueue)" if d.gpu else "CPU (compute)", f"{max(0.0, m.cpu_ms - sync_ms):.3f}",
             f"{max(0.0, m.cpu_ms - sync_ms) / step:.0%}" if step else "-"],
            ["sync (blocked)", f"{sync_ms:.3f}" if d.audit.backend == "cupti" else "n/a",
             f"{sync_ms / step:.0%}" if step and d.audit.backend == "cupti" else "-"]]
    if d.gpu:
        busy = d.gpu_busy_ms
        rows.append(["GPU busy", f"{busy:.3f}", f"{busy / step:.0%}" if step else "-"])
        rows.append(["GPU idle", f"{max(0.0, step - busy):.3f}",
                     f"{max(0.0, step - busy) / step:.0%}" if step else "-"])
        if d.gpu_pure_ms is not None:
            rows.append(["GPU work (queue full)", f"{d.gpu_pure_ms:.3f}",
                         f"{d.gpu_pure_ms / step:.0%}" if step else "-"])
    if d.kernels is not None:
        rows.append(["kernels / step", f"{d.kernels:.1f}", ""])
    lines += ["  " + l for l in _table(rows, ["", "ms/step", "share"])]
    lines.append("")
    lines += _backend_lines(d.audit)
    lines.append("")
    if not d.findings:
        lines.append("no findings: " + d.verdict)
    else:
        lines.append("findings, by time they cost per step:")
        for i, f in enumerate(d.findings, 1):
            lines.append(f"{i}. {f.title}: up to {f.cost_ms:.3f} ms/step")
            lines.append(f"   {f.detail}")
            for fix in f.fixes:
                lines.append(f"   fix: {fix}")
    if d.notes:
        lines.append("")
        lines += [f"note: {n}" for n in d.notes]
    if d.trace:
        lines.append(f"trace: {d.trace} (open in https://ui.perfetto.dev)")
    return "\n".join(lines)
