"""The Diagnosis of what a ScriptSession measured: the notes on what ran, the step timed
unobserved beside the monitored one, the periodic work named, and how honest the window was."""
from __future__ import annotations

import dataclasses

from ._boundary import ANY_OPTIMIZER, BACKWARD, MARKER, MODULE, OPTIMIZER, STEP_AT
from ._frames import short
from ._loader import handoff_ms
from ._series import Series, Stalls
from ._sweep import sweeper
from ._session import PHASES, ScriptSession
from .diagnose import Diagnosis, Measured, assess, launch_cost_us
from .findings import in_framework_words
from ._phases import cuda

__all__ = ["diagnosis", "boundary_text"]


def diagnosis(s: ScriptSession, boundary: str | None = None) -> Diagnosis:
    """The Diagnosis of what `s` measured (call after its run); `boundary`: what ends a step,
    in words (default: what the boundaries found)."""
    s.monitor.drain()
    warmup = s.done["warm-up"]
    observed = s.watching.observed or s.split("monitor")
    m = s.monitor.summary(skip=warmup, exclude=frozenset(warmup + i for i in observed.stalled))
    gpu = cuda()
    notes = _notes(s)
    if "audit" not in s.entered:
        s.audit.reason = "the script ended before the audit"
    m = s.feed.feeding_only(m, notes, s.contexts["monitor"], observed.stalled)
    step_ms = s.watching.step_ms if s.watching.step_ms is not None else m.step_ms
    monitored = max(1, s.done["monitor"])
    probe = s.probing.probe
    opt_s = s.watching.optimizer_s
    # What a worker's batch costs the training thread to take, where the step waits for data:
    # workers cannot win back that much of the wait.
    handoff = handoff_ms(s.feed.handoff_spec()) if m.data_ms >= 0.05 and m.loader else None
    d = assess(Measured(
        m, s.audit, warmup, step_ms, gpu, m.gpu_ms, s.probing.gpu_pure_ms,
        probe.steps if probe else 0, notes, kernel_time=s.tracing.kernel_time,
        launch_us=launch_cost_us() if gpu else None, sampler=s.sampler,
        boundary=boundary if boundary is not None else boundary_text(s),
        optimizer_ms=opt_s * 1e3 / monitored if opt_s else None,
        model=s.bounds.model, autocast=s.bounds.autocast, handoff_ms=handoff,
        sweeper=sweeper(s.feed.feeding_recipe())))
    # Over the run and the loader sweep: whether other processes competed for the CPUs.
    d.load = s.load.read() if s.load is not None else None
    if s.tracing.traced:
        d.trace = s.trace
    if d.summary.steps:                      # every monitored step, stalls or not
        d.summary = dataclasses.replace(d.summary, steps=s.done["monitor"])
    _honest(s, d, observed)
    d.framework = s.bounds.framework
    in_framework_words(d.findings + d.minor, s.bounds.framework, gpu)
    return d


