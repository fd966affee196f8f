"""Logger(reduce=...) across real torch.distributed processes: gloo on CPU (CI), NCCL on 2 GPUs."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import syncless
from _gloo import spawn_ranks

STEPS = 23


def _init(rank, world, store_path, backend):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")       # NVLink multicast stays off
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=world)


def _gloo_worker(rank, world, tmp):
    """Both gloo cases in one pair of ranks (each spawn imports torch anew: seconds a rank)."""
    _init(rank, world, os.path.join(tmp, "store"), "gloo")
    try:
        _reduce_case(rank, tmp)
        _mismatch_case(rank, tmp)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    return spawn_ranks(_gloo_worker, tmp_path_factory.mktemp("gloo"))


def _reduce_case(rank, tmp):
    path = os.path.join(tmp, f"rank{rank}.jsonl")
    log = syncless.Logger(every=5, sinks=[syncless.sinks.JSONL(path)],
                          reduce={"loss": "mean", "best": "max", "worst": "min",
                                  "count": "sum"})
    for step in range(STEPS):
        metrics = {"loss": torch.tensor(step + 10.0 * rank),
                   "best": torch.tensor(float(rank * step)),
                   "worst": torch.tensor(float(rank - step)),
                   "count": 1}
        if step % 4 == 0 and rank == 1:
            del metrics["loss"]                      # absent on one rank at these steps
        log.log(metrics)
    log.close()


def test_gloo_two_ranks_reduce_exactly_and_rank0_writes(gloo_run):
    out = gloo_run
    assert not (out / "rank1.jsonl").exists()             # sinks run on rank 0 only
    rows = [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for step, r in enumerate(rows):
        loss = step if step % 4 == 0 else (step + (step + 10.0)) / 2
        assert (r["loss"], r["best"], r["worst"], r["count"]) == \
            (loss, float(step), float(-step), 2.0), step


def _mismatch_case(rank, tmp):
    log = syncless.Logger(every=3, reduce="mean")
    message = "no error"
    try:
        for step in range(6):
            metrics = {"loss": float(step)}
            if rank == 1:
                metrics["extra"] = 1.0
            log.log(metrics)
    except ValueError as exc:
        message = str(exc)
    with open(os.path.join(tmp, f"err{rank}.txt"), "w") as f:
        f.write(message)
    log.sinks = []
    log._host_rows = []
    log.close()


def test_a_rank_with_other_metric_names_gets_a_clear_error_not_a_hang(gloo_run):
    out = gloo_run
    for rank in (0, 1):
        text = (out / f"err{rank}.txt").read_text()
        assert "every rank must log the same metric names" in text, text
        assert "extra" in text


def test_reduce_without_distributed_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        syncless.Logger(reduce="mean")
    with pytest.raises(ValueError, match="sinks_on"):
        syncless.Logger(sinks_on="some")


def _nccl_worker(rank, world, tmp, steps):
    _init(rank, world, os.path.join(tmp, "store"), "nccl")
    torch.cuda.set_device(rank)
    try:
        torch.manual_seed(rank)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).cuda(), device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(steps, 32, 64, device="cuda")
        y = torch.randint(0, 10, (steps, 32), device="cuda")
        rows = []
        log = syncless.Logger(every=100, reduce="mean", device="cuda",
                              sinks=[syncless.sinks.Callback(lambda s, t, v: rows.append((s, v)))])
        kept = []
        for _ in range(3):                                   # warm-up outside the check
            model(x[0]).sum().backward()
        opt.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for step in range(steps):
            logits = model(x[step])
            loss = torch.nn.functional.cross_entropy(logits, y[step])
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            acc = (logits.argmax(1) == y[step]).float().mean()
            conf = logits.softmax(1).amax(1).mean()
            log(loss=loss, acc=acc, grad_norm=gn, conf=conf)
            kept.append(torch.stack([loss, acc, gn, conf]).double())
        torch.cuda.set_sync_debug_mode(0)
        log.close()
        ref = torch.stack(kept)
        dist.all_reduce(ref)
        ref = (ref / world).cpu().tolist()
        if rank == 0:
            got = [[v["loss"], v["acc"], v["grad_norm"], v["conf"]] for _, v in rows]
            with open(os.path.join(tmp, "nccl.json"), "w") as f:
                json.dump({"steps": [s for s, _ in rows], "got": got, "ref": ref}, f)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_ddp_1000_steps_reduced_exactly_with_zero_syncs(tmp_path):
    steps = 1000
    mp.start_processes(_nccl_worker, args=(2, str(tmp_path), steps), nprocs=2,
                       start_method="spawn")
    out = json.loads((tmp_path / "nccl.json").read_text())
    assert out["steps"] == list(range(steps))
    assert out["got"] == out["ref"]
