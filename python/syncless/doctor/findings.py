"""What costs a step time, and what its fix wins back.

The model: a step of S ms whose GPU work takes G ms can get no faster than G. The host blocks Y ms
per step in syncs, so its own work (Python, launches, data wait) takes H = S - Y. Without syncs the
host runs ahead of the GPU and the step takes max(H, G): removing every sync wins
min(Y, S - G, the GPU idle the syncs cause), nothing in a GPU-bound step, and in a CPU-bound step
no more than they block. Removing x ms of the host's own work (the data wait) wins
max(H, G) - max(H - x, G): nothing while the GPU is the slower side. Every fix carries the step
time it predicts; a finding is ranked by what its best fix wins back, and one that wins less than
1% of the step is minor.

Which sync wins what: each sync that finds work queued empties the GPU's queue, and the GPU idles
until the host, whose launches it then runs right behind, is ahead again. While the host is the
slower side (H > LEADS * G) the syncs share the win by the time they block, the host's time they
take. When the host's own work is well under the GPU's (H <= LEADS * G; 0.38 and 0.63 in the H200
corpus' Trainer and Lightning steps, where 0.80 was a step whose host kept the GPU's pace only
just, ~17 ms each in a profile) and the syncs come every step, the step's GPU idle S - G is theirs:
the first sync of a step drains the queue and blocks, the next ones find it empty and block little,
yet each leaves its own restart, so with one gone the next blocks in its place. There each of the N
syncs a step (the audit's count) wins (S - G) / N, the GPU idle the trace attributes to them does
not cap it (it misses the idle of the host falling behind again right after a restart), and fixes
add up: on the H200 a Trainer step of 54.60 ms with 48.71 ms of GPU work, 5 syncs a step, the
trace's sync idle 3.90 ms, measured 49.29 ms with 4 of them gone (48.71 + 5.89 / 5 = 49.89
predicted)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ._frames import stdlib
from ._frameworks import FrameworkFix, framework_fix
from ._loader import WorkerPlan, plan_workers
from ._sweep import Sweep, max_workers
from .audit import ASYNC_COPY, SyncSite

__all__ = ["Fix", "Finding", "after", "starvation_finding", "sync_findings", "launch_finding",
           "MINOR_SHARE", "LEADS", "in_framework_words"]

MINOR_SHARE = 0.01         # a finding winning back < 1% of the step is minor
LEADS = 0.7                # host work <= this share of the GPU's: without syncs the host leads
LAUNCH_MIN_KERNELS = 8


class Fix(str):
    """The text of a change, with the step time it predicts (None: not predicted)."""
    predicted_ms: float | None
    tag: str

    def __new__(cls, text: str, predicted_ms: float | None = None, tag: str = "") -> "Fix":
        self = super().__new__(cls, text)
        self.predicted_ms = predicted_ms
        self.tag = tag
        return self


@dataclass
class Finding:
    kind: str                  # "starvation" | "sync" | "framework" | "launch-bound"
    title: str
    cost_ms: float             # what the best fix wins back per step
    detail: str
    fixes: list[Fix] = field(default_factory=list)
    where: str = ""            # file:line of a sync
    extra: dict[str, Any] = field(default_factory=dict)
    # --verify's measurement of the best setting fix: {measured_ms, ci_low_ms, ci_high_ms, kept}
    verified: dict[str, Any] | None = None

    @property
    def predicted_ms(self) -> float | None:
        known = [p for p in (f.predicted_ms for f in self.fixes) if p is not None]
        return min(known) if known else None

    @property
    def checked_ms(self) -> float | None:
        """The prediction of the fix --verify applies from outside: a launch-bound step's
        torch.compile(mode="reduce-overhead"), else the best fix's."""
        if self.kind == "launch-bound":
            tagged = next((f.predicted_ms for f in self.fixes if f.tag == "cuda-graph"), None)
            if tagged is not None:
                return tagged
        return self.predicted_ms

    def ordered(self) -> None:
        """Predicted fixes first, the fastest predicted step first; the rest keep their order."""
        self.fixes.sort(key=lambda f: (getattr(f, "predicted_ms", None) is None,
                                       getattr(f, "predicted_ms", None) or 0.0))

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "title": self.title, "wins_ms": self.cost_ms,
                "predicted_ms": self.predicted_ms, "checked_ms": self.checked_ms,
                "verified": self.verified,
                "detail": self.detail, "where": self.where,
                "fixes": [{"text": str(f), "predicted_ms": getattr(f, "predicted_ms", None),
                           "tag": getattr(f, "tag", "")} for f in self.fixes], **self.extra}


