"""The doctor on public training scripts nobody here wrote, against fixes applied by hand.

    python benchmarks/doctor_public.py prepare [--mirror DIR]      # sources + synthetic data
    python benchmarks/doctor_public.py run [--device cpu|cuda] [--only a,b] [--budget-s S]
                                       [--verify | --no-verify] [--no-quick] [--pairs N]
                                       [--out benchmarks/results/doctor_public_<device>.json]

`prepare` copies the scripts from git mirrors of github:karpathy/nanoGPT and
github:pytorch/examples (`--mirror DIR` holds `karpathy+nanoGPT/repo`, `pytorch+examples/repo`,
bare clones; fetch them with git) into benchmarks/.public/ (git-ignored: nothing fetched is
committed) and writes synthetic data where a script downloads its own. The scripts are not edited.
The data patch, in full:
  nanoGPT shakespeare_char  data/shakespeare_char/{train,val}.bin: uint16 tokens, uniform over a
                            65-symbol vocabulary (1,003,854 and 111,540 tokens, the real sizes);
                            meta.pkl: {vocab_size: 65, itos, stoi} over the same 65 symbols
  MNIST (vae, mnist)        data/MNIST/raw/*-ubyte: random 28x28 uint8 images and labels 0-9 in the
                            idx format, 60,000 train / 10,000 test (torchvision then finds them and
                            does not download)
  imagenet, dcgan           none: their own --dummy / --dataset fake
  word_language_model       data/wikitext-2/{train,valid,test}.txt: lines of 100 words drawn
                            uniformly from 33,277 made-up words (2,088,628 / 217,646 / 245,569
                            words; the snapshot's own copy is too large to be stored)

Two scripts are written here, at `prepare`, as the frameworks' own docs show them (their text
is below, in this file; nothing is fetched): hf_trainer_docs/train.py, the Trainer of Hugging Face's
"Fine-tune a pretrained model" tutorial (AutoModelForSequenceClassification, TrainingArguments,
Trainer.train(); bert-base-cased's shape from its config with random weights instead of the
download, and Yelp-review-shaped rows: 512 tokens, 5 labels, instead of the dataset; --layers,
--hidden, --seq shrink it for the CPU run), and lightning_docs/train.py, Lightning's LitAutoEncoder
(MNIST(os.getcwd(), download=True), DataLoader(dataset), Trainer(limit_train_batches=100,
max_epochs=1), then max_epochs raised to 5 so that the doctor's phases fit; MNIST's synthetic
files as above, or, where torchvision is not installed, a TensorDataset of MNIST's shape).

`run` measures, per script: the doctor's verdict in its default and --quick runs (`summary`: the
verdict, each checked finding's predicted and verified gain, the doctor's wall time and the runs it
made, its own and --verify's; whether the script was harmed), its steady step
timed unobserved against the observed one, and the gain of its top fix applied by hand (the
script's own option where it has one, else the setting applied from outside the code, as
--verify does) timed in paired plain runs (two timestamps a step, `doctor --measure`), against
the gain it predicted. Results go to --out as they come (a budget stops it between scripts)."""
from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tarfile
import io
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEST = os.path.join(HERE, ".public")

