"""Syncs made inside the frameworks people train with, and the setting that removes each.

A sync whose stack runs through library code cannot be moved by the user: the fix is the
framework's own switch. Each rule looks at the library frames between the user's entry line
(`trainer.train()`, `trainer.fit(...)`) and the CUDA call, innermost first, with a few source lines
above each frame (a condition split over lines names its setting on the line before)."""
from __future__ import annotations

from types import FrameType
from typing import NamedTuple

from ._frames import Frame

__all__ = ["FrameworkFix", "framework_fix", "stack_framework"]


class FrameworkFix(NamedTuple):
    framework: str         # "transformers" | "lightning" | "torchmetrics" | "accelerate" | "wandb"
    frame: Frame           # the library line the rule matched
    fix: str
    setting: str = ""      # what the fix changes, in a word or two (the finding's title says it)


_MASKS = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa",
          "_ignore_bidirectional_mask_sdpa", "_preprocess_mask_arguments", "padding_mask_function")


def _package(frame: Frame) -> str:
    path = frame.file.replace("\\", "/")
    for name in ("transformers", "accelerate", "torchmetrics", "pytorch_lightning",
                 "lightning_fabric", "lightning", "wandb"):
        if f"/{name}/" in path:
            return "lightning" if name.startswith(("pytorch_lightning", "lightning")) else name
    return ""


def _hf(frame: Frame, text: str) -> tuple[str, str] | None:
    if "logging_nan_inf_filter" in text:
        return ("TrainingArguments(logging_nan_inf_filter=False): the Trainer checks every step's "
                "loss for NaN/Inf with a host read (a sync per step); or log through syncless.hf, "
                "which keeps the loss on the GPU", "logging_nan_inf_filter")
    if "num_input_tokens_seen" in text or frame.function == "_track_num_input_tokens":
        return ("TrainingArguments(include_num_input_tokens_seen='no'): counting the tokens seen "
                "reads a GPU sum on the host every step", "include_num_input_tokens_seen")
    if frame.function in _MASKS or frame.file.replace("\\", "/").endswith("/masking_utils.py"):
        # transformers 5: without an attention_mask it checks position_ids for packed sequences,
        # with one it checks the mask for padding (to skip building it): a host read either way,
        # skipped only while the model is traced.
        return ("transformers' attention-mask code reads the batch on the host once per forward "
                "(the packed-sequence check when the batch has no attention_mask, the padding "
                "check when it has one): no TrainingArguments setting removes it; a compiled "
                "model skips it (TrainingArguments(torch_compile=True))", "mask checks")
    return None


def _accelerate(frame: Frame, text: str) -> tuple[str, str] | None:
    if frame.function in ("send_to_device", "_send_to_device") or "send_to_device" in text:
        return ("the batch is copied to the GPU with non_blocking=False (torch syncs after such a "
                "copy): TrainingArguments(accelerator_config={'non_blocking': True}) with "
                "dataloader_pin_memory=True (accelerate: DataLoaderConfiguration(non_blocking="
                "True))", "blocking batch copy")
    return None


def _lightning(frames: tuple[Frame, ...], frame: Frame, text: str) -> tuple[str, str] | None:
    if any("/progress/" in f.file.replace("\\", "/") or "progress_bar" in f.function
           for f in frames):
        return ("self.log(..., prog_bar=True) reads each such metric with .item() every batch "
                "for the progress bar: log it with prog_bar=False (or "
                "Trainer(enable_progress_bar=False)), or use the syncless.lightning integration",
                "prog_bar")
    if "to_tensor" in frame.function or "torch.tensor(value" in text:
        return ("self.log(name, <Python float>) copies the number to the GPU at every call (a "
                "blocking host-to-device copy): log a tensor that is already on the device, or "
                "log the value less often (on_step=False)", "self.log(float)")
    return None


def _torchmetrics(frame: Frame, text: str) -> tuple[str, str] | None:
    if "nan" in text.lower() or "nan" in frame.function:
        return ("the metric checks every update for NaN with a host read: construct it with "
                "nan_strategy='disable' (no check) when the inputs cannot hold NaN",
                "nan_strategy")
    return None


def _wandb(frames: tuple[Frame, ...], frame: Frame, text: str) -> tuple[str, str] | None:
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
        if pkg == "transformers":
            fix = _hf(frame, text)
        elif pkg == "accelerate":
            fix = _accelerate(frame, text)
        elif pkg == "lightning":
            fix = _lightning(chain, frame, text)
        elif pkg == "wandb":
            fix = _wandb(chain, frame, text)
        else:
            fix = _torchmetrics(frame, text)
        if fix:
            return FrameworkFix(pkg, frame, *fix)
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