def after(step_ms: float, removed_ms: float, gpu_ms: float | None) -> float:
    """The step time once `removed_ms` of host-side time leaves a step of `step_ms` whose GPU work
    takes `gpu_ms` (None: no GPU, nothing else bounds it)."""
    return max(step_ms - removed_ms, gpu_ms or 0.0, 0.0)


# ---- data ------------------------------------------------------------------------------------

def starvation_finding(data_ms: float, step_ms: float, gpu_ms: float | None,
                       loader: dict[str, Any],
                       *, cuda: bool = False, copy_ms: float = 0.0,
                       cpus: int | None = None, data_cpu: float | None = None,
                       host_ms: float | None = None, trainer_cpus: int = 1,
                       handoff_ms: float | None = None,
                       sweeper: Callable[[float], Sweep | None] | None = None,
                       body_cpu_ms: float | None = None) -> Finding | None:
    """The loader makes the step wait `data_ms`; `copy_ms` is the blocked time of the batch's own
    pageable copy (removed by pin_memory + non_blocking, which the fix includes); `host_ms` is
    the step less its time blocked in syncs (None: the whole step); `handoff_ms`: what taking a
    ready batch from a worker costs the training thread (measured; None: not measured, taken
    as 0), which the step still waits with workers that keep up. `sweeper(target_ms)`: side
    loaders of the loader's own dataset timed with k workers until one keeps up with a step of
    target_ms (_sweep.py); where it measured, the worker count and the step it predicts come from
    it, not from the model. It runs only where the wait is worth a finding (MINOR_SHARE).
    `body_cpu_ms`: the CPU time of this process in the step body (a CPU loop's, measured by the
    monitor; None: not measured): how many CPUs the step leaves workers that compute."""
    if step_ms <= 0 or data_ms < 0.05:
        return None
    pin = cuda and bool(loader) and not loader.get("pin_memory")
    removed = max(0.0, data_ms - (handoff_ms or 0.0)) + (copy_ms if pin else 0.0)
    if removed < 0.05:
        return None                     # workers would not win it back (the caller says so)
    host = step_ms if host_ms is None else min(host_ms, step_ms)
    floor = gpu_ms or 0.0
    if host > floor:
        # The host is the slower side even without its syncs: the GPU idles through the wait,
        # and the syncs after it wait for GPU work the wait held back. Once batches are ready
        # they block only while the GPU is behind, which the floor holds (imagenet resnet18 -j 4
        # on an H100: a 125.4-ms step, 73.9 of data wait and 41.8 blocked in .item(), 55.2 of
        # GPU work; 8 and 16 workers measured 61 and 59 ms, where counting the blocked time as
        # host work predicted 97). At most the wait itself: the syncs are their own finding.
        wins = min(removed, step_ms - max(host - removed, floor))
    else:
        # The GPU is the slower side: the wait hides behind its work once the syncs that keep
        # the host from leading are gone (their own finding), and wins only what shows above it.
        wins = max(host, floor) - max(host - removed, floor)
    target = max(0.0, step_ms - max(0.0, wins))
    # `trainer_cpus`: the CPUs the training process keeps busy itself: one for a GPU loop's
    # host, torch's intra-op threads for a loop that computes on the CPU (the doctor says).
    plan = plan_workers(loader, data_ms, step_ms, target, cpus, data_cpu, trainer_cpus)
    busy = min(target, max(0.0, host - data_ms))        # the body (wall), syncs and wait out
    sweep = sweeper(target) if sweeper is not None and wins >= MINOR_SHARE * step_ms else None
    fixes: list[Fix] = []
    workers = plan.workers
    per = f"one worker makes a batch in {plan.per_batch_ms:.1f} ms"
    if not plan.computes:
        per += f" (mostly waiting: {data_cpu:.0%} of it on a CPU, so workers need no CPU each)"
    need = f"the step needs one every {target:.2f} ms"
    if sweep is not None and sweep.period_ms:
        plan.needed, plan.enough, fixes = _swept(sweep, plan, target, step_ms, bool(loader),
                                                 busy, body_cpu_ms)
    elif plan.enough:
        what = (f"num_workers={plan.needed}" if loader else
                f"wrap the dataset in a DataLoader with num_workers={plan.needed}")
        now = (f"num_workers={workers} cannot keep up" if loader and workers else
               "num_workers=0 makes each batch on the training thread" if loader else
               "the iterator makes each batch on the training thread")
        fixes.append(Fix(f"{now}: {what} (at least {plan.needed}: {per} and {need}; this machine "
                         f"has {plan.cpus} CPUs)", target, "workers"))
    elif plan.most == 0:
        fixes.append(Fix(
            f"no CPU is free for a worker: {per}, and torch's own threads use "
            f"{plan.trainer_cpus} of this machine's {plan.cpus} CPUs "
            "(torch.get_num_threads()), so a worker would take its CPU from the step. Measure "
            "it (python -m syncless doctor --verify sweeps num_workers), or make batches "
            "cheaper (store preprocessed samples, so that loading only reads)", None, "workers"))
    else:
        best = plan.step_ms(plan.most)
        fixes.append(Fix(
            f"no worker count is enough (num_workers={workers} now): {per}, so even {plan.most} "
            f"worker{'s' if plan.most > 1 else ''} (this machine has {plan.cpus} CPUs) deliver "
            f"one every {plan.per_batch_ms / plan.most:.2f} ms while {need}. Make batches "
            "cheaper: decode at a lower resolution or with a faster decoder, augment on the GPU "
            "(on the batch after .to(device)), or store preprocessed samples (uint8 tensors, a "
            "memory-mapped array) so that workers only read"
            + ("" if plan.most > workers else
               f": that wins back up to {wins:.2f} ms/step (the whole wait, were batches free)"),
            best if plan.most > workers else None, "workers"))
    if pin:
        fixes.append(Fix("pin_memory=True, then .to(device, non_blocking=True): the host-to-device "
                         "copy no longer blocks the step (counted in the prediction above)"))
    if loader and not loader.get("persistent_workers") and max(workers, plan.needed) > 0:
        fixes.append(Fix("persistent_workers=True: otherwise the workers restart (and stall the "
                         "loop) at every epoch"))
    share = data_ms / step_ms
    # Ranked by its prediction, or, where no worker count helps and none is predicted, by what
    # removing the wait could win at most: a data-bound step must not read as a minor finding.
    first = fixes[0].predicted_ms
    cost = wins if first is None else step_ms - min(first, step_ms)
    handed = (f"; taking a ready batch from a worker costs {handoff_ms:.2f} ms here (measured), "
              "which the step still waits" if handoff_ms else "")
    f = Finding("starvation", "DataLoader starvation", cost,
                f"the step waits {data_ms:.2f} ms for data ({share:.0%} of {step_ms:.2f} ms)"
                + handed,
                fixes, extra={"workers_needed": plan.needed if plan.enough else None,
                              "per_worker_batch_ms": plan.per_batch_ms})
    if sweep is not None:
        f.extra["sweep"] = sweep.as_dict()
    return f