# name -> (folder under .public, script, cpu args, cuda args, hand fixes by finding kind).
# A hand fix is {"args": {flag: value}} (the script's own option) or {"apply": settings}.
CASES = {
    "nanogpt_char": ("nanoGPT", "train.py",
                     ["config/train_shakespeare_char.py", "--compile=False", "--device=cpu",
                      "--dtype=float32", "--batch_size=8", "--block_size=64", "--n_layer=2",
                      "--n_head=2", "--n_embd=64", "--eval_iters=20", "--max_iters=100000"],
                     ["config/train_shakespeare_char.py", "--compile=False",
                      "--max_iters=100000"],
                     {"launch-bound": {"apply": {"compile": "reduce-overhead"}},
                      "sync": {"args": {"--log_interval": "100000"}}}),
    "imagenet_resnet18": ("examples/imagenet", "main.py",
                          ["--dummy", "-a", "resnet18", "-b", "4", "-j", "1", "--epochs", "1"],
                          ["--dummy", "-a", "resnet18", "-b", "256", "-j", "4", "--epochs", "1"],
                          {"starvation": {"args": {"-j": "{workers}"}}}),
    "word_language_model": ("examples/word_language_model", "main.py",
                            ["--epochs", "1", "--emsize", "64", "--nhid", "64", "--bptt", "20"],
                            ["--accel", "--epochs", "1"],
                            {"launch-bound": {"apply": {"compile": "reduce-overhead"}}}),
    "dcgan_fake": ("examples/dcgan", "main.py",
                   ["--dataset", "fake", "--niter", "5", "--batchSize", "16", "--ngf", "16",
                    "--ndf", "16", "--outf", "out"],
                   ["--dataset", "fake", "--niter", "25", "--accel", "--outf", "out"],
                   {"starvation": {"args": {"--workers": "8"}},
                    "launch-bound": {"apply": {"compile": "reduce-overhead"}}}),
    "vae_mnist": ("examples/vae", "main.py", ["--no-accel", "--epochs", "3"], ["--epochs", "3"],
                  {"starvation": {"apply": {"loader": {"num_workers": 8,
                                                       "persistent_workers": True}}}}),
    "mnist": ("examples/mnist", "main.py", ["--no-accel", "--epochs", "2"], ["--epochs", "2"],
              {"starvation": {"apply": {"loader": {"num_workers": 8,
                                                   "persistent_workers": True}}}}),
    "hf_trainer_docs": ("hf_trainer_docs", "train.py",
                        ["--layers", "2", "--hidden", "64", "--seq", "64"], [],
                        {"starvation": {"apply": {"hf": {"dataloader_num_workers": 4,
                                                         "dataloader_persistent_workers": True}}},
                         "launch-bound": {"apply": {"hf": {
                             "torch_compile": True, "torch_compile_mode": "reduce-overhead"}}}}),
    "save_whole_model": ("save_whole_model", "train.py", ["--samples", "1280"],
                         ["--samples", "1280"],
                         {"starvation": {"apply": {"loader": {"num_workers": 4,
                                                              "persistent_workers": True}}},
                          "launch-bound": {"apply": {"compile": "reduce-overhead"}}}),
    "lightning_docs": ("lightning_docs", "train.py", [], [],
                       {"starvation": {"apply": {"loader": {"num_workers": 4,
                                                            "persistent_workers": True}}},
                        "launch-bound": {"apply": {"compile": "reduce-overhead"}}}),
}

# The Trainer of Hugging Face's "Fine-tune a pretrained model" tutorial, with the model built from
# bert-base-cased's configuration (random weights) and rows of the tokenized Yelp reviews' shape.
HF_TRAINER_DOCS = """\
import argparse

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=12)
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--seq", type=int, default=512)
a = p.parse_args()


class YelpShaped(torch.utils.data.Dataset):     # tokenized, padded to max_length, 5 labels
    def __init__(self, n, seq):
        rng = np.random.default_rng(0)
        self.ids = rng.integers(1000, 28996, (n, seq))
        self.labels = rng.integers(0, 5, n)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i].tolist(), "token_type_ids": [0] * self.ids.shape[1],
                "attention_mask": [1] * self.ids.shape[1], "labels": int(self.labels[i])}


config = AutoConfig.for_model("bert", num_labels=5, num_hidden_layers=a.layers,
                              hidden_size=a.hidden, num_attention_heads=max(1, a.hidden // 64),
                              intermediate_size=4 * a.hidden)
model = AutoModelForSequenceClassification.from_config(config)
small_train_dataset = YelpShaped(1000, a.seq)
small_eval_dataset = YelpShaped(1000, a.seq)
training_args = TrainingArguments(output_dir="test_trainer", eval_strategy="epoch",
                                  report_to="none")
trainer = Trainer(model=model, args=training_args, train_dataset=small_train_dataset,
                  eval_dataset=small_eval_dataset)
trainer.train()
"""

