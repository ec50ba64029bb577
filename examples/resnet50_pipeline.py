"""ResNet50 split like the PyTorch tutorial (after layer2) and trained as a micro-batch pipeline with devmap.

Shows: devmap.pipeline over explicit stages (they work at the same time; on GPUs each (stage, micro-batch)
is replayed as a CUDA graph), and a few SGD steps. A placed model (devmap.load / dispatch) pipelines the same
way: devmap.pipeline(model, chunks=4).
Run: python examples/resnet50_pipeline.py [--batch-size 120 --image-size 128 --chunks 4 --steps 5]
Two GPUs when there are two; else both stages on the CPU (use small sizes there).
"""

import argparse
import time

import torch
import torchvision
from torch import nn

import devmap

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=120)
parser.add_argument("--image-size", type=int, default=128)
parser.add_argument("--chunks", type=int, default=4)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

first, second = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cpu", "cpu")
# The tutorial's split: the stem, layer1 and layer2 on the first device, the rest on the second. Explicit
# stages, so the CPU run has two stages too (a device map puts consecutive blocks on one device in one stage).
resnet = torchvision.models.resnet50(num_classes=1000)
front = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool, resnet.layer1, resnet.layer2)
back = nn.Sequential(resnet.layer3, resnet.layer4, resnet.avgpool, nn.Flatten(), resnet.fc)
pipe = devmap.pipeline([(front.to(first), first), (back.to(second), second)], chunks=args.chunks)
print("stages on", [str(d) for d in pipe.devices], f"· {args.chunks} micro-batches per batch")

inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=pipe.devices[0])
labels = torch.zeros(args.batch_size, 1000, device=pipe.devices[-1]).scatter_(
    1, torch.randint(0, 1000, (args.batch_size, 1), device=pipe.devices[-1]), 1)
optimizer = torch.optim.SGD(pipe.parameters(), lr=0.001)
loss_fn = nn.MSELoss()
for step in range(args.steps):
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(pipe(inputs), labels)
    loss.backward()
    optimizer.step()
    for device in set(pipe.devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    print(f"step {step}: loss {loss.item():.5f} in {time.perf_counter() - start:.3f} s")