CHEAPER = ("make batches cheaper: decode at a lower resolution or with a faster decoder, augment "
           "on the GPU (on the batch after .to(device)), or store preprocessed samples (uint8 "
           "tensors, a memory-mapped array) so that workers only read")


def step_cpus(target: float, trainer_cpus: int, cpus: int, busy_ms: float,
              body_cpu_ms: float | None) -> tuple[int, str]:
    """The CPUs a step of `target` ms keeps busy, and how that was found. None where torch runs
    on one thread, or for a GPU loop's host: that thread waits while a batch is made (decoding
    10 ms a sample for a 0.5-ms step: 2 workers on 2 cores, 41 -> 22 ms/step, measured). Else
    the CPU time its body took (`body_cpu_ms`, all of the process's threads, measured on a CPU
    loop) spread over the step; unmeasured, each of torch's `trainer_cpus` threads counted for
    the share of the step the body is busy (`busy_ms`: the body less its blocked syncs).
    Where the step and the workers compete for the CPUs the doctor measures neither (on 2 cores,
    10 ms of matmuls on 2 threads a step and decoding workers: 0 workers 54.2 ms/step, 1: 56.8,
    2: 37.1; benchmarks/doctor_sweep.py's "busy"): it then prescribes none, and --verify times
    the counts."""
    if target <= 0 or trainer_cpus <= 1:
        return 0, ""
    if body_cpu_ms is not None:
        n = min(cpus, max(0, math.ceil(body_cpu_ms / target - 0.05)))
        return n, (f"the step keeps {n} of this machine's {cpus} CPUs busy (measured: its body "
                   f"takes {body_cpu_ms:.2f} ms of CPU time, torch's {trainer_cpus} threads "
                   "included)")
    n = math.ceil(trainer_cpus * min(1.0, busy_ms / target) - 0.05)
    return n, (f"torch's own {trainer_cpus} threads (torch.get_num_threads()) keep {n} of this "
               f"machine's {cpus} CPUs busy through the step")


