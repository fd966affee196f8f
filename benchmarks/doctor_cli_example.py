"""A plain training script for the command-line doctor's README example:

    python -m syncless doctor --trace /tmp/trace.json benchmarks/doctor_cli_example.py \
        > benchmarks/results/doctor_cli_example.txt

A small MLP trained on batches of 8: hundreds of tiny kernels per step, so the CPU issuing them is
the bottleneck (launch-bound). The script knows nothing of syncless.
"""
import torch
from torch import nn


def main(steps: int = 200) -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = []
    for _ in range(12):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 256, device=device)
    y = torch.randint(10, (8,), device=device)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
