"""The seeds' ToyModel split over two devices with devmap.dispatch, then one training step.

Shows: an explicit device map ({module: device}) placed like `from_pretrained(device_map=...)`; the output
comes back on the input's device; gradients equal those of the plain model.
Run: python examples/toy_two_devices.py   (two GPUs when there are two, else both halves on the CPU)
"""

import copy

import torch
from torch import nn

import devmap

DEVICES = [0, 1] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main() -> None:
    torch.manual_seed(0)
    plain = ToyModel()
    model = devmap.dispatch(copy.deepcopy(plain), {"net1": DEVICES[0], "relu": DEVICES[0], "net2": DEVICES[1]})
    print("device map:", model.hf_device_map)

    x, labels = torch.randn(20, 10), torch.randn(20, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    optimizer.zero_grad()
    loss = nn.MSELoss()(model(x), labels)  # the output is back on the input's device (the CPU here)
    loss.backward()
    nn.MSELoss()(plain(x), labels).backward()
    same = all(torch.allclose(a.grad.cpu(), b.grad, atol=1e-6) for a, b in zip(model.parameters(), plain.parameters()))
    optimizer.step()
    print(f"loss {loss.item():.4f}; gradients equal the plain model's: {same}")
    assert same


if __name__ == "__main__":
    main()