def _swept(sweep: Sweep, plan: WorkerPlan, target: float, step_ms: float,
           loader: bool, busy_ms: float, body_cpu_ms: float | None = None
           ) -> tuple[int, bool, list[Fix]]:
    """(workers needed, whether more workers are prescribed, the fixes) from what the sweep
    measured: the fewest workers whose step is within 5% of the best measured, the step
    predicted as the slower of their batch period and the step's own time. Workers that compute
    get at most the CPUs the step leaves (step_cpus)."""
    workers, cpus = plan.workers, plan.cpus
    computes = sweep.computes
    share = sweep.cpu_share.get(min(sweep.cpu_share)) if sweep.cpu_share else None
    busy = f"{share:.0%} of their time on a CPU" if share is not None else "CPU time unread"
    plan.computes = computes
    kept, how = step_cpus(target, plan.trainer_cpus, cpus, busy_ms, body_cpu_ms)
    most = max(0, cpus - kept) if computes else max_workers(cpus)
    plan.most = most
    measured = (f"measured: side loaders of this loader's dataset, sampler and collate made a "
                f"batch every {sweep.text()}; the workers {'compute' if computes else 'wait'} "
                f"({busy})")
    need = f"the step needs one every {target:.2f} ms"
    if computes and most < max(sweep.period_ms):
        need += (f"; at most {most} worker{'s' if most != 1 else ''} can compute beside it"
                 + (f", as {how}" if how else f" on this machine's {cpus} CPUs"))
    k = sweep.choose(target, most)
    far = sweep.extrapolate(target, most)
    if far is not None and (k is None or far[0] > k):
        k, period = far
        last = max(sweep.period_ms)
        measured += (f"; its time ran out while each doubling still cut the period, so "
                     f"{k} workers are extrapolated from {last}: a batch every {period:.1f} ms")
        predicted = max(period, target)
        keeps = True
    elif k is None:
        return 0, False, [Fix(
            f"no CPU is free for a worker: the workers compute ({busy}), and {how}, so a "
            f"worker would take its CPU from the step ({measured}); {CHEAPER}. How the step "
            "and workers share the CPUs, the side loaders do not measure: --verify times the "
            "loop itself with 1, 2, 4 ... workers, up to the CPUs (on by default when its runs "
            "fit)", None,
            "workers")]
    else:
        predicted = sweep.predicted_ms(k, target)
        keeps = sweep.period_ms[k] <= 1.1 * target  # with 10% to spare: batch times jitter
    if k <= workers or predicted >= step_ms:
        # Ranked by what removing the wait could win (no count is predicted to win it).
        return workers, False, [Fix(
            f"no worker count the sweep tried beyond num_workers={workers} makes the step "
            f"faster than its {step_ms:.2f} ms ({measured}; {need}): {CHEAPER}", None,
            "workers")]
    now = (f"num_workers={workers} cannot keep up" if loader and workers else
           "num_workers=0 makes each batch on the training thread" if loader else
           "the iterator makes each batch on the training thread")
    what = (f"num_workers={k}" if loader else
            f"wrap the dataset in a DataLoader with num_workers={k}")
    text = f"{now}: {what} ({measured}; {need}; this machine has {cpus} CPUs)"
    if not keeps and computes:
        text += f"; the loader is still the slower side with {k}: {CHEAPER}"
    elif not keeps:
        text += (f"; the loader is still the slower side with {k} (the sweep {sweep.ended}): "
                 "more workers may go further, or faster storage")
    return k, True, [Fix(text, predicted, "workers")]


