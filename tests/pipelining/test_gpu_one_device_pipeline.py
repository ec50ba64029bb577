"""GPU-only, one GPU: several pipeline stages on one device give the plain model's outputs and gradients, with
CUDA graphs whose micro-batches share one memory pool per stage, and that pool reserves about what eager does."""

import copy

import pytest
import torch
import torchvision
from torch import nn

from devmap.pipelining import pipeline
from devmap.testing import require_gpus

pytestmark = require_gpus(1)

GPU = torch.device("cuda:0")


def resnet_stages(seed=0, cuts=("layer2", "layer3")):
    """The plain ResNet50 and a copy cut into stages (after each block named in `cuts`), every stage on cuda:0."""
    torch.manual_seed(seed)
    plain = torchvision.models.resnet50().to(GPU)
    model = copy.deepcopy(plain)
    stages, current = [], []
    for name, child in model.named_children():
        current.append(child)
        if name == "avgpool":
            current.append(nn.Flatten(1))
        if name in cuts:
            stages.append((nn.Sequential(*current), GPU))
            current = []
    stages.append((nn.Sequential(*current), GPU))
    return plain, model, stages


@pytest.fixture(autouse=True)
def exact_math(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 alone moves gradients by ~1e-3
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products


@pytest.mark.parametrize("deferred", [1, None])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_stages_on_one_gpu_give_the_plain_models_outputs_and_grads(chunks, deferred):
    plain, model, stages = resnet_stages()
    pipe = pipeline(stages, chunks=chunks, graphs="on", deferred_weights=deferred)
    x = torch.randn(12, 3, 64, 64, device=GPU)
    for step in range(3):  # capture, then replay twice (the shared pool is reused across passes)
        for p in list(model.parameters()) + list(plain.parameters()):
            p.grad = None
        out = pipe(x)
        expected = torch.cat([plain(mb) for mb in pipe.micro_batches(x)])
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        out.square().mean().backward()
        expected.square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-3, msg=name)
        with torch.no_grad():  # a step between passes: the graphs read parameters in place. Both models take the
            for p, q in zip(model.parameters(), plain.parameters()):  # same step, so their outputs stay equal
                p -= 0.1 * q.grad
                q -= 0.1 * q.grad
    assert not pipe.graph_failures
    pools = {g.pool for row in next(iter(pipe._graphs.values())) for g in row}
    assert len(pools) == len(stages)  # one pool per stage, shared by its micro-batches


def _reserved_for_a_step(pipe, x, steps=2):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    for _ in range(steps):
        pipe(x).square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() - before


def test_graph_pools_reserve_about_what_eager_reserves():
    _, model, stages = resnet_stages(cuts=("layer3",))
    x = torch.randn(96, 3, 224, 224, device=GPU)  # gigabytes of activations: the allocator's fixed costs are noise
    eager = _reserved_for_a_step(pipeline(stages, chunks=4, graphs="off"), x)
    for p in model.parameters():
        p.grad = None
    graphed_pipe = pipeline(stages, chunks=4, graphs="on")
    graphed = _reserved_for_a_step(graphed_pipe, x)
    assert not graphed_pipe.graph_failures
    # one pool per micro-batch reserved ~1.4x eager (each kept its own backward scratch); one per stage reuses it
    assert graphed <= 1.10 * eager, (graphed / 2**20, eager / 2**20)


def test_an_inference_pipeline_on_one_gpu_equals_the_plain_model():
    plain, _, stages = resnet_stages()
    plain.eval()
    pipe = pipeline(stages, chunks=4, graphs="on").eval()
    x = torch.randn(16, 3, 64, 64, device=GPU)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(pipe(x), plain(x), atol=1e-4, rtol=1e-4)
