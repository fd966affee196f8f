"""Syncs made inside the frameworks people train with, and the setting that removes each.

A sync whose stack runs through library code cannot be moved by the user: the fix is the
framework's own switch. Each rule looks at the library frames between the user's entry line
(`trainer.train()`, `trainer.fit(...)`) and the CUDA call, innermost first, with a few source lines
above each frame (a condition split over lines names its setting on the line before)."""
from __future__ import annotations

from types import FrameType
from typing import Any, NamedTuple, TypeAlias

from ._frames import Frame

__all__ = ["DROPINS", "FrameworkFix", "applied_label", "framework_fix", "stack_framework"]

# syncless's drop-in for each framework's own loop, as its user writes it: one line.
DROPINS = {"transformers": "syncless.hf.SynclessTrainer(...) in place of Trainer(...)",
           "lightning": "Trainer(callbacks=[syncless.lightning.SynclessLogging()])"}


class FrameworkFix(NamedTuple):
    framework: str         # "transformers" | "lightning" | "torchmetrics" | "accelerate" | "wandb"
    frame: Frame           # the library line the rule matched
    fix: str
    setting: str = ""      # what the fix changes, in a word or two (the finding's title says it)
    dropin: str = ""       # the DROPINS key whose drop-in removes this sync too, or ""
    dropin_fix: str = ""   # that drop-in's line and what it does about this sync
    apply: dict[str, Any] | None = None   # the fix as --verify applies it from outside, or None


# The settings --verify applies from outside the script for a rule's fix, by (framework, setting).
# A fix with no one value ("logging_steps=<more steps>", a metric's nan_strategy, a code change)
# is the user's to choose: its prediction stands, unmeasured. The batch copy's setting is the
# Trainer's: applied only where a Trainer made the copy.
_APPLY: dict[tuple[str, str], dict[str, Any]] = {
    ("transformers", "logging_nan_inf_filter"): {"hf": {"logging_nan_inf_filter": False}},
    ("transformers", "include_num_input_tokens_seen"):
        {"hf": {"include_num_input_tokens_seen": "no"}},
    ("transformers", "mask checks"): {"hf": {"torch_compile": True}},
    ("accelerate", "blocking batch copy"):
        {"hf": {"dataloader_pin_memory": True, "accelerator_config": {"non_blocking": True}}},
    ("lightning", "prog_bar"): {"lightning": {"enable_progress_bar": False}},
}


def applied_label(settings: dict[str, Any]) -> str:
    """A setting of _APPLY as its user writes it: `TrainingArguments(...)`, `Trainer(...)`."""
    owner, values = next(iter(settings.items()))
    call = {"hf": "TrainingArguments", "lightning": "Trainer"}[owner]
    return f"{call}(" + ", ".join(f"{k}={v!r}" for k, v in values.items()) + ")"


# A rule's answer: (fix, setting) or (fix, setting, drop-in key, what the drop-in does).
_Rule: TypeAlias = "tuple[str, str] | tuple[str, str, str, str] | None"


_MASKS = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa",
          "_ignore_bidirectional_mask_sdpa", "_preprocess_mask_arguments", "padding_mask_function")


def _package(frame: Frame) -> str:
    path = frame.file.replace("\\", "/")
    for name in ("transformers", "accelerate", "torchmetrics", "pytorch_lightning",
                 "lightning_fabric", "lightning", "wandb"):
        if f"/{name}/" in path:
            return "lightning" if name.startswith(("pytorch_lightning", "lightning")) else name
    return ""


def _hf(frame: Frame, text: str) -> _Rule:
    if "logging_nan_inf_filter" in text:
        fix = ("TrainingArguments(logging_nan_inf_filter=False): the Trainer checks every step's "
               "loss for NaN/Inf with a host read (a sync per step)")
        if frame.function == "evaluation_loop":
            return fix, "logging_nan_inf_filter"
        return (fix, "logging_nan_inf_filter", "transformers",
                "runs the same filter on the device, with the Trainer's own formula (a NaN/Inf "
                "loss adds the window's running mean instead): no host read")
    if "num_input_tokens_seen" in text or frame.function == "_track_num_input_tokens":
        return ("TrainingArguments(include_num_input_tokens_seen='no'): counting the tokens seen "
                "reads a GPU sum on the host every step", "include_num_input_tokens_seen",
                "transformers", "counts the tokens without a host read (a count the host has "
                "directly, one the device makes in a device counter)")
    if frame.function == "_maybe_log_save_evaluate" and ".item()" in frame.code() and \
            ("tr_loss" in frame.code() or "grad_norm" in frame.code()):
        return ("TrainingArguments(logging_steps=<more steps>): at each logging step the Trainer "
                "reads the window's loss and the grad norm on the host (a sync per logging "
                "step); a larger logging_steps makes it rarer", "logging step",
                "transformers", "keeps the logging step's loss and grad norm on the device and "
                "calls the Trainer's log() with the same values when they arrive (normally at "
                "the next step)")
    if frame.function in _MASKS or frame.file.replace("\\", "/").endswith("/masking_utils.py"):
        # transformers 5: without an attention_mask it checks position_ids for packed sequences,
        # with one it checks the mask for padding (to skip building it): a host read either way,
        # skipped only while the model is traced.
        return ("transformers' attention-mask code reads the batch on the host once per forward "
                "(the packed-sequence check when the batch has no attention_mask, the padding "
                "check when it has one): no TrainingArguments setting removes it; a compiled "
                "model skips it (TrainingArguments(torch_compile=True))", "mask checks")
    return None


