"""A GPT trained the way nanoGPT trains it, compiled, with its metrics logged from inside the model.

    python -m benchmarks.compile_user [--device cuda|cpu] [--mode default|reduce-overhead]
                                      [--quick] [--rounds N] [--out [DIR]]

The script a user writes, not one written for syncless: nanoGPT's model (pre-LayerNorm blocks,
causal self-attention through F.scaled_dot_product_attention, a GELU MLP, tied embeddings,
forward(idx, targets) -> logits, loss), AdamW (fused on CUDA) with weight decay on the matrices
only, bf16 autocast, clip_grad_norm_(1.0), a linear warm-up then cosine lr written into
param_groups each step, and `model = torch.compile(model)` (--mode: nanoGPT's default mode, or
"reduce-overhead", CUDA graphs). The data is a token stream from a fixed random Markov chain
(four successors per token), so the loss falls as it would on text. Variants, each with its own
model copy, optimizer and compiled model (its forward a code object of its own: see
compile_step.own_code), taking turns of --steps steps in interleaved rounds:
  no logging          the floor
  .item() every step  nanoGPT's own logging at log_interval=1: loss.item() and the token
                      accuracy's .item(), two syncs a step
  log() in the loop   syncless, in the loop: log(loss=loss, acc=acc), acc computed from the
                      returned logits, as .item() does it
  log() in the model  syncless inside the compiled forward: the model logs loss and acc where
                      it computes them (syncless::log in the graph); the loop logs nothing.
                      Under reduce-overhead the loop calls log.flush(wait=False) every 100
                      steps, as the README tells users of CUDA graphs to
Per variant: ms per step (median over rounds), the per-round ratio to no logging with the 95% CI
of its median, syncs per step (torch's sync-debug mode over 110 steps, a flush included), graph
breaks (torch._dynamo.explain on the compiled model), and, in a run apart with every step's loss
and accuracy kept, whether every delivered row equals that step's values (steps consecutive,
none lost). --out writes compile_user-<mode>.json/.md (default directory: benchmarks/results).
"""
from __future__ import annotations

import argparse
import copy
import gc
import inspect
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import (SyncCount, env_info, md_table, median_ci, num,  # noqa: E402
                                paired_ratios, pct, pct_ci, summarize, write_results)
from benchmarks.compile_step import own_code  # noqa: E402

VARIANTS = ("no logging", ".item() every step", "log() in the loop", "log() in the model")
FLUSH_EVERY = 100


# ---- the model, as nanoGPT writes it -------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_embd, n_head, log=None):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight                  # weight tying
        self.log = log                                         # a syncless.Logger, or None

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            if self.log is not None:
                acc = (logits.argmax(-1) == targets).float().mean()
                self.log(loss=loss, acc=acc)
        return logits, loss


def gpt_class(name):
    """GPT with a forward of its own for each variant: one compiled model per script, as a
    user has, not several sharing Dynamo's cache and cudagraph roots."""
    tag = "".join(c if c.isalnum() else "_" for c in name)
    return type(f"GPT_{tag}", (GPT,), {"forward": own_code(GPT.forward, tag)})


def configure_optimizer(model, lr, weight_decay, device):
    """nanoGPT's: decay the matrices and embeddings, not the biases and norms; fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), **({"fused": True} if fused else {}))


def get_lr(it, warmup, max_iters, lr, min_lr):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, max_iters - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def markov_batches(vocab, block, batch, n, device, seed=0):
    """n (x, y) batches from one token stream of a fixed random Markov chain."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=gen)
    length = n * batch * (block + 1)
    choice = torch.randint(0, 4, (length,), generator=gen)
    stream = torch.empty(length, dtype=torch.long)
    tok = 0
    for i in range(length):
        tok = int(succ[tok, choice[i]])
        stream[i] = tok
    chunks = stream.view(n, batch, block + 1)
    return [(c[:, :-1].contiguous().to(device), c[:, 1:].contiguous().to(device)) for c in chunks]


# ---- a variant: its model, optimizer, logger and training step -----------------------------------

class Rows:
    def __init__(self):
        self.rows = []

    def write(self, rows):
        self.rows.extend(rows)