# PyTorch's quick start (FashionMNIST, NeuralNetwork, train() and test() each epoch), saving the
# whole model each epoch as its "Saving and Loading Models" tutorial shows (torch.save(model, PATH));
# FashionMNIST's synthetic files as MNIST's (see prepare), or its shape where torchvision is not
# installed. 30 epochs instead of 5, and --samples 1280 in the runs here (epochs of 20 steps), so
# that the doctor's phases and its verifying runs span several epochs, their tests and their saves.
SAVE_WHOLE_MODEL = """\
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=None, help="train on the first N (epochs of N/64)")
a = p.parse_args()

try:
    from torchvision import datasets
    from torchvision.transforms import ToTensor
    training_data = datasets.FashionMNIST(root="data", train=True, download=True,
                                          transform=ToTensor())
    test_data = datasets.FashionMNIST(root="data", train=False, download=True,
                                      transform=ToTensor())
except ImportError:        # no torchvision (the doctor_public patch): FashionMNIST's shape
    training_data = torch.utils.data.TensorDataset(torch.rand(60000, 1, 28, 28),
                                                   torch.randint(0, 10, (60000,)))
    test_data = torch.utils.data.TensorDataset(torch.rand(10000, 1, 28, 28),
                                               torch.randint(0, 10, (10000,)))

if a.samples:
    training_data = Subset(training_data, range(a.samples))
    test_data = Subset(test_data, range(a.samples // 6))
batch_size = 64
train_dataloader = DataLoader(training_data, batch_size=batch_size)
test_dataloader = DataLoader(test_data, batch_size=batch_size)

device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() \
    else "cpu"
print(f"Using {device} device")


class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10)
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


model = NeuralNetwork().to(device)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)


def train(dataloader, model, loss_fn, optimizer):
    size = len(dataloader.dataset)
    model.train()
    for batch, (X, y) in enumerate(dataloader):
        X, y = X.to(device), y.to(device)
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if batch % 100 == 0:
            loss, current = loss.item(), (batch + 1) * len(X)
            print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")


def test(dataloader, model, loss_fn):
    size = len(dataloader.dataset)
    num_batches = len(dataloader)
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for X, y in dataloader:
            X, y = X.to(device), y.to(device)
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    test_loss /= num_batches
    correct /= size
    print(f"Test Error: \\n Accuracy: {(100*correct):>0.1f}%, Avg loss: {test_loss:>8f} \\n")


epochs = 30
for t in range(epochs):
    print(f"Epoch {t+1}\\n-------------------------------")
    train(train_dataloader, model, loss_fn, optimizer)
    test(test_dataloader, model, loss_fn)
    torch.save(model, "model.pth")
print("Done!")
"""

# Lightning's LitAutoEncoder, as its README and quick start show it (max_epochs 1 -> 5).
LIGHTNING_DOCS = """\
import os

import lightning as L
import torch
from torch import nn, optim, utils

encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))


class LitAutoEncoder(L.LightningModule):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optim.Adam(self.parameters(), lr=1e-3)


autoencoder = LitAutoEncoder(encoder, decoder)
try:
    from torchvision.datasets import MNIST
    from torchvision.transforms import ToTensor
    dataset = MNIST(os.getcwd(), download=True, transform=ToTensor())
except ImportError:        # no torchvision (the doctor_public patch): MNIST's shape, synthetic
    dataset = utils.data.TensorDataset(torch.rand(60000, 1, 28, 28),
                                       torch.randint(0, 10, (60000,)))
train_loader = utils.data.DataLoader(dataset)
trainer = L.Trainer(limit_train_batches=100, max_epochs=5)
trainer.fit(model=autoencoder, train_dataloaders=train_loader)
"""


# ---- prepare -------------------------------------------------------------------------------------

def _extract(mirror: str, paths: list, into: str) -> None:
    tar = subprocess.run(["git", "-C", mirror, "archive", "HEAD", *paths], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")


def _shakespeare_char(folder: str) -> None:
    rng = np.random.default_rng(0)
    chars = [chr(c) for c in range(32, 97)]                      # 65 symbols
    os.makedirs(folder, exist_ok=True)
    rng.integers(0, 65, 1_003_854, dtype=np.uint16).tofile(os.path.join(folder, "train.bin"))
    rng.integers(0, 65, 111_540, dtype=np.uint16).tofile(os.path.join(folder, "val.bin"))
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)


