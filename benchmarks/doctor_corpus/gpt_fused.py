"""A small character-level GPT trained in the style of nanoGPT: bf16 autocast, fused AdamW,
batches sliced from a uint16 token array on the CPU and copied pinned/non_blocking. Known
bottleneck: kernel launches (hundreds of small kernels per step; CPU-bound)."""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from _timing import StepClock


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, block, d, layers, heads):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.tok.weight = self.head.weight

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--log-interval", type=int, default=10)
    args = p.parse_args()
    device = args.device
    cpu = device == "cpu"
    batch, block, d, layers, heads, vocab = (4, 32, 64, 2, 2, 65) if cpu else \
        (16, 128, 384, 6, 6, 65)
    rng = np.random.default_rng(0)
    data = rng.integers(0, vocab, size=1_000_000, dtype=np.uint16)

    def get_batch():
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        if cpu:
            return x, y
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))

    torch.manual_seed(1337)
    model = GPT(vocab, block, d, layers, heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99),
                                  weight_decay=0.1, fused=not cpu)
    ctx = torch.autocast(device_type="cuda" if not cpu else "cpu", dtype=torch.bfloat16)
    clock = StepClock(device)
    for it in range(args.steps):
        lr = 1e-3 * min(1.0, (it + 1) / 100)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch()
        with ctx:
            loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if it % args.log_interval == 0:
            print(f"iter {it}: loss {loss.item():.4f} ppl {math.exp(min(20.0, loss.item())):.1f}")
        clock.tick()
    clock.report()


if __name__ == "__main__":
    main()