# ---- syncs -----------------------------------------------------------------------------------

def sync_findings(audit: Any, step_ms: float, gpu_ms: float | None,
                  wins_ms: float | None = None,
                  samples: Mapping[tuple[str, int, str] | None, int] | None = None,
                  by_count: bool = False) -> list[Finding]:
    """One finding per sync line of user code; syncs made inside a framework are grouped into one
    finding per framework setting that removes them (the setting in the title).

    `wins_ms`: what removing every sync of the step wins back (the module's model; None: the
    audit's blocked time bounded by the GPU idle). Each finding gets the share of it that its
    syncs block: by the monitored steps' stack samples at their lines (`samples`, keyed by
    (file, line, via)) when those saw the syncs, else by the audit's blocked time, else by how
    often they sync. `by_count`: the host leads the GPU without the syncs (the module's model),
    so each sync a step gets an equal share."""
    out: list[Finding] = []
    steps = audit.step_count
    timed = audit.backend == "cupti"
    frameworks: dict[tuple[str, str], list[tuple[SyncSite, FrameworkFix, float, float]]] = {}
    kept = [s for s in audit.sites.values()
            if not (s.kinds == {ASYNC_COPY} and s.count / steps < 1)]
    total_ns = sum(s.blocked_ns for s in kept)
    total_count = sum(s.count for s in kept) or 1
    counts = samples or {}

    def sampled(s: SyncSite) -> int:
        return counts.get((s.site.file, s.site.line, s.site.via), 0)

    total_samples = sum(sampled(s) for s in kept)
    wins = wins_ms if wins_ms is not None else \
        min(total_ns / 1e6 / steps, max(0.0, step_ms - (gpu_ms or 0.0)))

    def predict(group: list[SyncSite]) -> float | None:
        if not timed:
            return None
        if by_count:
            share = sum(s.count for s in group) / total_count
        elif total_samples >= 3:
            share = sum(sampled(s) for s in group) / total_samples
        elif total_ns >= 1000 * steps:
            share = sum(s.blocked_ns for s in group) / total_ns
        else:
            share = sum(s.count for s in group) / total_count
        return max(0.0, step_ms - wins * min(1.0, share))

    for s in audit.ranked():
        ms = s.blocked_ns / 1e6 / steps if timed else 0.0
        per_step = s.count / steps
        if s.kinds == {ASYNC_COPY} and per_step < 1:
            # An "async" copy that blocked now and then, not every step: the launch queue was
            # full (the GPU's pace), not a pageable copy.
            continue
        fw = framework_fix(s.site.chain) if s.site.chain else None
        if fw is not None:
            frameworks.setdefault((fw.framework, fw.setting), []).append((s, fw, ms, per_step))
            continue
        what = ", ".join(s.what)
        blocked = f", blocking {ms:.3f} ms/step under the audit" if timed else ""
        via = f" (via {s.site.via})" if s.site.via else ""
        predicted = predict([s])
        # A chain of standard-library frames only (logging formatting a tensor lazily): the
        # user's own line is what to change.
        in_library = any(not stdlib(f.file) for f in s.site.chain)
        fix = Fix(s.fix() if not in_library else
                  f"the sync is made inside library code ({s.site.via} `"
                  f"{s.site.chain[0].code()}`), entered from your line: the fix is a setting of "
                  "that library, or a change there", predicted, "sync")
        out.append(Finding("sync", f"Sync at {s.where}", step_ms - (predicted or step_ms),
                           f"`{s.site.code}`{via}: {what}, {per_step:g}×/step{blocked}",
                           [fix], s.where, {"blocked_ms": ms, "per_step": per_step}))
    for (name, setting), sites in frameworks.items():
        total = sum(ms for _, _, ms, _ in sites)
        predicted = predict([x for x, _, _, _ in sites])
        lines: list[str] = []
        fixes: list[str] = []
        for s, fw, ms, per_step in sites:
            blocked = f", {ms:.3f} ms blocked under the audit" if timed else ""
            lines.append(f"{fw.frame.where} (entered at {s.where} `{s.site.code}`): "
                         f"{' + '.join(s.what)}, {per_step:g}×/step{blocked}")
            if fw.fix not in fixes:
                fixes.append(fw.fix)
        count = sum(p for _, _, _, p in sites)
        fix_objs = [Fix(f, predicted if i == 0 else None, "setting") for i, f in enumerate(fixes)]
        if len(fixes) > 1:
            fix_objs[0] = Fix(fixes[0] + " (the prediction is for all of these settings)",
                              predicted, "setting")
        # syncless's drop-in for the framework's loop, when it removes every one of these syncs.
        dropins = {(fw.dropin, fw.dropin_fix) for _, fw, _, _ in sites}
        dropin = next(iter(dropins)) if len(dropins) == 1 else ("", "")
        # The setting --verify can apply from outside, when every site's fix is the same one.
        applies = {json.dumps(fw.apply, sort_keys=True) for _, fw, _, _ in sites}
        apply = json.loads(next(iter(applies))) if len(applies) == 1 else None
        if dropin[0]:
            fix_objs.append(Fix(dropin[1], predicted, "dropin"))
        title = f"{name} syncs {count:g}×/step" + (f" ({setting})" if setting else "")
        out.append(Finding("framework", title, step_ms - (predicted or step_ms),
                           "\n".join(lines), fix_objs, sites[0][0].where,
                           {"blocked_ms": total, "per_step": count, "framework": name,
                            "setting": setting, "dropin": dropin[0], "apply": apply}))
    return out


