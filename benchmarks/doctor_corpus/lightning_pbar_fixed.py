"""A Lightning module training a small Transformer language model, its loss logged with
`self.log(...)`. The fixed twin of lightning_pbar.py: the loss is logged with prog_bar=False, as the
doctor prescribes, so the progress bar no longer reads it on the host after every batch."""
import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from _timing import StepClock

PROG_BAR = False


class LitLM(L.LightningModule):
    def __init__(self, vocab, d, layers, heads, block, clock):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, block, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block))
        self.clock = clock

    def forward(self, x):
        h = self.encoder(self.embed(x) + self.pos, mask=self.mask, is_causal=True)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=PROG_BAR)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.clock.tick()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=None)
    args = p.parse_args()
    cpu = args.device == "cpu"
    vocab, d, layers, heads, block, batch = (256, 64, 2, 2, 32, 4) if cpu else \
        (4096, 512, 6, 8, 256, 16)
    batch = args.batch or batch
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (4096, block + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch,
                        shuffle=True)
    clock = StepClock(args.device)
    model = LitLM(vocab, d, layers, heads, block, clock)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu" if cpu else "gpu", devices=1,
                        enable_checkpointing=False, enable_model_summary=False, logger=False)
    trainer.fit(model, loader)
    clock.report()


if __name__ == "__main__":
    main()
