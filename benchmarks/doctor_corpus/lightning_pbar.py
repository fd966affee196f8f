"""A Lightning module training a small Transformer language model, its loss logged with
`self.log(..., prog_bar=True)` as the Lightning docs show. Known bottleneck: the progress bar reads
that metric with .item() after every batch, a sync that leaves the GPU idle while Lightning
prepares the next batch."""
import argparse
import random

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from _timing import StepClock

PROG_BAR = True


class TextWindows(Dataset):
    """Windows of a text, split into words and encoded in Python per item (a word-level
    tokenizer), on the training thread: the DataLoader keeps its default num_workers=0."""

    def __init__(self, vocab, block, n_words, seed=0):
        rng = random.Random(seed)
        words = [f"w{i}" for i in range(vocab - 1)]
        self.stoi = {w: i + 1 for i, w in enumerate(words)}      # 0: unknown
        self.text = " ".join(words[min(int(rng.paretovariate(1.1)) - 1, vocab - 2)]
                             for _ in range(n_words))
        self.block = block
        self.span = 8 * (block + 1)            # characters that hold block + 1 words

    def __len__(self):
        return (len(self.text) - self.span) // self.span

    def __getitem__(self, i):
        words = self.text[i * self.span:(i + 1) * self.span].split()[1:self.block + 2]
        ids = torch.tensor([self.stoi.get(w, 0) for w in words])
        return ids[:-1], ids[1:]


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
    p.add_argument("--tokens", action="store_true",
                   help="random token blocks in a TensorDataset instead of encoded text")
    args = p.parse_args()
    cpu = args.device == "cpu"
    vocab, d, layers, heads, block, batch = (256, 64, 2, 2, 32, 4) if cpu else \
        (4096, 512, 6, 8, 256, 32)
    batch = args.batch or batch
    torch.manual_seed(0)
    if args.tokens:
        tokens = torch.randint(0, vocab, (4096, block + 1))
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    else:
        data = TextWindows(vocab, block, 600 * (block + 1) if cpu else 1_200_000)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    clock = StepClock(args.device)
    model = LitLM(vocab, d, layers, heads, block, clock)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu" if cpu else "gpu", devices=1,
                        enable_checkpointing=False, enable_model_summary=False, logger=False)
    trainer.fit(model, loader)
    clock.report()


if __name__ == "__main__":
    main()