def _notes(s: ScriptSession) -> list[str]:
    """What ran and what did not, for the report's notes."""
    kind = s.bounds.kind
    seen = s.bounds.seen.get(kind, 0) if kind else 0
    notes = []
    if kind is None and s.ended != "ended":
        notes.append(f"the script {s.ended} before its first step boundary (an "
                     "optimizer.step(), backward(), DataLoader next() or nn.Module call): "
                     "nothing was measured")
    elif kind is None:
        notes.append("no step boundary was seen (no optimizer.step(), backward(), DataLoader "
                     "next() or nn.Module call): mark the end of each step with "
                     "syncless.step(), or name its line with --step-at FILE:LINE")
    else:
        gone = missed(s)
        if gone:
            total = sum(s.planned(p) for p in PHASES)
            notes.append(f"the script {s.ended} after {seen} step"
                         f"{'' if seen == 1 else 's'}: {gone}; all phases take {total} "
                         "steps (lower --steps or --audit-steps, or let the script run "
                         "longer)")
        elif s.ended != "ended" and not s.finished:
            notes.append(f"the script {s.ended} after {seen} step{'' if seen == 1 else 's'}")
    if kind is not None and s.evaluation_only():
        notes.append(f"only forward-only steps ran ({s.bounds.forward_only} model calls "
                     "with autograd off), while an optimizer was made that never stepped: an "
                     "evaluation before training, not measured as the training step")
    if s.step_at and kind != STEP_AT:
        notes.insert(0, f"--step-at {short(s.step_at[0])}:{s.step_at[1]} never ran"
                        + (f": the steps end at each {kind} instead" if kind else ""))
    probe = s.probing.probe
    if probe is not None and probe.uncovered:
        # A sync in the step waits for the sleep itself: every probed step then outlasts it
        # (5 of 7 public scripts on an H100, each syncing 1-7 times a step).
        syncs = s.audit.syncs_per_step() if s.audit.sites else 0.0
        why = (f"the step syncs {syncs:.3g}×, and a sync waits out the GPU sleep that holds "
               "the step's kernels back" if syncs >= 1 else "they took the host longer than "
               "the GPU sleep that held their kernels back (a slow batch?)")
        notes.append(f"{probe.uncovered} of the probed steps were not timed with the GPU's "
                     f"queue full: {why}"
                     + ("" if probe.steps else "; the GPU work is the kernel trace's"))
    return notes


def boundary_text(s: ScriptSession) -> str:
    """What ends a step, in words."""
    b, kind = s.bounds, s.bounds.kind
    if kind == OPTIMIZER and b.optimizer is not None:
        text = f"{kind} ({type(b.optimizer).__name__})"
        others = len(b.optimizers) - 1
        if others:
            names = ", ".join(type(o).__name__ for o in b.optimizers[1:])
            text = (f"{kind} of the first optimizer stepped ({type(b.optimizer).__name__}; "
                    f"{others} other{'s' if others > 1 else ''} stepped too: {names})")
        backward = s.watching.per_step(BACKWARD)
        if backward is not None and backward != 1:
            # Gradient accumulation (or a step with several losses): say what a step is.
            text += f", {backward:g} backward() calls per step"
        return text
    if kind in (MARKER, STEP_AT):
        text = (f"pass over {short(s.step_at[0])}:{s.step_at[1]} (--step-at)"
                if kind == STEP_AT and s.step_at else kind)
        # What the user's boundary holds: a line that runs more often than once a step
        # (a loop header) or a marker in the wrong loop shows here.
        counts = [(s.watching.per_step(k), name) for k, name in
                  ((ANY_OPTIMIZER, "optimizer.step()"), (BACKWARD, "backward()"))]
        shown = [f"{n:.3g} × {name}" for n, name in counts if n]
        return text + (f" (per step: {', '.join(shown)})" if shown else "")
    if kind == MODULE and b.model is not None:
        return f"end of {kind} ({type(b.model).__name__})"
    return kind or ""


def missed(s: ScriptSession) -> str:
    """The phases that ran short or not at all, in words ("" when every one ran)."""
    parts = []
    for phase in PHASES:
        want, got = s.planned(phase), s.done[phase]
        if phase == "kernels" and not s.trace:
            continue                       # an internal phase: only --trace asks for it
        if got < want:
            name = "trace" if phase == "kernels" else phase
            parts.append(f"the {name} ran {got} of {want} steps" if phase in s.entered
                         else f"the {name} did not run")
    return ", ".join(parts)


# ---- the unobserved step, the periodic work, how honest the window was --------------------------

