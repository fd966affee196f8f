"""The text (and HTML) reports: the audit's table, the doctor's verdict-first report, watch()'s."""
from __future__ import annotations

import html
from typing import Any

__all__ = ["audit_repr", "render_audit", "render_doctor", "render_watch", "watch_html"]


def _table(rows: list[list[Any]], header: list[str]) -> list[str]:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _backend_lines(audit: Any) -> list[str]:
    if audit.backend == "cupti":
        return ["sync finder: CUPTI callbacks (every CUDA runtime/driver call of this thread)"]
    if audit.backend == "torch-sync-debug":
        return [f"sync finder: torch sync debug mode (CUPTI unavailable: {audit.reason})",
                f"  missed in this mode: {audit.misses}"]
    return [f"sync finder: off ({audit.reason})"]


def audit_repr(audit: Any, running: bool) -> str:
    """An Audit in one line."""
    finder = {"cupti": "CUPTI", "torch-sync-debug": "torch sync-debug mode"}.get(
        audit.backend, "no sync finder")
    if running:
        return f"<syncless.Audit: running ({finder})>"
    if not audit.elapsed_s:
        return "<syncless.Audit: not run yet (with syncless.audit() as a: ...)>"
    n = sum(s.count for s in audit.sites.values())
    text = (f"<syncless.Audit: {audit.step_count} step(s), {audit.syncs_per_step():g} "
            f"sync(s)/step ({n} at {len(audit.sites)} line(s))")
    if audit.backend == "cupti":
        text += f", {audit.blocked_ms_per_step():.3f} ms blocked/step"
    return f"{text} ({finder})>"


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
        rows = [[s.where + (f" via {s.site.via}" if s.site.via else ""), s.site.code[:48],
                 " + ".join(s.what), s.count, f"{s.count / steps:g}",
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


def _pct(ms: float, step: float) -> str:
    return f"{ms / step:.0%}" if step > 0 else "-"


def _fix_line(fix: Any) -> str:
    ms = getattr(fix, "predicted_ms", None)
    return f"   fix → {ms:.2f} ms/step: {fix}" if ms is not None else f"   fix: {fix}"


def render_doctor(d: Any) -> str:
    """The doctor's report: verdict and headroom, where the step goes, the findings ranked by the
    time their fix wins back (each fix with the step time it predicts), the minor ones, the
    settings read."""
    m = d.summary
    step = d.step_ms
    ran = [f"+{d.warmup} warm-up"]
    if getattr(d, "plain_steps", 0):
        ran.append(f"{d.plain_steps} unobserved")
    if d.audit.elapsed_s:                  # 0 when the audit did not run (a script that ended)
        ran.append(f"{d.audit.step_count} audited")
    if d.probe_steps:
        ran.append(f"{d.probe_steps} probed")
    lines = [f"syncless doctor: {m.steps} measured step{'' if m.steps == 1 else 's'} "
             f"({', '.join(ran)})"]
    if d.boundary:
        lines.append(f"a step ends at each {d.boundary}")
    if getattr(d, "provisional", False):
        lines.append(f"PROVISIONAL: {d.provisional_why}")
    if m.steps == 0:
        # Nothing measured: no verdict and no table of zeros, only why.
        lines.append("")
        lines += [f"note: {n}" for n in d.notes] or ["note: no step was measured"]
        return "\n".join(lines)
    load = getattr(d, "load", None)
    loaded = load is not None and load.loaded
    if load is not None and loaded:
        starved = d.finding("starvation")
        lines.append(f"load: {load.text()}: every time below was measured under that load, and "
                     "may differ without it" + (
                         "; the loader's worker count comes from its measured sweep"
                         if starved is not None and "sweep" in starved.extra else ""))
    lines += ["", f"verdict: {d.verdict}" + (" (measured under load)" if loaded else "")]
    if d.headroom:
        lines.append(f"headroom: {d.headroom}")
    plain = getattr(d, "plain_step_ms", None)
    if plain is not None:
        o = d.overhead
        lines.append(f"step: {plain:.2f} ms unobserved (two timestamps a step, "
                     f"{d.plain_steps} steps), {step:.2f} ms observed" + (
                         f": observing {'slowed' if o > 1 else 'sped'} the loop "
                         f"{'down' if o > 1 else 'up'} by {abs(o - 1):.0%}, so the breakdown "
                         "and predictions below are the observed step's (read them as shares)"
                         if o and abs(o - 1) > 0.05 else ""))
    periodic = getattr(d, "periodic", [])
    if periodic:
        lines.append("")
        lines.append("work apart from the steady step (not in it):")
        for st in periodic:
            when = (f"every {st.every_steps} steps" if st.every_steps else
                    "once" if len(st.steps) == 1 else f"{len(st.steps)} times, irregularly")
            lines.append(f"  - {when}, {st.ms_each:.1f} ms each ({st.share:.0%} of the wall "
                         f"time): {st.what}")
    lines.append("")
    lines.append(f"where a step's {step:.2f} ms go" + (" (host wall, GPU drained at both ends)"
                                                       if d.gpu else " (CPU only)"))
    cupti = d.audit.backend == "cupti"
    cpu = d.cpu_split
    rows = [["data wait", f"{m.data_ms:.3f}", _pct(m.data_ms, step)],
            ["CPU (step body)", f"{m.cpu_ms:.3f}", _pct(m.cpu_ms, step)]]
    if d.gpu:
        if cpu.get("launches_ms") is not None:
            rows.append([f"  kernel launches ({d.kernels:.0f} × {d.launch_us:.1f} µs)",
                         f"{cpu['launches_ms']:.3f}", _pct(cpu["launches_ms"], step)])
        known = cupti or bool(d.sync_ms_source)
        shown = cpu.get("syncs_ms", d.sync_ms)
        rows.append(["  syncs (blocked)", f"{shown:.3f}" if known else "n/a",
                     _pct(shown, step) if known else "-"])
        if cpu.get("rest_ms") is not None:
            rows.append(["  other host work", f"{cpu['rest_ms']:.3f}", _pct(cpu["rest_ms"], step)])
        if d.gpu_work_ms is not None:
            rows.append([f"GPU work ({d.gpu_work_source})", f"{d.gpu_work_ms:.3f}",
                         _pct(d.gpu_work_ms, step)])
            rows.append(["GPU idle", f"{max(0.0, step - d.gpu_work_ms):.3f}",
                         _pct(max(0.0, step - d.gpu_work_ms), step)])
        elif d.gpu_busy_ms:
            rows.append(["GPU busy (event span)", f"{d.gpu_busy_ms:.3f}",
                         _pct(d.gpu_busy_ms, step)])
    if d.kernels is not None and "launches_ms" not in cpu:
        rows.append(["kernels / step", f"{d.kernels:.1f}", ""])
    lines += ["  " + line for line in _table(rows, ["", "ms/step", "share"])]
    if d.gpu and d.sync_ms > 0 and d.host_ms is not None and d.gpu_work_ms is not None:
        count = (f"{d.sync_count:g} sync{'' if d.sync_count == 1 else 's'}/step" if d.sync_count
                 else "the syncs")
        floor = max(d.host_ms, d.gpu_work_ms)
        lines.append(f"  {count} block the host {d.sync_ms:.3f} ms ({d.sync_ms_source}); its own "
                     f"work takes {d.host_ms:.2f} ms, so without them the step could take "
                     f"max({d.host_ms:.2f}, {d.gpu_work_ms:.2f}) = {floor:.2f} ms: they cost "
                     f"{d.sync_cost_ms:.3f} ms/step")
        if d.host_leads and d.sync_count and d.sync_count > 1:
            lines.append(f"  the host is ahead of the GPU without them, and each sync empties "
                         f"its queue: each of the {d.sync_count:g} syncs/step costs about 1/"
                         f"{d.sync_count:g} of that, whichever blocks, and their fixes add up")
    if d.lines:
        lines.append("")
        lines.append(f"host time by line (sampled, {d.samples} samples):")
        for line in d.lines:
            via = f" (in {line.via})" if line.via else ""
            lines.append(f"  {line.samples / d.samples:4.0%}  {line.where}{via}  `{line.code}`")
    lines.append("")
    lines += _backend_lines(d.audit)
    lines.append("")
    if not d.findings:
        lines.append("no findings" + (f": {d.verdict}" if d.verdict else ""))
    else:
        lines.append("findings, by the time their fix wins back per step:")
        for i, f in enumerate(d.findings, 1):
            lines.append(f"{i}. {f.title}: wins back {f.cost_ms:.3f} ms/step "
                         f"({_pct(f.cost_ms, step)})")
            for detail in f.detail.splitlines():
                lines.append(f"   {detail}")
            lines += [_fix_line(fix) for fix in f.fixes]
    if getattr(d, "verify_lines", None) and not d.verify_runs[0]:
        lines.append("")
        lines.append(f"--verify: {d.verify_lines[0]}")
    elif getattr(d, "verify_lines", None):
        runs, seconds = d.verify_runs
        lines.append("")
        lines.append(f"checked by --verify ({runs} fresh runs of the script, {seconds:.0f} s; "
                     "paired, interleaved; 95% intervals):")
        if d.verify_where:
            lines.append(f"  (runs {d.verify_where})")
        load = d.verify_load
        if load is not None and load.loaded:
            # Seen: other processes on 0.83 of 2 CPUs, every run of a CPU loop 4x slower than
            # on the quiet host, and a worker count kept that loses there.
            lines.append(f"  (measured under load: {load.text()}; the pairs are interleaved, so "
                         "both sides of each met it, but on a quiet host the sizes and the "
                         "count that wins may differ)")
        lines += [f"  - {line}" for line in d.verify_lines]
    if d.speedups:
        lines.append("")
        lines.append("to make the GPU's own work faster (not predicted):")
        lines += [f"  - {s}" for s in d.speedups]
    if d.minor:
        lines.append("")
        lines.append("minor (each wins back < 1% of the step):")
        for f in d.minor:
            lines.append(f"  - {f.title}: {f.cost_ms:.3f} ms/step; {f.detail.splitlines()[0]}")
        lines += [f"  - note: {n}" for n in d.minor_notes]
    if d.settings:
        lines.append("")
        lines.append("settings read: " + "; ".join(d.settings))
    if d.notes:
        lines.append("")
        lines += [f"note: {n}" for n in d.notes]
    if d.trace:
        lines.append(f"trace: {d.trace} (open in https://ui.perfetto.dev)")
    return "\n".join(lines)


def render_watch(w: Any) -> str:
    """watch()'s report of what it measured so far (it never waits for the GPU to say it)."""
    m = w.summary()
    if m.steps == 0:
        return "syncless.watch: no step measured yet"
    lines = [f"syncless.watch: {m.steps} steps, {m.step_ms:.2f} ms/step (host wall)"]
    load = w.load()
    if load is not None and load.loaded:
        lines[0] += " (measured under load)"
        lines.insert(0, f"load: {load.text()}: the times below were measured under that load, "
                        "and may differ without it")
    rows = [["data wait", f"{m.data_ms:.3f}", _pct(m.data_ms, m.step_ms)],
            ["CPU (step body)", f"{m.cpu_ms:.3f}", _pct(m.cpu_ms, m.step_ms)]]
    if m.gpu_ms is not None:
        rows.append([f"GPU span ({m.gpu_steps} steps timed)", f"{m.gpu_ms:.3f}",
                     _pct(m.gpu_ms, m.step_ms)])
    lines += ["  " + line for line in _table(rows, ["", "ms/step", "share"])]
    if m.gpu_clock is not None:
        c = m.gpu_clock
        lines.append(f"GPU clock (the logger's rows, {c.steps} steps): {c.pace_ms:.3f} ms/step; "
                     f"{c.verdict()}")
    findings = w.findings(m)
    if findings:
        for f in findings:
            lines.append(f"{f.title}: wins back {f.cost_ms:.3f} ms/step; {f.detail}")
            lines += [_fix_line(fix).strip() for fix in f.fixes]
    elif m.gpu_ms is not None and m.gpu_ms >= 0.9 * m.step_ms:
        lines.append("the GPU is busy through the step (GPU-bound): no loop-side fix wins time")
    else:
        lines.append("no data starvation; for syncs and launch overhead run syncless.doctor()")
    return "\n".join(lines)


def watch_html(w: Any) -> str:
    """watch()'s report for a notebook: the time table as an HTML table, the advice below it."""
    m = w.summary()
    if m.steps == 0:
        return "<p><b>syncless.watch</b>: no step measured yet</p>"
    rows = [("data wait", m.data_ms), ("CPU (step body)", m.cpu_ms)]
    if m.gpu_ms is not None:
        rows.append((f"GPU span ({m.gpu_steps} steps timed)", m.gpu_ms))
    cells = "".join(f"<tr><td>{html.escape(name)}</td><td style='text-align:right'>{ms:.3f}</td>"
                    f"<td style='text-align:right'>{_pct(ms, m.step_ms)}</td></tr>"
                    for name, ms in rows)
    text = render_watch(w).splitlines()
    load = text[:1] if text[0].startswith("load: ") else []
    advice = text[len(load) + len(rows) + 3:]              # the lines below the table
    return ("".join(f"<p>{html.escape(line)}</p>" for line in load)
            + f"<p><b>syncless.watch</b>: {m.steps} steps, {m.step_ms:.2f} ms/step (host wall)"
            + (" (measured under load)" if load else "") + "</p>"
            f"<table><tr><th></th><th>ms/step</th><th>share</th></tr>{cells}</table>"
            + "".join(f"<p>{html.escape(line)}</p>" for line in advice))


class ReportText(str):
    """A report: a str, which a notebook shows as the text it is (not as a quoted string with
    its newlines escaped)."""

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        return "<pre style='font-family:monospace'>" + html.escape(self) + "</pre>"