class Variant:
    def __init__(self, name, base, args, device, mode):
        import syncless
        self.name = name
        self.device = device
        self.mode = mode
        self.args = args
        self.sink = Rows()
        self.log = (syncless.Logger(every=FLUSH_EVERY, sinks=self.sink)
                    if name.startswith("log()") else None)
        model = gpt_class(name)(*base["config"])
        model.load_state_dict(base["state"])
        model.to(device)
        model.log = self.log if name == "log() in the model" else None
        self.raw = model
        self.opt = configure_optimizer(model, args.lr, 0.1, device)
        self.model = torch.compile(model, mode=None if mode == "default" else mode)
        self.it = 0
        self.history = []                                # what .item() logging reads
        self.kept = None                                 # (loss, acc) per step, when checking

    def step(self, x, y):
        a = self.args
        lr = get_lr(self.it, 20, a.max_iters, a.lr, a.lr / 10)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            logits, loss = self.model(x, y)
        need_acc = self.name in (".item() every step", "log() in the loop") or self.kept is not None
        acc = (logits.argmax(-1) == y).float().mean() if need_acc else None
        if self.kept is not None:          # a replay may overwrite its outputs: copies, now
            self.kept.append((loss.detach().clone(), acc.clone()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.name == ".item() every step":
            self.history.append((loss.item(), acc.item()))
        elif self.name == "log() in the loop":
            self.log(loss=loss, acc=acc)
        elif (self.name == "log() in the model" and self.mode == "reduce-overhead"
              and (self.it + 1) % FLUSH_EVERY == 0):
            self.log.flush(wait=False)         # replays do not flush: the README's advice
        self.it += 1


def run_turn(v, batches, start, n, sync):
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        v.step(*batches[(start + i) % len(batches)])
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def check_rows(name, base, args, device, mode, batches, steps, sync):
    """A run apart: every step's loss and acc kept, then every delivered row compared."""
    v = Variant(name, base, args, device, mode)
    v.kept = []
    for i in range(steps):
        v.step(*batches[i % len(batches)])
    sync()
    v.log.close()
    rows = v.sink.rows
    exact = (len(rows) == steps and [r.step for r in rows] == list(range(steps)) and all(
        r.values["loss"] == float(loss) and r.values["acc"] == float(acc)
        for r, (loss, acc) in zip(rows, v.kept)))
    return {"rows": len(rows), "steps": steps, "exact": exact, "lost": v.log.stats.lost,
            "first_loss": rows[0].values["loss"] if rows else None,
            "last_loss": rows[-1].values["loss"] if rows else None}


def graph_breaks(v, x, y):
    """Breaks in the variant's compiled forward (explain on a copy of its model)."""
    log, v.raw.log = v.raw.log, None                     # a Logger is not copied
    try:
        model = copy.deepcopy(v.raw)
    finally:
        v.raw.log = log
    model.log = log
    with torch.autocast(v.device.type, dtype=torch.bfloat16, enabled=v.device.type == "cuda"):
        e = torch._dynamo.explain(model)(x, y)
    torch._dynamo.reset()
    return len(e.break_reasons), e.graph_count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="default", choices=("default", "reduce-overhead"))
    p.add_argument("--quick", action="store_true", help="a tiny model and few rounds: a smoke test")
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--steps", type=int, default=10, help="steps per variant per turn")
    p.add_argument("--check-steps", type=int, default=250, help="steps of the exactness run")
    p.add_argument("--out", nargs="?", const=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.quick:
        vocab, block, n_layer, n_embd, n_head, batch = 256, 32, 1, 32, 2, 4
        args.rounds, args.steps, args.check_steps = min(args.rounds, 3), 5, 30
    else:
        vocab, block, n_layer, n_embd, n_head, batch = 4096, 256, 4, 384, 6, 16
    args.lr = 6e-4
    args.max_iters = 20 + args.rounds * args.steps + 100
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    argv_used = sys.argv[1:] if argv is None else argv
    env = env_info(device, ["compile_user", *argv_used])
    env["command"] = " ".join(["python", "-m", "benchmarks.compile_user", *argv_used])
    torch.manual_seed(0)
    config = (vocab, block, n_layer, n_embd, n_head)
    base = {"config": config, "state": GPT(*config).state_dict()}
    batches = markov_batches(vocab, block, batch, 32, device)
    print(f"GPT {n_layer} layers x {n_embd}, vocab {vocab}, block {block}, batch {batch}, "
          f"mode={args.mode}, device {device}", flush=True)

    variants = {name: Variant(name, base, args, device, args.mode) for name in VARIANTS}
    breaks = {name: graph_breaks(v, *batches[0]) for name, v in variants.items()}
    for name, v in variants.items():                        # compile, warm up, record
        run_turn(v, batches, 0, 20, sync)
    syncs = dict.fromkeys(VARIANTS)                         # counted on CUDA only
    for name, v in variants.items() if cuda else ():
        count = SyncCount()
        count.start()
        for i in range(FLUSH_EVERY + 10):                    # a flush included
            v.step(*batches[i % len(batches)])
        count.stop()
        syncs[name] = count.count / (FLUSH_EVERY + 10)
    rng = random.Random(0)
    ms = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS)
        rng.shuffle(order)
        gc.collect()
        for name in order:
            ms[name].append(run_turn(variants[name], batches, r * args.steps, args.steps, sync))
    for v in variants.values():
        if v.log is not None:
            v.log.close()
    checks = {name: check_rows(name, base, args, device, args.mode, batches, args.check_steps,
                               sync) for name in VARIANTS if name.startswith("log()")}

    rows, results = [], {}
    for name in VARIANTS:
        ratios = paired_ratios(ms, name, "no logging")
        ci = median_ci(ratios)
        s = summarize(ms[name])
        c = checks.get(name)
        results[name] = {"ms_per_step": s, "ratio": summarize(ratios), "ratio_ci95": ci,
                         "syncs_per_step": syncs[name], "graph_breaks": breaks[name][0],
                         "graphs": breaks[name][1], "check": c}
        rows.append([name, num(s["median"]),
                     "1" if name == "no logging" else pct(results[name]["ratio"]["median"], 2),
                     "" if name == "no logging" else pct_ci(ci), num(syncs[name]),
                     breaks[name][0], breaks[name][1],
                     "" if c is None else f"{c['rows']}/{c['steps']}, exact={c['exact']}, "
                                          f"lost={c['lost']}, loss {c['first_loss']:.3f} → "
                                          f"{c['last_loss']:.3f}"])
    table = md_table(["variant", "ms per step (median)", "vs no logging", "95% CI",
                      "syncs per step", "graph breaks", "graphs",
                      "rows checked (delivered/steps, every value exact)"], rows)
    inside, loop = results["log() in the model"], results["log() in the loop"]
    item = results[".item() every step"]
    verdict = (f"mode={args.mode}: log() in the model {pct(inside['ratio']['median'], 2)} vs no "
               f"logging, 95% CI {pct_ci(inside['ratio_ci95'])}, {num(inside['syncs_per_step'])} "
               f"syncs/step, {inside['graph_breaks']} graph breaks; log() in the loop "
               f"{pct(loop['ratio']['median'], 2)} {pct_ci(loop['ratio_ci95'])}; .item() every "
               f"step {pct(item['ratio']['median'], 2)} {pct_ci(item['ratio_ci95'])}, "
               f"{num(item['syncs_per_step'])} syncs/step")
    text = (f"GPT {n_layer} layers × {n_embd} (vocab {vocab}, block {block}, batch {batch}), "
            f"bf16 autocast, fused AdamW, clip_grad_norm_, cosine lr; "
            f"`torch.compile(model{'' if args.mode == 'default' else ', mode=' + repr(args.mode)})`"
            f"; {args.rounds} interleaved rounds of {args.steps} steps per variant.\n\n"
            f"{table}\n\n- {verdict}\n")
    write_results(args.out, f"compile_user-{args.mode}",
                  {"env": env, "quick": args.quick, "results": results, "verdict": verdict}, text)
    return results


if __name__ == "__main__":
    main()
