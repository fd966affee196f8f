"""A small character-level GPT trained in the style of nanoGPT: bf16 autocast, fused AdamW,
batches sliced from a uint16 token array on the CPU. The fixed twin of gpt_fused.py: the whole
step (forward, backward, clipping, AdamW(fused=True, capturable=True)) captured once in a CUDA
graph and replayed, so one launch replaces hundreds. (On the CPU it runs the plain step.)"""
import argparse

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
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=device)
                                  if not cpu else 1e-3, betas=(0.9, 0.99), weight_decay=0.1,
                                  fused=not cpu, capturable=not cpu)
    # Graph capture cannot use the autocast cache (its casts would be captured once).
    ctx = torch.autocast(device_type="cuda" if not cpu else "cpu", dtype=torch.bfloat16,
                         cache_enabled=False)

    def train_step(x, y):
        with ctx:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    clock = StepClock(device)
    if cpu:
        for it in range(args.steps):
            x, y = get_batch()
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(x, y)
            if it % args.log_interval == 0:
                print(f"iter {it}: loss {loss.item():.4f}")
            clock.tick()
        clock.report()
        return
    static_x, static_y = get_batch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warm up before capture
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            train_step(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = train_step(static_x, static_y)
    for it in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"].fill_(1e-3 * min(1.0, (it + 1) / 100))
        x, y = get_batch()
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        g.replay()
        if it % args.log_interval == 0:
            print(f"iter {it}: loss {static_loss.item():.4f}")
        clock.tick()
    clock.report()


if __name__ == "__main__":
    main()
