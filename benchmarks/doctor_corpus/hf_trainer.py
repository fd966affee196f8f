"""Causal-LM training with the Hugging Face Trainer: a GPT-2 built from a config (no download), a
dataset of token blocks, TrainingArguments left at their defaults. Known bottleneck: the syncs
those defaults make every step (the loss's NaN/Inf filter, the blocking batch copy), each
leaving the GPU idle while the Trainer's host code runs."""
import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback

from _timing import StepClock


class TokenBlocks(torch.utils.data.Dataset):
    def __init__(self, n, block, vocab, mask=False):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, block), generator=g)
        self.mask = torch.ones(block, dtype=torch.long) if mask else None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        item = {"input_ids": self.ids[i], "labels": self.ids[i]}
        if self.mask is not None:
            item["attention_mask"] = self.mask
        return item


class Clock(TrainerCallback):
    def __init__(self, clock):
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick()


def training_args(out, cpu, steps, batch, workers):
    # 48 sequences on the GPU: at 16 (17.5 ms of kernels) the host's ~17 ms of Trainer and
    # model code kept pace with the GPU only just, so the twin was host-bound under the
    # profiler and the sync transformers' mask code makes every forward still cost ~3% of it.
    return TrainingArguments(output_dir=out,
                             per_device_train_batch_size=batch or (4 if cpu else 48),
                             dataloader_num_workers=workers,
                             max_steps=steps, learning_rate=3e-4, report_to="none",
                             save_strategy="no", disable_tqdm=True, use_cpu=cpu)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--attention-mask", action="store_true")
    args = p.parse_args()
    cpu = args.device == "cpu"
    torch.manual_seed(0)
    if cpu:
        config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                            bos_token_id=0, eos_token_id=0)
    else:
        config = GPT2Config(vocab_size=4096, n_positions=256, n_embd=512, n_layer=6, n_head=8,
                            bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = TokenBlocks(4096, config.n_positions, config.vocab_size, args.attention_mask)
    clock = StepClock(args.device)
    with tempfile.TemporaryDirectory() as out:
        targs = training_args(out, cpu, args.steps, args.batch, args.workers)
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock(clock)])
        trainer.train()
    clock.report()


if __name__ == "__main__":
    main()
