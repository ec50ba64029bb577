"""GPU-only: the pipeline on two GPUs gives the plain model's outputs and gradients, and both GPUs work at once."""

import copy

import pytest
import torch
import torchvision

from devmap import dispatch
from devmap.pipelining import pipeline
from devmap.testing import require_gpus

pytestmark = require_gpus(2)

TUTORIAL_SPLIT = {"conv1": 0, "bn1": 0, "relu": 0, "maxpool": 0, "layer1": 0, "layer2": 0,
                  "layer3": 1, "layer4": 1, "avgpool": 1, "fc": 1}


def placed_resnet(seed=0):
    torch.manual_seed(seed)
    plain = torchvision.models.resnet50()
    model = copy.deepcopy(plain)
    dispatch(model, TUTORIAL_SPLIT)
    return plain.to("cuda:0"), model


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_two_gpus_same_outputs_and_grads(graphs, chunks):
    plain, model = placed_resnet()
    pipe = pipeline(model, chunks=chunks, graphs=graphs)
    assert [str(d) for d in pipe.devices] == ["cuda:0", "cuda:1"]
    x = torch.randn(12, 3, 64, 64, device="cuda:0")
    for step in range(2):  # the second step replays the captured graphs
        out = pipe(x)
        expected = torch.cat([plain(mb) for mb in pipe.micro_batches(x)]).to("cuda:1")
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
        for p in list(pipe.parameters()) + list(plain.parameters()):
            p.grad = None
        out.square().mean().backward()
        expected.square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), [p for p in model.parameters()]):
            torch.testing.assert_close(b.grad.to("cuda:0"), a.grad, atol=2e-3, rtol=2e-2, msg=name)
    if graphs == "on":
        assert not pipe.graph_failures


def test_inference_eval_mode_equals_plain_model(monkeypatch):
    # full fp32: with TF32 convolutions, cuDNN's choice of algorithm per batch size alone moves logits by ~1e-2
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    plain, model = placed_resnet()
    plain.eval()
    pipe = pipeline(model, chunks=4).eval()
    x = torch.randn(16, 3, 64, 64, device="cuda:0")
    with torch.no_grad():
        torch.testing.assert_close(pipe(x).to("cuda:0"), plain(x), atol=1e-4, rtol=1e-4)


def test_both_gpus_busy_at_once():
    _, model = placed_resnet()
    pipe = pipeline(model, chunks=6)
    x = torch.randn(120, 3, 128, 128, device="cuda:0")
    pipe(x).sum().backward()  # capture
    for d in (0, 1):
        torch.cuda.synchronize(d)
    origins = {}
    for d in (0, 1):
        origins[torch.device("cuda", d)] = torch.cuda.Event(enable_timing=True)
        origins[torch.device("cuda", d)].record(torch.cuda.current_stream(d))
    pipe.trace = []
    pipe(x)
    rows = pipe.timeline(origins)
    first = [(s, e) for stage, _, s, e in rows if stage == 0]
    second = [(s, e) for stage, _, s, e in rows if stage == 1]
    overlap = sum(max(0.0, min(e0, e1) - max(s0, s1)) for s0, e0 in first for s1, e1 in second)
    busy = sum(e - s for s, e in second)
    assert overlap > 0.3 * busy, rows  # stage 0 works on micro-batch i+1 while stage 1 works on i


def test_balance_by_time_moves_the_boundary():
    _, model = placed_resnet()
    x = torch.randn(64, 3, 224, 224, device="cuda:0")
    pipe = pipeline(model, chunks=2, balance="time", sample=x)
    names = pipe.block_names
    assert names[0][-1] != "layer2.3"  # the tutorial's split is not the time-balanced one at 224x224
    out = pipe(x)
    out.sum().backward()


@pytest.mark.parametrize("deferred", [1, None])
def test_deferred_weight_halves_give_the_plain_models_gradients(monkeypatch, deferred):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 alone moves gradients by ~1e-3
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    plain, model = placed_resnet()
    pipe = pipeline(model, chunks=3, graphs="on", deferred_weights=deferred)
    x = torch.randn(12, 3, 64, 64, device="cuda:0")
    for step in range(2):  # capture, then replay
        for p in list(pipe.parameters()) + list(plain.parameters()):
            p.grad = None
        pipe(x).square().mean().backward()
        torch.cat([plain(mb) for mb in pipe.micro_batches(x)]).square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad.to("cuda:0"), a.grad, atol=1e-5, rtol=1e-3, msg=name)
    first, last = next(iter(pipe._graphs.values()))
    assert all(g.wgt is None for g in first)  # the first stage hands no gradient back: nothing to gain
    # the last micro-batch forward is the first backward: its weight half is the one worth moving to the end
    assert [g.wgt is not None for g in last] == ([False, False, True] if deferred == 1 else [True] * 3)
    sums = {t.data_ptr() for s in next(iter(pipe._sums.values())) for t in s.sums}
    assert not any(p.grad.data_ptr() in sums for p in pipe.parameters())  # .grad is the user's, not a buffer


def test_second_forward_before_backward_is_refused():
    from devmap.errors import PipelineError

    _, model = placed_resnet()
    pipe = pipeline(model, chunks=2, graphs="on")
    x = torch.randn(8, 3, 64, 64, device="cuda:0")
    pipe(x).sum().backward()  # capture
    stale = pipe(x).sum()
    pipe(x)  # the same graphs again: the first output's activations are gone
    with pytest.raises(PipelineError, match="call backward after each forward"):
        stale.backward()


def test_second_backward_through_one_pass_is_refused():
    # the backward graphs reuse activation memory they are done with, so a second replay without a new forward
    # gave wrong gradients (retain_graph=True); it is now an error
    from devmap.errors import PipelineError

    _, model = placed_resnet()
    pipe = pipeline(model, chunks=2, graphs="on")
    x = torch.randn(8, 3, 64, 64, device="cuda:0")
    pipe(x).sum().backward()  # capture
    loss = pipe(x).square().mean()
    loss.backward(retain_graph=True)
    with pytest.raises(PipelineError, match="retain_graph"):
        loss.backward()