# ---- launches --------------------------------------------------------------------------------

def launch_finding(enqueue_ms: float, gpu_ms: float | None, kernels: float | None,
                   step_ms: float, data_ms: float = 0.0, launch_us: float | None = None,
                   optimizers: Sequence[Any] = (), optimizer_ms: float | None = None,
                   compiled: bool = False, graph_ms: float | None = None,
                   host_ms: float | None = None, syncs: bool = False,
                   model_share: float | None = None) -> Finding | None:
    """Launch-bound: the CPU needs longer to enqueue the step than the GPU needs to run it.
    `host_ms`: the step less its time blocked in syncs. With `syncs` (a sync every step) a graph
    needs them gone first (a graph cannot hold one): the finding wins what the graph adds to
    that, max(host, GPU work) - the graph's time, and its fix predicts the graph's time.
    `model_share`: the share of the step's stack samples inside the model's calls and autograd's
    backward (step_part), what torch.compile(model, mode="reduce-overhead") graphs; the rest of
    the host time stays with that fix (a Lightning autoencoder on an H100: 38% of a 3.9 ms step
    in them, the rest Lightning's loop, self.log and data; compile won 3%, not the 90% a graph of
    everything predicts). None: not sampled, one prediction for every graph."""
    if gpu_ms is None or gpu_ms <= 0 or enqueue_ms <= gpu_ms or step_ms <= 0:
        return None
    if gpu_ms >= 0.9 * step_ms:
        return None            # the GPU is busy: a host blocked by a full launch queue is not slow
    if kernels is not None and kernels < LAUNCH_MIN_KERNELS:
        return None
    per_kernel = f", {gpu_ms * 1e3 / kernels:.0f} µs of GPU work per kernel" if kernels else ""
    count = f"{kernels:.0f} kernels per step" if kernels else "kernels"
    graph = after(step_ms, step_ms, max(graph_ms or gpu_ms, data_ms))
    first = ("once the step's syncs are gone (a graph cannot hold a sync), " if syncs else "")
    host = step_ms if host_ms is None else min(host_ms, step_ms)
    if model_share is None:
        fixes = [Fix(first + "capture the step in a CUDA graph, which replaces every launch with "
                     "one: torch.compile(model, mode=\"reduce-overhead\"), or torch.cuda.graph / "
                     "torch.cuda.make_graphed_callables around the whole step (static inputs, "
                     "capturable=True for the optimizer)", graph, "cuda-graph")]
    else:
        # What stays on the host: its own time outside the model's calls (a sync's wait, in
        # the loop's own lines, goes with the syncs).
        inside = model_share * step_ms
        compiled_step = max(host - inside, graph)
        fixes = [Fix(first + "torch.compile(model, mode=\"reduce-overhead\") puts the model's "
                     f"forward and backward in CUDA graphs: they hold {inside:.2f} ms of the "
                     f"step ({model_share:.0%} of its stack samples); the rest (the optimizer's "
                     "step, the loop's and the framework's Python, data) stays on the host",
                     compiled_step, "cuda-graph"),
                 Fix(first + "a CUDA graph of the whole step replaces every launch with one, the "
                     "optimizer's too: torch.cuda.graph / torch.cuda.make_graphed_callables "
                     "around forward, backward and optimizer.step() (static inputs, "
                     "capturable=True for the optimizer); at best: Python around the graph (a "
                     "framework's loop, logging) still runs",
                     graph, "whole-graph")]
    for opt in optimizers:
        d = getattr(opt, "defaults", {})
        if "fused" in d and not d.get("fused") and d.get("foreach") is False:
            saved = 0.8 * optimizer_ms if optimizer_ms else None
            fixes.append(Fix(f"{type(opt).__name__}(..., fused=True): one kernel per step for the "
                             "optimizer instead of several per parameter (foreach=False now)",
                             after(step_ms, saved, gpu_ms) if saved else None, "optimizer"))
            break
    if not compiled:
        fixes.append(Fix("torch.compile(model) in its default mode only fuses: fewer kernels, but "
                         "each remaining launch still costs the CPU"
                         + (f" ~{launch_us:.1f} µs" if launch_us else "")
                         + "; no prediction (it depends on what fuses)", None, "fusion"))
    fixes.append(Fix("raise the batch size: the same launches do more work each", None, "batch"))
    wins = (max(host, gpu_ms) if syncs else step_ms) - graph
    if wins <= 0:
        return None
    f = Finding("launch-bound", "Launch-bound", wins,
                f"the CPU needs {enqueue_ms:.2f} ms to enqueue a step whose GPU work takes "
                f"{gpu_ms:.2f} ms ({count}{per_kernel}): the GPU waits for launches", fixes)
    return f


