"""The doctor's cost model (CPU): what a sync, a data wait and the launches cost a step, from the
host's blocked time, the GPU work and the GPU idle the syncs cause, as a trace measures them.

The numbers in the assess() cases are those the doctor measured on the H200 corpus
(benchmarks/results/doctor_corpus.json), so each case is a real step's measurements."""
import json
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from syncless.doctor import Audit, doctor
from syncless.doctor._frames import caller_site
from syncless.doctor._sampler import StackSampler
from syncless.doctor.audit import SYNC
from syncless.doctor.diagnose import KernelTime, Measured, assess, trace_gpu
from syncless.doctor.monitor import MonitorSummary


def cupti_audit(sites, steps=4, kernels_per_step=0):
    """An Audit as the CUPTI path leaves it: `sites` are (Site, call, kind, ns per call, calls
    per step), the Sites real lines of this file."""
    a = Audit(steps=steps)
    a.backend = "cupti"
    a.elapsed_s = 0.01
    a.kernels = kernels_per_step * steps
    for site, name, kind, ns, per_step in sites:
        for _ in range(steps * per_step):
            a._add(a.sites, site, name, kind, ns, True)
    return a


def summary(step_ms, data_ms=0.0, cpu_ms=None):
    cpu = step_ms - data_ms if cpu_ms is None else cpu_ms
    return MonitorSummary(15, data_ms, cpu, step_ms, None, 0, None, 0.0,
                          {"num_workers": 0, "pin_memory": True, "persistent_workers": False,
                           "prefetch_factor": None})


def item_site():
    return caller_site(0)._replace(code="total_loss += loss.item()")


# ---- the trace ----------------------------------------------------------------------------------

