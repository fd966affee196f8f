"""ImageNet-style training of a small ResNet (after pytorch/examples/imagenet): images decoded and
augmented on the CPU in 2 loader workers. Known bottleneck: the loader (data-bound)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from _timing import StepClock


class SyntheticImageNet(Dataset):
    """Stands in for an ImageFolder of JPEGs: each sample is "decoded" (smoothing passes cost
    about what a JPEG decode and resize cost) and augmented on the CPU."""

    def __init__(self, n, size, crop, passes):
        self.n, self.size, self.crop, self.passes = n, size, crop, passes
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        raw = torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)
        img = raw.float().div_(255)[None]
        for _ in range(self.passes):                          # decode + resize
            img = F.avg_pool2d(img, 3, 1, 1)
        img = img[0]
        top, left = torch.randint(0, self.size - self.crop + 1, (2,), generator=g).tolist()
        img = img[:, top:top + self.crop, left:left + self.crop]   # RandomResizedCrop
        if torch.rand(1, generator=g).item() < 0.5:                # RandomHorizontalFlip
            img = img.flip(-1)
        return (img - self.mean) / self.std, i % 100


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512), blocks=2, classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                layers.append(BasicBlock(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("-j", "--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("-p", "--print-freq", type=int, default=10)
    args = p.parse_args()
    device = args.device
    cpu = device == "cpu"
    torch.manual_seed(0)
    dataset = SyntheticImageNet(64 * 1000, 40 if cpu else 80, 32 if cpu else 64, 2 if cpu else 6)
    loader = DataLoader(dataset, batch_size=16 if cpu else 64, shuffle=True,
                        num_workers=args.workers, pin_memory=not cpu)
    model = ResNet((8, 16, 32, 64) if cpu else (64, 128, 256, 512), 1 if cpu else 2).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    clock = StepClock(device)
    model.train()
    step = 0
    while step < args.steps:
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.print_freq == 0:
                print(f"step {step} loss {loss.item():.4f}")
            clock.tick()
            step += 1
            if step == args.steps:
                break
    clock.report()


if __name__ == "__main__":
    main()
