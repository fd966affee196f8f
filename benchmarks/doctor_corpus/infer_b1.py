"""Batch-1 inference latency of a small image classifier (a ResNet-style network at 96x96),
one request at a time, predictions kept on the GPU until the end. No optimizer, no backward, no
DataLoader: a step is one call of the model. Known bottleneck: kernel launches (CPU-bound)."""
import argparse

import torch

from _timing import StepClock
from resnet_decode import ResNet


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=5000)
    args = p.parse_args()
    device = args.device
    cpu = device == "cpu"
    torch.manual_seed(0)
    model = ResNet((8, 16, 32, 64) if cpu else (32, 64, 128, 256), 1 if cpu else 2).to(device)
    model.eval()
    size = 32 if cpu else 96
    requests = [torch.randn(1, 3, size, size, device=device) for _ in range(64)]
    preds = []
    clock = StepClock(device)
    with torch.inference_mode():
        for i in range(args.steps):
            logits = model(requests[i % len(requests)])
            preds.append(logits.argmax(1))
            clock.tick()
    clock.report()
    print("predicted classes:", torch.cat(preds)[:8].tolist())


if __name__ == "__main__":
    main()
