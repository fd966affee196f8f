"""The doctor's report on a loop with two planted problems, for the README.

    python benchmarks/doctor_example.py > benchmarks/results/doctor_example.txt

The loop logs four metrics with .item() each (four syncs per step) and reads its images through a
num_workers=0 DataLoader whose transform does real CPU work on every sample.
"""
import torch
from torch.utils.data import DataLoader, Dataset

import syncless


class Images(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        img = torch.rand(3, 96, 96, generator=g)
        for _ in range(4):                                   # "decode + augment" on the CPU
            img = torch.nn.functional.avg_pool2d(img[None], 3, 1, 1)[0].flip(-1)
        return img, i % 10


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(),
                                torch.nn.Linear(64 * 64, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = []
    loader = DataLoader(Images(), batch_size=64, num_workers=0, shuffle=True)

    def train_step(batch):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        history.append((loss.item(), acc.item(), gn.item(), logits.max().item()))

    syncless.doctor(train_step, steps=20, loader=loader)


if __name__ == "__main__":
    main()