def is_minor(f: Finding, step_ms: float) -> bool:
    return step_ms <= 0 or f.cost_ms < MINOR_SHARE * step_ms or math.isnan(f.cost_ms)


def in_framework_words(findings: list[Finding], framework: str, gpu: bool) -> None:
    """Put first, in each finding the framework's loop makes, the line its user writes:
    `TrainingArguments(...)` for the HF Trainer, the `DataLoader`/`torch.compile` argument for a
    Lightning Trainer. The prediction is the fix's it says in other words."""
    if framework not in ("transformers", "lightning"):
        return
    for f in findings:
        first = f.fixes[0] if f.fixes else None
        predicted = getattr(first, "predicted_ms", None)
        text = None
        if f.kind == "starvation":
            n = f.extra.get("workers_needed")
            if framework == "transformers":
                args = ([f"dataloader_num_workers={n}"] if n else []) + \
                    ["dataloader_persistent_workers=True"] + \
                    (["dataloader_pin_memory=True", 'accelerator_config={"non_blocking": True}']
                     if gpu else [])
                text = (f"TrainingArguments({', '.join(args)}): the Trainer makes the DataLoader"
                        + ("" if n else "; no worker count is enough (see below)"))
            else:
                args = ([f"num_workers={n}"] if n else []) + ["persistent_workers=True"] + \
                    (["pin_memory=True"] if gpu else [])
                text = (f"DataLoader(..., {', '.join(args)}) in your train_dataloader() (the "
                        "LightningModule's or the LightningDataModule's)")
        elif f.kind == "launch-bound":
            text = ('TrainingArguments(torch_compile=True, torch_compile_mode="reduce-overhead")'
                    if framework == "transformers" else 'model = torch.compile(model, '
                    'mode="reduce-overhead") before trainer.fit(model)')
            predicted = f.checked_ms
        if text:
            f.fixes.insert(0, Fix(text, predicted, f"{framework}-args"))