def _accelerate(frames: tuple[Frame, ...], frame: Frame, text: str) -> _Rule:
    if frame.function in ("send_to_device", "_send_to_device") or "send_to_device" in text:
        fix = ("the batch is copied to the GPU with non_blocking=False (torch syncs after such a "
               "copy): TrainingArguments(accelerator_config={'non_blocking': True}) with "
               "dataloader_pin_memory=True (accelerate: DataLoaderConfiguration(non_blocking="
               "True))")
        if not any(_package(f) == "transformers" for f in frames):
            return fix, "blocking batch copy"
        return (fix, "blocking batch copy", "transformers",
                "makes the Trainer's batch copies non-blocking when its loader pins memory "
                "(dataloader_pin_memory=True, the default)")
    return None


_PL_STEP = ("gives the values that training batches log with self.log to a syncless Logger, "
            "unread, and Lightning's loggers and progress bar the same values when they arrive")


def _lightning(frames: tuple[Frame, ...], frame: Frame, text: str) -> _Rule:
    if "pbar" in text or any("/progress/" in f.file.replace("\\", "/")
                             or "progress_bar" in f.function for f in frames):
        return ("self.log(..., prog_bar=True) reads each such metric with .item() every batch "
                "for the progress bar: log it with prog_bar=False (or "
                "Trainer(enable_progress_bar=False))", "prog_bar", "lightning", _PL_STEP)
    if frame.function == "log_metrics" and "convert_tensors_to_scalars" in text and \
            any(f.function == "update_train_step_metrics" for f in frames):
        return ("Lightning reads every step value on the host before its loggers get them, "
                "every log_every_n_steps: Trainer(log_every_n_steps=<more steps>) makes it "
                "rarer", "logged step values", "lightning", _PL_STEP)
    if "to_tensor" in frame.function or "torch.tensor(value" in text:
        return ("self.log(name, <Python float>) copies the number to the GPU at every call (a "
                "blocking host-to-device copy): log a tensor that is already on the device, or "
                "log the value less often (on_step=False)", "self.log(float)", "lightning",
                "turns a Python number logged in a training batch into a device tensor with "
                "torch.full (the value travels as a kernel argument: no copy)")
    return None


def _torchmetrics(frame: Frame, text: str) -> _Rule:
    if "nan" in text.lower() or "nan" in frame.function:
        return ("the metric checks every update for NaN with a host read: construct it with "
                "nan_strategy='disable' (no check) when the inputs cannot hold NaN",
                "nan_strategy")
    return None


def _wandb(frames: tuple[Frame, ...], frame: Frame, text: str) -> _Rule:
    # wandb.log() turns each tensor into a number with .item() (wandb/util.py json_friendly).
    # Called by a framework's logger, the framework's own rule (or setting) is the fix.
    if any(_package(f) in ("lightning", "transformers", "accelerate") for f in frames):
        return None
    return ("wandb.log() reads every tensor it is given on the host (.item(), a sync per "
            "tensor): `import syncless.wandb as wandb` takes the same calls without a sync",
            "wandb.log")


def framework_fix(chain: tuple[Frame, ...]) -> FrameworkFix | None:
    """The framework setting behind a sync whose library frames (innermost first) are `chain`."""
    for frame in chain:
        pkg = _package(frame)
        if not pkg:
            continue
        text = frame.code(before=3)
        fix: tuple[str, ...] | None
        if pkg == "transformers":
            fix = _hf(frame, text)
        elif pkg == "accelerate":
            fix = _accelerate(chain, frame, text)
        elif pkg == "lightning":
            fix = _lightning(chain, frame, text)
        elif pkg == "wandb":
            fix = _wandb(chain, frame, text)
        else:
            fix = _torchmetrics(frame, text)
        if fix:
            said, setting, *dropin = fix
            apply = _APPLY.get((pkg, setting))
            if pkg == "accelerate" and not dropin:
                apply = None                # accelerate in a loop of the user's own
            if dropin:
                return FrameworkFix(pkg, frame, said, setting, dropin[0],
                                    f"{DROPINS[dropin[0]]}: {dropin[1]}", apply)
            return FrameworkFix(pkg, frame, said, setting, apply=apply)
    return None


# ---- the fixes a framework's user writes in the framework's own words ---------------------------

def stack_framework(frame: FrameType | None) -> str:
    """The framework that runs the training loop whose frame stack holds `frame` (the innermost):
    "transformers" (its Trainer), "lightning" (its Trainer or Fabric), "accelerate", or ""."""
    found = ""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/transformers/trainer" in path:
            return "transformers"
        if "/pytorch_lightning/" in path or "/lightning/pytorch/" in path or \
                "/lightning_fabric/" in path or "/lightning/fabric/" in path:
            return "lightning"
        if "/accelerate/" in path:
            found = "accelerate"
        frame = frame.f_back
    return found