def test_trace_counts_the_idle_after_a_sync_until_the_host_leads_again(tmp_path):
    def k(ts, dur, c):
        return {"cat": "kernel", "ts": ts, "dur": dur, "name": "k", "args": {"correlation": c}}

    def launch(ts, c):
        return {"cat": "cuda_runtime", "ts": ts, "dur": 4, "name": "cudaLaunchKernel",
                "args": {"correlation": c}}

    def sync(ts, dur):
        return {"cat": "cuda_runtime", "ts": ts, "dur": dur, "name": "cudaStreamSynchronize"}

    events = [
        # step 1: two kernels, a sync that returns at 202 (the GPU was done at 201), then three
        # kernels each launched after the GPU ran dry (lockstep), then one queued long before the
        # GPU reached it (launched at 600, run at 812): from there the host leads
        launch(-10, 1), k(0, 100, 1), launch(50, 2), k(101, 100, 2), sync(50, 152),
        launch(390, 3), k(400, 50, 3), launch(455, 4), k(460, 50, 4),
        launch(505, 5), k(512, 300, 5), launch(600, 6), k(812, 100, 6),
        launch(1150, 7), k(1200, 100, 7),
        # step 2: an .item(): its copy to pageable memory waits inside cudaMemcpyAsync for the
        # GPU (returning at 1305), the stream sync after it returns at 1310; two lockstep
        # kernels; then the final drain
        {"cat": "cuda_runtime", "ts": 1000, "dur": 305, "name": "cudaMemcpyAsync",
         "args": {"correlation": 50}},
        {"cat": "gpu_memcpy", "ts": 1300, "dur": 2, "name": "Memcpy DtoH (Device -> Pageable)",
         "args": {"correlation": 50}},
        sync(1306, 4), launch(1490, 8), k(1500, 100, 8), launch(1602, 9), k(1605, 50, 9),
        sync(1655, 10)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    t = trace_gpu(str(tmp_path / "t.json"), 2)
    assert t.busy_ms == pytest.approx(0.955 / 2)
    assert t.syncs == 1.0, "the copy and its stream sync hold the GPU up once; the drain after " \
        "the last kernel is no step's sync"
    assert t.blocked_ms == pytest.approx((0.152 + 0.305 + 0.004) / 2)
    assert t.sync_bubble_ms == pytest.approx((0.199 + 0.198) / 2)
    # after the first sync: 202 -> 400 and 450 -> 460 (the 2 µs before 512 is the GPU's own gap);
    # the kernel at 812 was queued ahead, so the 912 -> 1200 gap is the host's, not the sync's;
    # after the second: 1310 -> 1500 and 1600 -> 1605
    assert t.sync_idle_ms == pytest.approx((0.198 + 0.010 + 0.190 + 0.005) / 2)


def test_trace_tells_the_gpus_own_gaps_from_its_waits_for_launches(tmp_path):
    def k(ts, dur, c):
        return {"cat": "kernel", "ts": ts, "dur": dur, "name": "k", "args": {"correlation": c}}

    def launch(ts, c, tid=1):
        return {"cat": "cuda_runtime", "ts": ts, "dur": 4, "name": "cudaLaunchKernel",
                "tid": tid, "args": {"correlation": c}}

    events = [
        # four kernels all launched long before the GPU reached them, 5 µs apart on the GPU
        # (the GPU's own gaps, with work queued), then two launched after the GPU ran dry (20
        # and 30 µs of waiting for the host), the last one from the autograd thread
        launch(0, 1), launch(5, 2), launch(10, 3), launch(15, 4),
        k(100, 50, 1), k(155, 50, 2), k(210, 50, 3), k(265, 50, 4),
        launch(320, 5), k(335, 50, 5), launch(405, 6, tid=2), k(415, 50, 6),
        {"cat": "cuda_runtime", "ts": 470, "dur": 12, "name": "cudaStreamSynchronize",
         "tid": 1}]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    t = trace_gpu(str(tmp_path / "t.json"), 1)
    assert t.busy_ms == pytest.approx(0.300)
    assert t.queued_gap_ms == pytest.approx(0.015), "three 5 µs gaps with the next kernel queued"
    assert t.launch_wait_ms == pytest.approx(0.020 + 0.030)
    assert t.queued_ops == pytest.approx(3 / 5)
    assert t.calls["cudaLaunchKernel"] == [6, 4.0]
    assert t.blocked_threads == {"1": pytest.approx(0.012)}


# ---- syncs --------------------------------------------------------------------------------------

def test_a_sync_in_a_host_bound_step_wins_no_more_than_it_blocks():
    # lstm_lm as first sized: 7.32 ms steps, the host busy 7.23 ms of them with 386 launches,
    # 6.01 ms of kernels, a loss.item() every step that blocks 0.006 ms (the GPU is done by then),
    # then 1.6 ms of GPU idle while the host encodes the next batch. The probe read 7.18 ms: its
    # queue empties at the .item(), so it times the host's work after it too.
    a = cupti_audit([(item_site(), "cudaStreamSynchronize", SYNC, 6_000, 1)], kernels_per_step=386)
    d = assess(Measured(summary(7.32, cpu_ms=7.23), a, 2, 7.32, True, 8.0, 7.18, 3,
               kernel_time=KernelTime(6.01, 1.6, 1.0, 0.006, 1.6), launch_us=7.5))
    assert (d.gpu_work_ms, d.gpu_work_source) == (6.01, "kernel trace"), \
        "a sync every step: the trace's kernel time, not the probe"
    sync = d.finding("sync")
    assert sync in d.minor and sync.cost_ms == pytest.approx(0.006), \
        "the host still does its 7.3 ms without the sync"
    assert d.findings[0].kind == "launch-bound"
    assert d.verdict_kind == "CPU-bound" and "kernel launches" in d.verdict
    assert d.host_ms == pytest.approx(7.314)


def test_a_sync_costs_the_idle_it_causes_when_the_host_could_run_ahead():
    # lightning_pbar: 18.65 ms steps, 0.37 ms of them data wait, 16.49 ms of kernels, the
    # progress bar's .item() blocking 2.3 ms a step (in the trace; the audit's slowed host saw
    # 0.015 ms), and the GPU idle 2.1 ms from its returns until the host led again. Without it the
    # host's 16.35 ms hide behind the GPU: the step goes to ~16.5 ms (its twin measured 16.67).
    a = cupti_audit([(item_site(), "cudaStreamSynchronize", SYNC, 7_500, 2)], kernels_per_step=407)
    d = assess(Measured(summary(18.65, 0.37, 18.07), a, 2, 18.65, True, 20.0, 18.0, 3,
               kernel_time=KernelTime(16.49, 1.48, 2.0, 2.3, 2.1), launch_us=8.2))
    assert d.gpu_work_source == "kernel trace" and d.sync_ms == 2.3
    top = d.findings[0]
    assert top.kind == "sync" and top.cost_ms == pytest.approx(2.1)
    assert top.fixes[0].predicted_ms == pytest.approx(16.55)
    assert d.verdict_kind == "CPU-bound" and "a sync leaves the GPU idle" in d.verdict
    data = d.finding("starvation")
    assert data in d.minor and data.cost_ms == pytest.approx(0.0), \
        "the host's 16.35 ms (data wait in) are shorter than the GPU's: the wait costs nothing"
    assert d.finding("launch-bound") is None, "the host enqueues faster than the GPU runs"


def test_syncs_share_what_removing_them_wins_by_their_blocked_time():
    # hf_trainer: two syncs a step in the Trainer block 4.84 ms, one in the masking code 0.008
    # ms; the step is 21.77 ms with 17.46 ms of kernels. Removing every sync wins the GPU idle
    # they cause (4.3 ms): the Trainer's syncs get nearly all of it.
    trainer = item_site()._replace(code="tr_loss_step = ...")
    masking = caller_site(0)._replace(code="trainer.train()")
    a = cupti_audit([(trainer, "cudaStreamSynchronize", SYNC, 2_420_000, 2),
                     (masking, "cudaStreamSynchronize", SYNC, 8_000, 1)], kernels_per_step=466)
    d = assess(Measured(summary(21.77, 0.30, 21.41), a, 2, 21.77, True, 23.3, 22.3, 3,
               kernel_time=KernelTime(17.46, 0.75, 3.0, 4.9, 4.5), launch_us=10.9))
    costs = {f.where: f.cost_ms for f in d.findings + d.minor if f.kind == "sync"}
    first = d.findings[0]
    assert first.kind == "sync" and first.extra["per_step"] == 2
    assert first.cost_ms == pytest.approx(4.31 * 4.84 / 4.848, rel=1e-3)
    assert len(costs) == 2 and min(costs.values()) < 0.01
    assert d.verdict_kind == "CPU-bound"
    assert d.finding("starvation") in d.minor


def trainer_syncs(nan_ns: int, copy_ns: int, mask_ns: int):
    """The HF Trainer's five syncs a step (ns blocked per call under the audit): the NaN filter's
    two, the blocking batch copy's two, transformers' mask check's one; 441 kernels a step."""
    nan = item_site()._replace(code="torch.isnan(loss) or torch.isinf(loss)")
    copy = nan._replace(line=nan.line + 1, code="batch = batch.to(device)")
    mask = nan._replace(line=nan.line + 2, code="(packed[:, -1] == 0).all()")
    a = cupti_audit([(nan, "cudaStreamSynchronize", SYNC, nan_ns, 2),
                     (copy, "cudaStreamSynchronize", SYNC, copy_ns, 2),
                     (mask, "cudaStreamSynchronize", SYNC, mask_ns, 1)], kernels_per_step=441)
    return nan, copy, mask, a


def test_with_the_host_well_ahead_each_sync_of_the_step_wins_its_share_of_the_gpu_idle():
    # hf_trainer on the H200, 48 sequences: 54.60 ms steps with 48.71 ms of kernels; the host's
    # own work 18.73 ms. Five syncs a step: the NaN filter's two block 30 ms (the first to find
    # the queue full), the batch copy's two and the mask check's one almost nothing. The trace
    # saw 3.90 ms of GPU idle right after them, but the twin without the filter and the blocking
    # copy (4 of the 5) measured 49.29 ms: a gain of 5.31 ms, where the blocked-share rule had
    # promised 3.89 for the filter and 0.008 for the copy.
    nan, copy, mask, a = trainer_syncs(15_000_000, 11_000, 9_000)
    trace = KernelTime(48.71, 1.142, 5.0, 31.37, 3.903, queued_gap_ms=0.0095,
                       launch_wait_ms=5.32, queued_ops=0.919)
    d = assess(Measured(summary(54.60, 0.62, 53.91), a, 5, 54.60, True, 54.55, None, 0,
               kernel_time=trace, launch_us=8.7))
    assert d.host_leads and d.sync_ms == pytest.approx(31.37)
    assert d.sync_cost_ms == pytest.approx(54.60 - 48.71), "the whole GPU idle, not 3.90"
    wins = {f.where: f.cost_ms for f in d.findings + d.minor if f.kind == "sync"}
    assert wins[nan.where] == pytest.approx(5.89 * 2 / 5) == wins[copy.where]
    assert wins[mask.where] == pytest.approx(5.89 / 5)
    assert {f.kind for f in d.minor} == {"starvation"}
    after = 54.60 - wins[nan.where] - wins[copy.where]
    assert after == pytest.approx(49.89, abs=0.005), "the twin measured 49.29"
    assert "each of the 5 syncs/step costs about 1/5 of that" in d.report()


def test_a_step_on_the_gpu_bound_line_says_what_its_findings_still_win():
    # hf_trainer on the H200 in a later run: 52.44 ms steps with 48.56 ms of kernels (93%), the
    # host's own work 13.79 ms, the same five syncs. GPU-bound by the 90% line, yet removing 4
    # of the 5 syncs won 3.33 ms (the twin: 49.11 ms): the verdict must not say that only the
    # model's own GPU work is left.
    nan, copy, mask, a = trainer_syncs(17_800_000, 9_000, 7_000)
    trace = KernelTime(48.56, 0.888, 5.0, 37.48, 2.956, queued_gap_ms=0.008,
                       launch_wait_ms=4.08, queued_ops=0.924)
    d = assess(Measured(summary(52.44, 0.42, 51.99), a, 5, 52.44, True, 52.42, None, 0,
               kernel_time=trace, launch_us=7.6))
    assert d.verdict_kind == "GPU-bound" and d.host_leads
    wins = {f.where: f.cost_ms for f in d.findings + d.minor if f.kind == "sync"}
    idle = 52.44 - 48.56
    assert wins[nan.where] == pytest.approx(idle * 2 / 5) == wins[copy.where]
    assert 52.44 - wins[nan.where] - wins[copy.where] == pytest.approx(49.34, abs=0.005)
    assert d.verdict == ("GPU-bound: the GPU works 93% of the step; of the other 7%, the first "
                         f"finding below wins back {idle * 2 / 5:.2f} ms; beyond that, speedups "
                         "come from the model's own GPU work")


def test_with_the_host_near_the_gpu_s_pace_the_syncs_share_by_what_they_block():
    # The same Trainer at 16 sequences (H200): 17.41 ms of kernels, the host's own work 13.9 ms
    # by the step less its blocked time, an upper bound of what it takes without them (it ran
    # ~17 ms there in a profile): not clearly ahead, so the syncs share the idle the trace saw
    # them cause by what they block, and the ones that find the queue empty win nothing.
    nan = item_site()._replace(code="torch.isnan(loss) or torch.isinf(loss)")
    mask = nan._replace(line=nan.line + 2, code="(packed[:, -1] == 0).all()")
    a = cupti_audit([(nan, "cudaStreamSynchronize", SYNC, 4_000_000, 2),
                     (mask, "cudaStreamSynchronize", SYNC, 9_000, 1)], kernels_per_step=466)
    d = assess(Measured(summary(22.09, 0.30, 21.71), a, 2, 22.09, True, 21.8, 24.0, 3,
               kernel_time=KernelTime(17.41, 0.75, 3.0, 8.17, 3.405), launch_us=10.9))
    assert not d.host_leads and d.sync_cost_ms == pytest.approx(3.405)
    wins = {f.where: f.cost_ms for f in d.findings + d.minor if f.kind == "sync"}
    assert wins[mask.where] < 0.01 and wins[nan.where] == pytest.approx(3.405, rel=0.01)


def test_no_syncs_and_the_gpu_busy_the_whole_step_leave_nothing_to_find():
    a = cupti_audit([], kernels_per_step=300)
    d = assess(Measured(summary(17.0, 0.25, 14.0), a, 2, 17.0, True, 16.9, 16.6, 3,
               kernel_time=KernelTime(16.5, None, 0.0), launch_us=8.0))
    assert d.verdict_kind == "GPU-bound" and d.findings == [], d.report()
    assert d.sync_cost_ms == 0.0


def test_a_gpu_whose_queue_never_ran_dry_is_the_step_and_the_data_wait_costs_nothing():
    # lightning_pbar's twin (prog_bar=False) on the H200: 30.18 ms steps, 3.47 ms of them the
    # training thread encoding the next batch while the GPU runs 29.97 ms of kernels (the probe:
    # 29.84). In the trace 99.7% of the kernels were queued before the GPU got to them and the
    # GPU waited for launches 0.23 ms a step: the GPU is the step. Taking the kernels' 29.84 ms
    # would leave the host "0.34 ms slower" and blame the data wait for it.
    a = cupti_audit([], kernels_per_step=388)
    trace = KernelTime(29.972, 0.0, 0.0, 0.0, 0.0, queued_gap_ms=0.004, launch_wait_ms=0.234,
                       queued_ops=0.997)
    d = assess(Measured(summary(30.18, 3.465, 22.44), a, 5, 30.18, True, 30.13, 29.84, 3,
               kernel_time=trace, launch_us=13.0))
    assert (d.gpu_work_ms, d.gpu_work_source) == (30.18, "queue never ran dry")
    assert d.verdict_kind == "GPU-bound" and d.findings == [], d.report()
    assert d.finding("starvation").cost_ms == 0.0
    # The same step whose GPU waited for launches 1.5 ms a step (5%): the kernels are its work,
    # and the host's time (data wait in) is the longer side by the difference.
    waiting = KernelTime(29.972, 0.0, 0.0, 0.0, 0.0, queued_gap_ms=0.004, launch_wait_ms=1.5,
                         queued_ops=0.9)
    d = assess(Measured(summary(30.18, 3.465, 22.44), a, 5, 30.18, True, 30.13, 29.84, 3,
               kernel_time=waiting, launch_us=13.0))
    assert (d.gpu_work_ms, d.gpu_work_source) == (29.84, "queue full")
    assert d.finding("starvation").cost_ms == pytest.approx(0.34)


def test_a_progress_bar_sync_in_a_gpu_bound_step_costs_the_idle_after_it():
    # lightning_pbar (prog_bar=True) on the H200: 36.46 ms steps, 4.57 ms of them encoding the
    # next batch, 29.87 ms of kernels; 31% of the monitored steps' stack samples sat in the
    # progress bar's .item() (11.4 ms/step: the host waits for the GPU there), and the trace
    # saw the GPU idle 6.35 ms a step from its returns until the host led again: the batch is
    # encoded while the GPU has nothing to run. The twin measured 30.18 ms.
    bar = item_site()._replace(code="trainer.fit(model, loader)",
                               via="lightning/fabric/utilities/apply_func.py:134")
    a = cupti_audit([(bar, "cudaStreamSynchronize", SYNC, 2_100_000, 2)], kernels_per_step=388)
    sampler = StackSampler()
    sampler.counts.update({(bar.file, bar.line, bar.via): 314, (bar.file, bar.line + 1, ""): 686})
    sampler.total = 1000
    trace = KernelTime(29.87, 5.916, 2.0, 3.985, 6.348, queued_gap_ms=0.008,
                       launch_wait_ms=8.282, queued_ops=0.97)
    d = assess(Measured(summary(36.46, 4.567, 31.26), a, 5, 36.46, True, 36.42, 36.93, 3,
               kernel_time=trace, launch_us=13.3, sampler=sampler))
    assert d.gpu_work_source == "kernel trace" and d.sync_ms == pytest.approx(36.46 * 0.314)
    top = d.findings[0]
    assert top.kind == "sync" and top.cost_ms == pytest.approx(6.348)
    assert top.fixes[0].predicted_ms == pytest.approx(36.46 - 6.348)
    assert d.finding("starvation") in d.minor and d.finding("starvation").cost_ms == 0.0, \
        "the host's 25 ms, the encoding in, hide behind the GPU's 29.9 once the sync is gone"
    assert d.finding("launch-bound") is None


# ---- sleep-based loops: the host side measured, the GPU side given ------------------------------

class Sleepy(Dataset):
    # 50 ms a batch against a ~5-ms step body: data-bound by 10x whatever the host's load (at
    # 20 ms a 2-core host under the whole suite read a 6.8-ms body, at the test's 3x bound).
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.ones(4)


def test_a_data_wait_costs_the_step_only_when_the_host_is_the_slower_side():
    model = nn.Linear(4, 4)

    def step(batch):
        model(batch).sum().backward()
        time.sleep(0.005)

    d = doctor(step, steps=5, warmup=1, loader=DataLoader(Sleepy(), batch_size=1), file=None)
    s = d.step_ms                                  # ~55 ms: 50 ms data wait, 5 ms body
    assert d.summary.data_ms > 3 * d.summary.cpu_ms, d.report()
    cpu = d.summary

    def with_gpu(gpu_ms):
        return assess(Measured(cpu, d.audit, 1, s, True, gpu_ms, gpu_ms, 3,
                      kernel_time=KernelTime(gpu_ms, None, 0.0)))

    # A GPU that needs a tenth of the step: the loader is the bottleneck, its fix the top one.
    fast = with_gpu(0.1 * s)
    assert fast.verdict_kind == "data-bound" and fast.findings[0].kind == "starvation"
    assert fast.findings[0].fixes[0].predicted_ms == pytest.approx(
        max(s - cpu.data_ms, 0.1 * s))
    # A GPU busy 95% of the step: the wait overlaps the GPU's work; at most 5% to win.
    slow = with_gpu(0.95 * s)
    assert slow.verdict_kind == "GPU-bound"
    assert slow.finding("starvation").cost_ms == pytest.approx(0.05 * s)


def test_a_data_wait_behind_a_gpu_whose_queue_never_ran_dry_costs_nothing():
    # A step that waits 50 ms for data and works 5 ms, measured; a GPU given 97% of the step.
    # Traced with its queue never dry (0.1% of the step waiting for launches), the GPU is the
    # step: the data wait hides behind it. Traced waiting 10% of the step for launches, the
    # kernels are its work, and the host (data wait in) is the longer side by the difference.
    model = nn.Linear(4, 4)

    def step(batch):
        model(batch).sum().backward()
        time.sleep(0.005)

    d = doctor(step, steps=5, warmup=1, loader=DataLoader(Sleepy(), batch_size=1), file=None)
    s, cpu = d.step_ms, d.summary
    assert cpu.data_ms > 3 * cpu.cpu_ms, d.report()

    def traced(wait_share):
        t = KernelTime(0.97 * s, 0.0, 0.0, 0.0, 0.0, queued_gap_ms=0.0,
                       launch_wait_ms=wait_share * s, queued_ops=1.0 - wait_share)
        return assess(Measured(cpu, d.audit, 1, s, True, s, 0.97 * s, 3, kernel_time=t))

    dry = traced(0.001)
    assert (dry.gpu_work_ms, dry.gpu_work_source) == (s, "queue never ran dry")
    assert dry.verdict_kind == "GPU-bound" and dry.findings == []
    assert dry.finding("starvation").cost_ms == 0.0
    waiting = traced(0.10)
    assert waiting.gpu_work_source == "queue full"
    assert waiting.finding("starvation").cost_ms == pytest.approx(0.03 * s)


def test_the_monitored_steps_stack_samples_time_a_sync_the_audit_saw_barely_block():
    # lstm_lm resized (batch 512, hidden 1536) on the H200: 18.17 ms steps, 17.61 ms of host
    # body, 13.45 ms of kernels; the .item() blocked 4.4 ms/step under the audit and 1.4 ms in the
    # trace (both slow the host), while 40 of the monitored steps' 102 stack samples sat on its
    # line: 7.1 ms/step, which leaves the host 11.1 ms of its own (its twin measured 11.2 ms).
    site = item_site()
    a = cupti_audit([(site, "cudaStreamSynchronize", SYNC, 4_360_000, 1)], kernels_per_step=387)
    sampler = StackSampler()
    sampler.counts[(site.file, site.line, site.via)] = 40
    sampler.counts[(site.file, site.line + 1, "")] = 62
    sampler.total = 102
    d = assess(Measured(summary(18.17, cpu_ms=17.61), a, 2, 18.17, True, 95.0, 17.69, 3,
               kernel_time=KernelTime(13.45, 3.94, 1.0, 1.384, 4.65), launch_us=8.5,
               sampler=sampler))
    assert d.sync_ms_source == "stack samples"
    assert d.sync_ms == pytest.approx(18.17 * 40 / 102)
    assert d.finding("launch-bound") is None, \
        "11.1 ms of the host's own work enqueue faster than the GPU's 13.45 ms run"
    top = d.findings[0]
    assert top.kind == "sync" and top.cost_ms == pytest.approx(4.65)
    assert top.fixes[0].predicted_ms == pytest.approx(13.52)
    assert d.verdict_kind == "CPU-bound" and "a sync leaves the GPU idle" in d.verdict
    assert "syncs (blocked)" in d.report() and "(stack samples)" in d.report()


def test_syncs_share_the_win_by_the_monitored_samples_when_the_audit_saw_none_block():
    # hf_trainer in a second H200 run: under the audit every sync blocked ~0.01-0.02 ms (the
    # audited host is slow), but 36 of the monitored steps' 100 samples sat at the Trainer's
    # NaN check and 1 at the masking code's: the Trainer's syncs get nearly all of the 3.4 ms
    # that removing every sync wins (the GPU idle the trace saw them cause).
    trainer = item_site()._replace(code="tr_loss_step = ...", via="transformers/trainer.py:1847")
    masking = item_site()._replace(line=trainer.line + 2, code="trainer.train()",
                                   via="transformers/masking_utils.py:755")
    a = cupti_audit([(trainer, "cudaStreamSynchronize", SYNC, 10_000, 2),
                     (masking, "cudaStreamSynchronize", SYNC, 9_000, 1)], kernels_per_step=466)
    sampler = StackSampler()
    sampler.counts.update({(trainer.file, trainer.line, trainer.via): 36,
                           (masking.file, masking.line, masking.via): 1,
                           (masking.file, masking.line + 1, ""): 63})   # other host work
    sampler.total = 100
    d = assess(Measured(summary(22.09, 0.30, 21.71), a, 2, 22.09, True, 21.8, 24.0, 3,
               kernel_time=KernelTime(17.41, 0.75, 5.0, 0.043, 3.405), launch_us=10.9,
               sampler=sampler))
    assert d.sync_ms == pytest.approx(22.09 * 0.37) and d.sync_ms_source == "stack samples"
    first = d.findings[0]
    assert first.extra["per_step"] == 2 and first.cost_ms == pytest.approx(3.405 * 36 / 37)
    assert d.finding("launch-bound") is None
    assert d.verdict_kind == "CPU-bound"


def test_a_graph_of_a_step_that_syncs_wins_only_what_it_adds_to_removing_the_syncs():
    # hf_trainer's second H200 run: 18 of 100 samples at the Trainer's NaN check (4.0 ms/step
    # blocked) leave the host 18.1 ms of its own, a little over the 17.41 ms of kernels. A CUDA
    # graph cannot hold the syncs: it wins only what it adds once they are gone.
    trainer = item_site()._replace(code="tr_loss_step = ...", via="transformers/trainer.py:1847")
    a = cupti_audit([(trainer, "cudaStreamSynchronize", SYNC, 10_000, 2)], kernels_per_step=466)
    sampler = StackSampler()
    sampler.counts.update({(trainer.file, trainer.line, trainer.via): 18,
                           (trainer.file, trainer.line + 1, ""): 82})
    sampler.total = 100
    d = assess(Measured(summary(22.09, 0.30, 21.71), a, 2, 22.09, True, 21.8, 24.0, 3,
               kernel_time=KernelTime(17.41, 0.75, 5.0, 0.043, 3.405), launch_us=10.9,
               sampler=sampler))
    sync, launch = d.findings[0], d.finding("launch-bound")
    assert sync.kind == "sync" and sync.cost_ms == pytest.approx(3.405)
    # the host is the slower side by 0.7 ms: the data wait's 0.3 ms count, as a minor-ish third
    assert d.finding("starvation").cost_ms == pytest.approx(0.30, abs=1e-6)
    graph = 17.41          # at most the GPU work: the kernel trace's time here
    assert launch.kind == "launch-bound"
    assert launch.cost_ms == pytest.approx(22.09 - 0.18 * 22.09 - graph)
    assert launch.fixes[0].startswith("once the step's syncs are gone (a graph cannot hold")
    assert launch.fixes[0].predicted_ms == pytest.approx(graph)
    assert d.verdict_kind == "CPU-bound" and "a sync leaves the GPU idle" in d.verdict


def test_probed_steps_a_sync_held_say_the_sync_not_a_slow_batch():
    # On an H100, 5 of 7 public scripts (1-7 syncs a step) got "took the host longer than the
    # GPU sleep (a slow batch?)" for every probed step: a sync waits out the sleep itself.
    from syncless.doctor._frames import Site
    from syncless.doctor._session import ScriptSession
    from syncless.doctor._session_report import _notes
    from syncless.doctor.audit import SyncSite
    from syncless.doctor.diagnose import QueueProbe

    def notes(syncs):
        s = ScriptSession()
        probe = s.probing.probe = QueueProbe(10.0)
        probe.uncovered = 3
        if syncs:
            s.audit.sites[("k",)] = SyncSite(Site("train.py", 9, "<module>", "x.item()", ""),
                                             {"cudaStreamSynchronize": 2 * syncs}, 2 * syncs)
            s.audit.steps = 2
        return [n for n in _notes(s) if "probed" in n]

    assert notes(7) == ["3 of the probed steps were not timed with the GPU's queue full: the "
                        "step syncs 7×, and a sync waits out the GPU sleep that holds the "
                        "step's kernels back; the GPU work is the kernel trace's"]
    assert notes(0) == ["3 of the probed steps were not timed with the GPU's queue full: they "
                        "took the host longer than the GPU sleep that held their kernels back "
                        "(a slow batch?); the GPU work is the kernel trace's"]


def test_a_probed_step_that_outlasted_its_sleep_is_not_timed():
    from syncless.doctor.diagnose import QueueProbe, covered
    # resnet_decode on a loaded H200 host: 84.8 ms steps, one worker batch in 170 ms: a probed
    # step that waited 160 ms for data outlasted its 171.6 ms sleep's cover (less the margin).
    cover = QueueProbe(84.8).cover_ms
    assert cover == pytest.approx(171.6)
    assert covered(84.8, cover) and not covered(160.0, cover)


# ---- a launch-bound step: what a graph of the model takes over ----------------------------------

def _lightning_step(model_samples):
    # A Lightning autoencoder at batch 1 on an H100: 3.93 ms steps, 0.40 ms of them waiting for
    # data, 34 kernels of 0.19 ms in all, a launch 11.9 µs; 51 stack samples, 19 in the model's
    # forward and backward (the rest Lightning's loop, self.log, Adam, the main-thread loader).
    # compile(mode="reduce-overhead") measured 4.04 -> 3.92 ms there: the graph of everything
    # predicted 0.40 ms.
    a = cupti_audit([], kernels_per_step=34)
    sampler = StackSampler()
    sampler.total = 51
    if model_samples is not None:
        sampler.parts.update({"model": model_samples, "optimizer": 9,
                              "other": 51 - model_samples - 9})
        sampler.counts.update({None: 51})
    return assess(Measured(summary(3.93, 0.398, 3.49), a, 3, 3.93, True, 3.9, 0.189, 3,
                           launch_us=11.9, sampler=sampler if model_samples is not None
                           else None))


def test_compile_keeps_the_host_time_outside_the_model_and_the_verdict_says_whose_it_is():
    d = _lightning_step(19)
    f = d.findings[0]
    assert f.kind == "launch-bound" and d.model_share == pytest.approx(19 / 51)
    compile_fix = next(x for x in f.fixes if x.tag == "cuda-graph")
    # What stays: the step outside the model's 37% (data wait, Lightning's Python, Adam).
    assert compile_fix.predicted_ms == pytest.approx(3.93 * (1 - 19 / 51))
    assert "they hold 1.46 ms of the step (37% of its stack samples)" in compile_fix
    assert f.checked_ms == compile_fix.predicted_ms, "--verify compares compile's prediction"
    whole = next(x for x in f.fixes if x.tag == "whole-graph")
    assert whole.predicted_ms == pytest.approx(0.398) and f.predicted_ms == whole.predicted_ms
    assert f.cost_ms == pytest.approx(3.93 - 0.398), "ranked by the best graph's win"
    assert d.verdict.startswith("CPU-bound (host work outside the model: 37% of the step's "
                                "stack samples are in the model's forward and backward"), d.verdict
    assert d.as_dict()["findings"][0]["checked_ms"] == pytest.approx(compile_fix.predicted_ms)


def test_a_step_mostly_in_the_model_stays_launch_bound():
    d = _lightning_step(40)                  # 78% of the samples in the model
    f = d.findings[0]
    assert d.verdict.startswith("CPU-bound (kernel launches"), d.verdict
    assert f.checked_ms == pytest.approx(max(0.398, 3.93 * (1 - 40 / 51)))
    unsampled = _lightning_step(None)        # no samples: one prediction, the graph of all
    assert unsampled.model_share is None and unsampled.verdict.startswith(
        "CPU-bound (kernel launches")
    assert [x.tag for x in unsampled.findings[0].fixes][:1] == ["cuda-graph"]
    assert unsampled.findings[0].checked_ms == pytest.approx(0.398)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(0.01)                     # the model's forward: 10 ms a step
        return self.lin(x)


def test_the_sampler_tells_the_models_time_from_the_optimizers_and_the_loops():
    import threading
    net = _Net()
    opt = torch.optim.Adam(net.parameters())

    def closure():                           # a training step's own lines, run by step()
        time.sleep(0.005)                    # (Lightning's): not the optimizer's work
        return None

    sampler = StackSampler(threading.get_ident(), 0.001)
    sampler.start()
    for _ in range(25):
        net(torch.randn(2, 4)).sum().backward()
        opt.step(closure)
        time.sleep(0.01)                     # the loop's own Python: 10 ms a step
    sampler.stop()
    assert sampler.total >= 100
    # 10 ms in the model, 15 ms outside it, per step (sleeps: exact on any load).
    assert sampler.share("model") == pytest.approx(0.4, abs=0.1)
    assert sampler.share("other") == pytest.approx(0.6, abs=0.1)
    assert sampler.share("optimizer") < 0.1
