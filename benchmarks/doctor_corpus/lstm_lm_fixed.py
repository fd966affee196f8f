"""A character-level LSTM language model in the style of pytorch/examples/word_language_model:
batches cut from the text and encoded in Python each step, parameters updated by hand
(`p.data.add_(p.grad, alpha=-lr)`, no torch.optim). The fixed twin of lstm_lm.py: the loss is
summed on the GPU and read once per log interval, so encoding the next batch overlaps the GPU."""
import argparse
import math
import random

import torch
import torch.nn as nn

from _timing import StepClock


def make_text(n_chars, seed=0):
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


class CharLSTM(nn.Module):
    def __init__(self, vocab, emb, hidden, layers):
        super().__init__()
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x, hidden=None):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(out), hidden


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    args = p.parse_args(argv)
    device = args.device
    cpu = device == "cpu"
    # On the GPU: 512 sequences of 32 characters, hidden 1536. The first sizing (256, hidden
    # 1024) was launch-bound with or without the sync: cuDNN's LSTM launches kernels per time
    # step, and the host's 7.2 ms outlasted the GPU's 6.0 ms, so the .item() cost ~nothing.
    # Here the GPU's work (13.5 ms on an H200) outlasts the host's (11 ms), so the bottleneck is
    # the sync alone.
    batch, seq = (8, 32) if cpu else (512, 32)
    batch = args.batch or batch
    hidden = args.hidden or (64 if cpu else 1536)
    text = make_text(200_000 if cpu else 2_000_000)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}

    def get_batch():
        starts = [random.randrange(len(text) - seq - 1) for _ in range(batch)]
        ids = torch.tensor([[stoi[c] for c in text[s:s + seq + 1]] for s in starts])
        if not cpu:
            ids = ids.pin_memory().to(device, non_blocking=True)
        return ids[:, :-1], ids[:, 1:]

    torch.manual_seed(0)
    random.seed(0)
    model = CharLSTM(len(chars), 64 if cpu else 256, hidden, 2).to(device)
    criterion = nn.CrossEntropyLoss()
    clock = StepClock(device)
    total_loss = torch.zeros((), device=device)
    model.train()
    for step in range(1, args.steps + 1):
        data, targets = get_batch()
        model.zero_grad()
        output, _ = model(data)
        loss = criterion(output.reshape(-1, len(chars)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p_ in model.parameters():
            p_.data.add_(p_.grad, alpha=-args.lr)
        total_loss += loss.detach()
        if step % args.log_interval == 0:
            cur = total_loss.item() / args.log_interval
            print(f"step {step} loss {cur:.3f} ppl {math.exp(cur):.2f}")
            total_loss.zero_()
        clock.tick()
    clock.report()


if __name__ == "__main__":
    main()