def _wikitext2(folder: str) -> None:
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(33_278 - 1)])        # + "<eos>": wikitext-2's 33,278
    os.makedirs(folder, exist_ok=True)
    for split, tokens in (("train", 2_088_628), ("valid", 217_646), ("test", 245_569)):
        ids = rng.integers(0, len(words), tokens)
        lines = [" ".join(words[ids[i:i + 100]]) for i in range(0, tokens, 100)]
        with open(os.path.join(folder, f"{split}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def _mnist(raw: str) -> None:
    rng = np.random.default_rng(0)
    os.makedirs(raw, exist_ok=True)
    for prefix, n in (("train", 60_000), ("t10k", 10_000)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write(np.array([2051, n, 28, 28], dtype=">i4").tobytes() + images.tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write(np.array([2049, n], dtype=">i4").tobytes() + labels.tobytes())


def prepare(mirror: str | None, dest: str = DEST, data_only: bool = False,
            no_data: bool = False) -> None:
    if not data_only:
        _extract(os.path.join(mirror, "karpathy+nanoGPT", "repo"),
                 ["train.py", "model.py", "configurator.py", "config"],
                 os.path.join(dest, "nanoGPT"))
        _extract(os.path.join(mirror, "pytorch+examples", "repo"),
                 ["imagenet", "word_language_model", "dcgan", "vae", "mnist",
                  ":!word_language_model/data"],
                 os.path.join(dest, "examples"))
    for folder, text in (("hf_trainer_docs", HF_TRAINER_DOCS), ("lightning_docs", LIGHTNING_DOCS),
                         ("save_whole_model", SAVE_WHOLE_MODEL)):
        os.makedirs(os.path.join(dest, folder), exist_ok=True)
        with open(os.path.join(dest, folder, "train.py"), "w") as f:
            f.write(text)
    if no_data:                # the sources only (a few MB: what a GPU machine is sent)
        return
    _shakespeare_char(os.path.join(dest, "nanoGPT", "data", "shakespeare_char"))
    _mnist(os.path.join(dest, "examples", "data", "MNIST", "raw"))
    _mnist(os.path.join(dest, "lightning_docs", "MNIST", "raw"))
    _mnist(os.path.join(dest, "save_whole_model", "data", "FashionMNIST", "raw"))
    _wikitext2(os.path.join(dest, "examples", "word_language_model", "data", "wikitext-2"))


# ---- run -----------------------------------------------------------------------------------------

def _with(args: list, replace: dict) -> list:
    """`args` with each flag's value replaced (`--flag=v` or `--flag v`), or the flag added (in
    the `--flag=v` form where the script's arguments use it: nanoGPT's configurator)."""
    out = list(args)
    equals = any(a.startswith("--") and "=" in a for a in args)
    for flag, value in replace.items():
        hits = [i for i, a in enumerate(out) if a == flag or a.startswith(flag + "=")]
        for i in hits:
            if out[i] == flag:
                out[i + 1] = value
            else:
                out[i] = f"{flag}={value}"
        if not hits:
            out += [f"{flag}={value}"] if equals else [flag, value]
    return out


def _doctor(cwd: str, script: str, args: list, *options, timeout: float = 900) -> dict:
    out = os.path.join(cwd, "doctor.json")
    if os.path.exists(out):
        os.remove(out)
    t = time.perf_counter()
    # Its own process group: a doctor past `timeout` is killed with the workers and verifying
    # runs it started, which would hold the GPU and the CPUs through the next script; first
    # SIGABRT, which faulthandler answers with every thread's stack (where it was stuck).
    p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "syncless", "doctor",
                          "--json", out, *options, script, *args], cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGABRT)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        return {"error": f"killed after {timeout:.0f} s; stdout: {stdout[-1500:]}; stderr: "
                         f"{stderr[-5000:]}", "seconds": time.perf_counter() - t}
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    seconds = time.perf_counter() - t
    if not os.path.exists(out):
        return {"error": (r.stderr or r.stdout)[-2000:], "seconds": seconds}
    with open(out) as f:
        d = json.load(f)
    d["seconds"] = seconds
    d["rc"] = r.returncode
    d["report"] = r.stdout[-6000:]
    return d


def _measure(cwd: str, script: str, args: list, apply: dict | None, warmup: int,
             steps: int) -> float | None:
    out = os.path.join(cwd, "measure.json")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, "-m", "syncless", "doctor", "--measure", out, "--warmup", str(warmup),
           "--plain-steps", str(steps)]
    if apply:
        cmd += ["--apply", json.dumps(apply)]
    subprocess.run(cmd + [script, *args], cwd=cwd, capture_output=True, timeout=900)
    try:
        with open(out) as f:
            return json.load(f)["plain_step_ms"]
    except (OSError, ValueError, KeyError):
        return None


def _hand_fix(cwd, script, args, fix, warmup, steps, pairs) -> dict:
    """The fix applied by hand, in `pairs` interleaved pairs of plain runs (A B, B A, ...)."""
    fixed = _with(args, fix.get("args", {}))
    apply = fix.get("apply")
    a, b = [], []
    for i in range(pairs):
        order = [("a", args, None), ("b", fixed, apply)]
        for side, argv, settings in (order if i % 2 == 0 else order[::-1]):
            ms = _measure(cwd, script, argv, settings, warmup, steps)
            (a if side == "a" else b).append(ms)
    a = [x for x in a if x is not None]
    b = [x for x in b if x is not None]
    if not a or not b:
        return {"error": "a plain run measured nothing", "without": a, "with": b}
    return {"without_ms": statistics.fmean(a), "with_ms": statistics.fmean(b),
            "gain_ms": statistics.fmean(a) - statistics.fmean(b), "without": a, "with": b,
            "fix": fix}


def _verified_gain(d: dict) -> dict:
    """Per finding the doctor checked: its predicted gain and what --verify measured (both on the
    unobserved step's scale: the verified runs time unobserved steps)."""
    scale = (d["plain_step_ms"] / d["step_ms"]) if d.get("plain_step_ms") and \
        d.get("step_ms") else 1.0
    out = []
    for f in d.get("findings", []):
        v = f.get("verified") or {}
        checked = f.get("checked_ms", f.get("predicted_ms"))   # the verified fix's prediction
        predicted = (d["step_ms"] - checked) * scale \
            if checked is not None and d.get("step_ms") else None
        verified = v["baseline_ms"] - v["measured_ms"] \
            if v.get("baseline_ms") is not None and v.get("measured_ms") is not None else None
        out.append({"kind": f.get("kind"), "title": f.get("title"),
                    "predicted_gain_ms": predicted, "verified_gain_ms": verified,
                    "kept": v.get("kept") if v else None})
    return out


def run_case(name: str, device: str, pairs: int, verify: bool | None,
             quick: bool = True, timeout: float = 900) -> dict:
    """`verify`: True (--verify), False (--no-verify), None (the doctor's default)."""
    folder, script, cpu_args, cuda_args, fixes = CASES[name]
    cwd = os.path.join(DEST, folder)
    args = cuda_args if device == "cuda" else cpu_args
    res = {"script": f"{folder}/{script}", "args": args}
    quick_run = _doctor(cwd, script, args, "--quick", "--no-verify",
                        timeout=timeout) if quick else {}
    flag = [] if verify is None else ["--verify"] if verify else ["--no-verify"]
    full = _doctor(cwd, script, args, *flag, timeout=timeout)
    keep = ("verdict", "step_ms", "plain_step_ms", "overhead", "provisional", "provisional_why",
            "periodic", "boundary", "warmup_steps", "seconds", "verify", "verify_runs",
            "verify_seconds", "verify_where", "verify_log", "error", "notes", "model_share",
            "report")
    res["quick"] = {k: quick_run.get(k) for k in keep} if quick else None
    res["default"] = {k: full.get(k) for k in keep}
    res["default"]["findings"] = [{k: f.get(k) for k in ("kind", "title", "predicted_ms",
                                                         "checked_ms", "wins_ms", "verified",
                                                         "workers_needed",
                                                         "fixes")}
                                  for f in full.get("findings", [])]
    # What the issue's proof asks per script: the verdict, predicted against verified gain, the
    # doctor's wall time and the runs it made (its own and --verify's).
    res["summary"] = {"verdict": full.get("verdict"), "doctor_wall_s": full.get("seconds"),
                      "runs": 1 + (full.get("verify_runs") or 0),
                      "verify_seconds": full.get("verify_seconds"),
                      # the script failed or exited non-zero under the doctor
                      "harmed": bool(full.get("error")) or bool(full.get("rc")) or
                      "stopped with" in (full.get("provisional_why") or ""),
                      "gains": _verified_gain(full)}
    res["same_verdict"] = quick_run.get("verdict") == full.get("verdict") if quick else None
    top = full["findings"][0] if full.get("findings") else None
    needs_count = top is not None and top["kind"] in fixes and any(
        "{workers}" in v for v in fixes[top["kind"]].get("args", {}).values())
    if needs_count and not top.get("workers_needed"):
        res["hand_fix"] = {"error": "the doctor prescribed no worker count to apply"}
    elif top is not None and top["kind"] in fixes and pairs > 0:
        fix = fixes[top["kind"]]
        if top.get("workers_needed"):            # "{workers}": the count the doctor prescribed
            fix = {**fix, "args": {k: v.format(workers=top["workers_needed"])
                                   for k, v in fix.get("args", {}).items()}}
        hand = _hand_fix(cwd, script, args, fix, full.get("warmup_steps") or 3, 20, pairs)
        res["hand_fix"] = hand
        if "gain_ms" in hand and top.get("predicted_ms") is not None:
            # The prediction is on the observed step; put it on the unobserved one.
            scale = (full["plain_step_ms"] / full["step_ms"]) if full.get("plain_step_ms") and \
                full.get("step_ms") else 1.0
            predicted_gain = (full["step_ms"] - top["predicted_ms"]) * scale
            res["predicted_gain_ms"] = predicted_gain
            res["measured_gain_ms"] = hand["gain_ms"]
            res["gain_error"] = (abs(predicted_gain - hand["gain_ms"]) / abs(hand["gain_ms"])
                                 if hand["gain_ms"] else None)
            res["verdict_right"] = hand["gain_ms"] >= 0.05 * hand["without_ms"]
    elif top is None:
        res["verdict_right"] = None                # nothing prescribed: no fix to time
    return res


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--mirror", default="/work/.mirror")
    pp.add_argument("--data-only", action="store_true",
                    help="only the synthetic data (the sources are already in place)")
    pp.add_argument("--no-data", action="store_true",
                    help="only the sources (write the data where the scripts run: --data-only)")
    pr = sub.add_parser("run")
    pr.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pr.add_argument("--only", default="", help="comma-separated case names")
    pr.add_argument("--pairs", type=int, default=2)
    pr.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                    help="the default run with --verify / --no-verify (default: neither, the "
                         "doctor's own default)")
    pr.add_argument("--no-quick", action="store_true", help="skip the --quick run")
    pr.add_argument("--budget-s", type=float, default=1e9,
                    help="start no new script after this many seconds")
    pr.add_argument("--timeout-s", type=float, default=900,
                    help="kill a doctor run (and what it started) after this many seconds")
    pr.add_argument("--out", default=None)
    pr.add_argument("--append", action="store_true",
                    help="keep the cases already in --out (runs split over several commands)")
    ns = p.parse_args(argv)
    if ns.cmd == "prepare":
        prepare(ns.mirror, data_only=ns.data_only, no_data=ns.no_data)
        return 0
    names = [n for n in ns.only.split(",") if n] or list(CASES)
    out = ns.out or os.path.join(HERE, "results", f"doctor_public_{ns.device}.json")
    started = time.perf_counter()
    import torch
    results = {"command": " ".join(sys.argv), "device": ns.device, "torch": torch.__version__,
               "cases": {}}
    if ns.append and os.path.exists(out):
        with open(out) as f:
            kept = json.load(f)
        results["command"] = kept.get("command", "") + "; " + results["command"]
        results["cases"] = kept.get("cases", {})
    for name in names:
        if time.perf_counter() - started > ns.budget_s:
            results["cases"][name] = {"skipped": "budget"}
            continue
        t = time.perf_counter()
        try:
            results["cases"][name] = run_case(name, ns.device, ns.pairs, ns.verify,
                                              quick=not ns.no_quick, timeout=ns.timeout_s)
        except Exception as e:                     # one script's failure is its result
            results["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
        results["cases"][name]["case_seconds"] = time.perf_counter() - t
        with open(out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        c = results["cases"][name]
        summary = c.get("summary", {})
        print(f"{name}: default {summary.get('verdict')}, quick "
              f"{(c.get('quick') or {}).get('verdict')}, doctor {summary.get('doctor_wall_s')} s "
              f"in {summary.get('runs')} runs, gains (predicted, verified, kept) "
              + str([(g["kind"], g["predicted_gain_ms"], g["verified_gain_ms"], g["kept"])
                     for g in summary.get("gains", [])])
              + f", by hand {c.get('measured_gain_ms')} ({c['case_seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