def _honest(s: ScriptSession, d: Diagnosis, observed: Series) -> None:
    d.warmup = s.done["warm-up"]
    d.plain_steps = s.done["plain"]
    plain = s.plain.series
    d.plain_step_ms = s.plain.step_ms()
    if d.plain_step_ms and d.step_ms:
        d.overhead = d.step_ms / d.plain_step_ms
    d.periodic = _periodic(s, plain, observed)
    why = list(s.why)
    if s.evaluation_only():
        why.append("only an evaluation (forward-only steps) ran; the training step never came")
    elif plain is None or not plain.steps:
        why.append("the script ended before its steps were timed unobserved")
    elif not s.finished and missed(s):
        why.append(f"the script {s.ended} before every phase ran ({missed(s)})")
    for st in d.periodic:
        if st.every_steps is None and len(st.steps) == 1 and st.share >= 0.05:
            why.append(f"a stall of {st.ms_each:.0f} ms came once in "
                       f"{(plain if plain is not None else observed).steps} steps "
                       "(work with a longer period, or a one-off?)")
    d.provisional = bool(why)
    d.provisional_why = "; ".join(why)


def _periodic(s: ScriptSession, plain: Series | None, observed: Series) -> list[Stalls]:
    """The unobserved steps' stalls (their true size), each named by what the monitored
    steps' stalls of about its size did; the monitored ones alone when no step ran
    unobserved."""
    stalls = list(plain.stalls) if plain is not None and plain.steps else list(observed.stalls)
    for st in stalls:
        match = [o for o in observed.stalls if o.ms_each and st.ms_each and
                 1 / 3 <= o.ms_each / st.ms_each <= 3]
        st.what = _what(s, match[0].steps, observed) if match else \
            "not seen again while observed: unknown"
    return stalls


def _what(s: ScriptSession, steps: list[int], observed: Series) -> str:
    """What the monitored steps at `steps` did beyond a steady step: waited for a new epoch's
    first batches, ran forward-only model calls (an evaluation), or host work at a line."""
    warm = s.done["warm-up"]
    data = list(s.monitor.data_s)
    first = s.monitor.steps - len(data)

    def wait(i: int) -> float:
        j = warm + i - first
        return data[j] * 1e3 if 0 <= j < len(data) else 0.0

    contexts = s.contexts["monitor"]
    ctx = [contexts[i] for i in steps if i < len(contexts)]
    if not ctx:
        return "unknown"
    rest = [wait(i) for i in range(len(contexts)) if i not in observed.stalled]
    feeding = s.feed.feeding(s.contexts["monitor"] + s.contexts["plain"])
    other: dict[int, int] = {}
    for c in ctx:
        for k, n in c.nexts.items():
            if k != feeding:
                other[k] = other.get(k, 0) + n
    forward = sum(c.forward for c in ctx) / len(ctx)
    if other:
        names = ", ".join(f"{n / len(ctx):g} next() of {s.feed.names.get(k, '?')}"
                          for k, n in other.items())
        return (f"an evaluation (another DataLoader: {names}"
                + (f"; {forward:g} forward-only model calls" if forward else "") + ")")
    extra = sum(s.durations["monitor"][i] for i in steps) / len(steps) - observed.steady_ms
    waited = sum(wait(i) for i in steps) / len(steps) - (sum(rest) / len(rest) if rest else 0.0)
    # A new epoch: the loader's workers start in iter(), before the first next() (the
    # script's `for` line, not data wait); its first batches are waited for in next().
    if sum(c.epochs for c in ctx) >= 0.5 * len(ctx):
        loader = s.feed.loader or {}
        workers = loader.get("num_workers") or 0
        if workers and not loader.get("persistent_workers"):
            return (f"a new epoch: the DataLoader starts its {workers} workers again "
                    "(persistent_workers=True keeps them)")
        return "a new epoch: the DataLoader's first batch"
    if extra > 0 and waited >= 0.5 * extra:
        return "the DataLoader makes the step wait (slow batches now and then)"
    if forward >= 1:
        return (f"an evaluation: {forward:g} forward-only model calls (autograd off) "
                "inside the step")
    line, n = s.sampler.line_between([(c.start, c.end) for c in ctx])
    if line is not None and n:
        return f"host work, mostly at {line.where} `{line.code}`"
    return "host work in the step"
