"""--verify: settings applied from outside the script, measured in fresh paired runs."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from syncless.doctor import _verify, cli


def test_the_95_interval_of_paired_differences():
    mean, low, high = _verify.ci95([-5.0, -6.0, -4.0])
    assert mean == -5.0
    assert (low, high) == pytest.approx((-5.0 - 4.303 / 3 ** 0.5, -5.0 + 4.303 / 3 ** 0.5))
    assert _verify.ci95([-1.0]) == (-1.0, float("-inf"), float("inf")), "one pair says nothing"


def test_worker_sweep_counts():
    assert _verify.worker_candidates(0, None, 2) == [0, 1, 2]
    assert _verify.worker_candidates(2, 12, 16) == [1, 2, 4, 8, 12, 16]


MEASURED = """
    import json, torch
    from torch.utils.data import DataLoader, TensorDataset
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, num_workers=0)
    with open("settings.json", "w") as f:
        json.dump({"num_workers": loader.num_workers,
                   "persistent_workers": loader.persistent_workers}, f)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(100):
        for (x,) in loader:
            opt.zero_grad(); model(x).sum().backward(); opt.step()
"""


def test_measure_applies_loader_settings_from_outside_and_times_plain_steps(tmp_path,
                                                                              monkeypatch):
    from torch.utils.data import DataLoader
    init = DataLoader.__init__
    (tmp_path / "train.py").write_text(textwrap.dedent(MEASURED))
    monkeypatch.chdir(tmp_path)
    apply = {"loader": {"num_workers": 1, "persistent_workers": True}}
    assert cli.main(["--measure", "m.json", "--apply", json.dumps(apply), "--warmup", "2",
                     "--plain-steps", "12", "train.py"]) == 0
    assert json.loads((tmp_path / "settings.json").read_text()) == \
        {"num_workers": 1, "persistent_workers": True}
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] >= 12 and m["plain_step_ms"] > 0     # more when a stall came once
    assert m["warmup_steps"] >= 2
    assert DataLoader.__init__ is init, "undone after the run"


CPU_BOUND_LOADER = """
    import torch
    from torch.utils.data import DataLoader, Dataset
    class Computed(Dataset):                    # batches made by torch ops: CPU work
        def __len__(self): return 100000
        def __getitem__(self, i):
            x = torch.randn(64, 64)
            for _ in range(20):
                x = torch.tanh(x @ x.T / 64)
            return x[0]
    if __name__ == "__main__":
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in DataLoader(Computed(), batch_size=8):
            opt.zero_grad(); model(x).square().mean().backward(); opt.step()
"""


@pytest.mark.slow
def test_verify_keeps_a_worker_only_when_it_wins_on_this_machine(tmp_path):
    # A CPU loop whose batches are computed by torch: torch's threads take this machine's CPUs,
    # so the doctor prescribes no worker without measuring, and --verify keeps one only when its
    # paired runs' 95% interval says the loop got faster.
    (tmp_path / "train.py").write_text(textwrap.dedent(CPU_BOUND_LOADER))
    r = subprocess.run([sys.executable, "-m", "syncless", "doctor", "--quick", "--verify",
                        "--json", "d.json", "train.py"], capture_output=True, text=True,
                       timeout=1200, cwd=tmp_path, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    [f] = [f for f in d["findings"] if f["kind"] == "starvation"]
    import torch
    if torch.get_num_threads() >= len(os.sched_getaffinity(0)):
        assert f["fixes"][0]["text"].startswith("no CPU is free for a worker"), f["fixes"]
    v = f["verified"]
    assert v is not None and d["verify_runs"] >= 3, d["verify"]
    assert set(v["sweep"]) >= {"0", "1"}, v["sweep"]
    if v["ci_high_ms"] is not None:
        assert v["kept"] == (v["ci_high_ms"] < v["baseline_ms"])
    line = d["verify"][0]
    if v["kept"]:
        assert line.endswith(": kept") or ": kept;" in line, line
    else:
        assert "not kept" in line or "no loader fix kept" in line, line
