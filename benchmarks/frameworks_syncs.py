"""Syncs per step of the HF Trainer and Lightning as their users run them, native against syncless,
and whether the logged values are the same (issue 28's targets).

    python -m benchmarks.frameworks_syncs --out                  # CUDA; a few minutes on an H200
    python -m benchmarks.frameworks_syncs --counter cupti --out  # CUPTI: also sees
                                    # torch.cuda.synchronize(), Event.synchronize() and pageable
                                    # "non_blocking" copies, on the training thread only
    python -m benchmarks.frameworks_syncs --device cpu --quick   # the script's logic (no syncs;
                                    # --quick: 60 steps, evaluation every 20)

- HF: a tiny GPT-2 built from its config (no download); the examples are CPU tensors (input_ids,
  attention_mask, labels) that go through the Trainer's own DataLoader (pinned memory, its
  default) and its host-to-device copy; gradient accumulation 2, logging every 10 steps,
  evaluation every 100; `Trainer` against `SynclessTrainer`. Compared: `state.log_history`
  (wall-clock keys aside).
- Lightning: an MLP classifier logging `loss` and `acc` with prog_bar=True every step (and `acc`
  on_epoch), a validation loss every 100 batches, CSVLogger with log_every_n_steps=10, the TQDM
  bar, a pinned DataLoader of CPU tensors; without and with `SynclessLogging()`. Compared: the
  CSVLogger's metrics.csv.

Counted: every sync between the start of optimizer step `start` and the end of step `stop`
(steady state: after warm-up, logging steps and evaluations inside), per optimizer step, each
attributed by its Python stack to one group:
  model       the model's own code (transformers/models/, masking_utils: GPT-2's attention-mask
              check `padding_mask.all()`), listed apart: no trainer can remove it
  evaluation  inside the evaluation / validation loop (the frameworks' own, untouched)
  trainer     transformers' Trainer and accelerate / Lightning's loops and logging
  syncless    syncless' own code
  data        torch.utils.data
  other       anything else (torch's own frames are skipped to reach the caller)
with the top sites of each variant. --counter debug (default) counts torch's sync-debug-mode
warnings (every thread); --counter cupti uses syncless' CUPTI callback on the training thread.
`waits`: the times the training thread waited for syncless' delivery (Logger stats.waits, and
for SynclessTrainer its waits for a logging step's row before the next step's on_step_end): no
torch call, so no counter above sees them; they cost the host time, never a drained GPU queue
unless the GPU is ahead.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import sys
import tempfile
import warnings

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from benchmarks._common import env_info, md_table, write_results  # noqa: E402

GROUPS = ("trainer", "syncless", "data", "other", "evaluation", "model")
# torch's own files: its package folder (a venv under /opt/torch/ holds every package).
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_EVAL_FUNCS = {"evaluation_loop", "prediction_step", "evaluate", "_evaluate"}


def _group(frame) -> tuple[str, str]:
    """(group, "file:line" of the first frame outside torch) of a sync made under `frame`."""
    site, in_eval, f = "", False, frame
    group = None
    while f is not None:
        path = f.f_code.co_filename
        if group is None and (not path.startswith(_TORCH) or "torch/utils/data" in path) \
                and "warnings" not in os.path.basename(path):
            site = f"{_short(path)}:{f.f_lineno}"
            group = _kind(path)
        if (f.f_code.co_name in _EVAL_FUNCS and "transformers" in path) \
                or ("lightning" in path and "evaluation_loop" in path):
            in_eval = True
        f = f.f_back
    if group in ("model", "syncless") or not in_eval:
        return group or "other", site
    return "evaluation", site


def _kind(path: str) -> str:
    p = path.replace(os.sep, "/")
    if "/transformers/models/" in p or "masking_utils" in p or "modeling_attn_mask" in p:
        return "model"
    if "/syncless/" in p:
        return "syncless"
    if "/transformers/" in p or "/accelerate/" in p or "lightning" in p:
        return "trainer"
    if "torch/utils/data" in p:
        return "data"
    return "other"


def _short(path: str) -> str:
    p = path.replace(os.sep, "/")
    for marker in ("site-packages/", "python/syncless/", "benchmarks/"):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + len(marker):]
    return os.path.basename(p)


class Counter:
    """Syncs between start() and stop(), by group and site."""

    def __init__(self, how: str):
        self.how = how
        self.groups = dict.fromkeys(GROUPS, 0)
        self.sites: dict[str, int] = {}
        self._stack: contextlib.ExitStack | None = None
        self._last = None

    def _add(self, frame) -> None:
        group, site = _group(frame)
        self.groups[group] += 1
        key = f"{group}: {site}"
        self.sites[key] = self.sites.get(key, 0) + 1

    def start(self) -> None:
        if not torch.cuda.is_available():
            return                           # work on CPU tensors never waits for a GPU
        stack = self._stack = contextlib.ExitStack()
        if self.how == "cupti":
            from syncless.doctor.audit import _try_cupti
            cupti, why = _try_cupti()
            if cupti is None:
                raise RuntimeError(f"CUPTI cannot be used: {why}")
            cupti.start(self._on_cupti, 50.0, 1e12)
            stack.callback(cupti.stop)
            return
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("always")
        own = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                self._add(sys._getframe(1))
            else:
                own(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        stack.callback(torch.cuda.set_sync_debug_mode, 0)

    def _on_cupti(self, name: str, kind: int, start_ns: int, blocked_ns: int) -> None:
        from syncless.doctor.audit import ASYNC_COPY, COPY, FREE, SYNC
        if kind not in (SYNC, COPY, ASYNC_COPY, FREE):
            return
        frame = sys._getframe(1)
        key = (id(frame), frame.f_lasti)
        # A blocking D2H copy is a copy then a stream sync: one sync, as the audit counts it.
        if not (kind == SYNC and self._last is not None and self._last[0] == key
                and self._last[1] in (COPY, ASYNC_COPY)):
            self._add(frame)
        self._last = (key, kind)

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def result(self, steps: int) -> dict:
        top = sorted(self.sites.items(), key=lambda kv: -kv[1])[:6]
        return {"per_step": {g: n / steps for g, n in self.groups.items()},
                "without_model": sum(n for g, n in self.groups.items() if g != "model") / steps,
                "sites": {k: v / steps for k, v in top}}


@contextlib.contextmanager
def _quiet():
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull), \
            contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- Hugging Face ----------------------------------------------------------------------------

def hf(device: str, syncless: bool, steps: int, window: tuple, counter: Counter,
       tmp: str, eval_every: int = 100) -> dict:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback
    from syncless.hf import SynclessTrainer
    transformers.logging.set_verbosity_error()
    start, stop = window

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == start:
                counter.start()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == stop + 1:          # step `stop` has ended
                counter.stop()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (256, 64), generator=g)
    mask = torch.ones_like(ids)

    class Examples(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"input_ids": ids[i % 256], "attention_mask": mask[i % 256],
                    "labels": ids[i % 256]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512,
                                       n_positions=64))
    args = transformers.TrainingArguments(
        output_dir=tmp, max_steps=steps, report_to=[], per_device_train_batch_size=8,
        per_device_eval_batch_size=8, gradient_accumulation_steps=2, logging_steps=10,
        eval_strategy="steps", eval_steps=eval_every, save_strategy="no", seed=0,
        use_cpu=device == "cpu", disable_tqdm=True)
    cls = SynclessTrainer if syncless else Trainer
    trainer = cls(model=model, args=args, train_dataset=Examples(8 * 2 * steps),
                  eval_dataset=Examples(32), callbacks=[Count()])
    try:
        with _quiet():
            trainer.train()
    finally:
        counter.stop()
    waits = 0
    if syncless:
        waits = trainer.syncless_waits + trainer.syncless.stats.waits
    history = [{k: v for k, v in d.items() if not k.endswith(("_runtime", "_per_second"))}
               for d in trainer.state.log_history]
    return {"values": history, "waits": waits,
            "non_blocking": bool(trainer.accelerator.non_blocking)}


# ---- Lightning -------------------------------------------------------------------------------

def lightning(device: str, syncless: bool, steps: int, window: tuple, counter: Counter,
              tmp: str, eval_every: int = 100) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger
    from syncless.lightning import SynclessLogging
    start, stop = window

    class MLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                                     nn.ReLU(), nn.Linear(256, 10))

        def training_step(self, batch, i):
            x, y = batch
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.log("loss", loss, prog_bar=True)
            self.log("acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True,
                     on_epoch=True)
            return loss

        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == start:
                counter.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == stop + 1:
                counter.stop()

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64 * steps, 256, generator=g), torch.randint(0, 10, (64 * steps,),
                                                                     generator=g)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64,
                                        pin_memory=device == "cuda")
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:256], y[:256]),
                                      batch_size=64, pin_memory=device == "cuda")
    cbs = ([SynclessLogging()] if syncless else []) + [Count(), TQDMProgressBar()]
    trainer = pl.Trainer(max_steps=steps, callbacks=cbs, logger=CSVLogger(tmp, name="csv"),
                         log_every_n_steps=10, val_check_interval=eval_every,
                         enable_checkpointing=False, enable_model_summary=False,
                         num_sanity_val_steps=0, devices=1,
                         accelerator="gpu" if device == "cuda" else "cpu")
    try:
        with _quiet():
            trainer.fit(MLP(), train, val)
    finally:
        counter.stop()
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        values = list(csv.reader(f))
    waits = cbs[0].syncless.stats.waits if syncless else 0
    return {"values": values, "waits": waits}


# ---- the run ---------------------------------------------------------------------------------

def run(device: str, quick: bool, how: str, only: str | None) -> dict:
    # Quick: evaluation every 20 steps, so that the short window holds one too.
    steps, window, eval_every = (60, (15, 44), 20) if quick else (260, (20, 239), 100)
    n = window[1] - window[0] + 1
    out: dict = {}
    for fw, fit, variants in (("hf", hf, ("Trainer", "SynclessTrainer")),
                              ("lightning", lightning, ("Lightning", "SynclessLogging"))):
        if only and fw != only:
            continue
        section: dict = {"steps": steps, "window": list(window), "variants": {}}
        values = {}
        for variant in variants:
            counter = Counter(how)
            with tempfile.TemporaryDirectory() as tmp:
                res = fit(device, variant == variants[1], steps, window, counter, tmp,
                          eval_every)
            values[variant] = res.pop("values")
            section["variants"][variant] = {**counter.result(n), **res}
            c = section["variants"][variant]
            print(f"{fw:9s} {variant:16s} syncs/step without the model's "
                  f"{c['without_model']:.3f}  " + "  ".join(
                      f"{g} {c['per_step'][g]:.3f}" for g in GROUPS) + f"  waits {res['waits']}",
                  flush=True)
            for site, per in c["sites"].items():
                print(f"    {per:7.3f}  {site}", flush=True)
        section["identical"] = values[variants[0]] == values[variants[1]]
        section["values_compared"] = sum(len(v) for v in values[variants[0]])
        print(f"{fw:9s} logged values identical: {section['identical']} "
              f"({len(values[variants[0]])} rows)", flush=True)
        out[fw] = section
    return out


def markdown(results: dict) -> str:
    rows = []
    for fw, section in results.items():
        for variant, c in section["variants"].items():
            rows.append([fw, variant, f"{c['without_model']:.3f}",
                         *(f"{c['per_step'][g]:.3f}" for g in GROUPS), str(c["waits"]),
                         "yes" if section["identical"] else "NO"])
    head = ["framework", "variant", "syncs/step (model's apart)", *GROUPS, "waits",
            "values identical"]
    return md_table(head, rows) + "\n\nTop sites (syncs per step):\n\n" + "\n".join(
        f"- {fw} / {variant}: " + "; ".join(f"{site} {per:.3f}"
                                            for site, per in c["sites"].items())
        for fw, section in results.items() for variant, c in section["variants"].items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--quick", action="store_true", help="60 steps instead of 260")
    p.add_argument("--counter", choices=["debug", "cupti"], default="debug")
    p.add_argument("--only", choices=["hf", "lightning"], default=None)
    p.add_argument("--out", nargs="?", const=os.path.join(HERE, "results"), default=None)
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and a.counter == "cupti":
        p.error("--counter cupti needs CUDA")
    results = run(device, a.quick, a.counter, a.only)
    data = {"env": env_info(torch.device(device), argv, "benchmarks.frameworks_syncs"),
            "counter": a.counter, "quick": a.quick, "results": results}
    write_results(a.out, "frameworks_syncs" + ("-cupti" if a.counter == "cupti" else ""),
                  data, markdown(results))
    ok = all(s["identical"] for s in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
