"""The weight half of a split backward gives the gradients of one whole backward, and only safe calls are split."""

import pytest
import torch
import torchvision
from torch import nn

from devmap.pipelining.weight_grads import CallRecorder, deferrable, split_grads, splittable


def whole_and_split(module, x, input_grad=True):
    x = x.clone().requires_grad_(input_grad)
    params = [p for p in module.parameters() if p.requires_grad]
    with CallRecorder(module) as recorder:
        out = module(x)
    calls = deferrable(module, recorder.calls)
    grad_out = torch.randn_like(out)
    inputs = [x] if input_grad else []
    whole = torch.autograd.grad(out, inputs + params, grad_out, allow_unused=True, retain_graph=True)
    split_in, split_params = split_grads(out, grad_out, inputs, params, calls)
    return calls, list(whole), split_in + split_params


def assert_same(whole, split):
    assert len(whole) == len(split)
    for w, s in zip(whole, split):
        if w is None:
            assert s is None
        else:
            torch.testing.assert_close(s, w, atol=1e-5, rtol=1e-4)


def test_resnet_stage_splits_every_conv_and_the_fc():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    calls, whole, split = whole_and_split(model, torch.randn(2, 3, 32, 32), input_grad=False)
    assert len(calls) == sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    assert_same(whole, split)


def test_bottleneck_stage_with_input_gradient():
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    stage = nn.Sequential(model.layer1[1], model.layer1[2], model.layer2[0])
    calls, whole, split = whole_and_split(stage, torch.randn(2, 256, 16, 16))
    assert len(calls) == 10
    assert_same(whole, split)


def test_linear_conv1d_conv3d_grouped_strided_and_frozen_bias():
    torch.manual_seed(0)
    conv1d = nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2)
    conv3d = nn.Conv3d(2, 3, (1, 3, 3), padding=(0, 1, 1), dilation=(1, 1, 2), bias=False)
    linear = nn.Linear(5, 7)
    linear.bias.requires_grad_(False)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d, self.conv3d, self.linear = conv1d, conv3d, linear

        def forward(self, x):
            a = self.conv1d(x)  # (2, 6, 8)
            b = self.conv3d(a.reshape(2, 2, 3, 2, 4))  # (2, 3, 3, 2, 2)
            return self.linear(torch.cat([b.flatten(1), a.flatten(1)], 1)[:, :5].reshape(2, 1, 5).expand(2, 3, 5))

    calls, whole, split = whole_and_split(Mixed(), torch.randn(2, 4, 16))
    assert [type(c.module) for c in calls] == [nn.Conv1d, nn.Conv3d, nn.Linear]
    assert_same(whole, split)


def test_unsafe_calls_stay_in_the_input_half():
    torch.manual_seed(0)
    twice = nn.Linear(4, 4)
    tied_a, tied_b = nn.Linear(4, 4), nn.Linear(4, 4)
    tied_b.weight = tied_a.weight
    inplace = nn.Conv1d(4, 4, 1)
    same = nn.Conv1d(4, 4, 3, padding="same")
    reflect = nn.Conv1d(4, 4, 3, padding=1, padding_mode="reflect")
    unused = nn.Linear(4, 4)

    class Tricky(nn.Module):
        def __init__(self):
            super().__init__()
            self.twice, self.tied_a, self.tied_b = twice, tied_a, tied_b
            self.inplace, self.same, self.reflect, self.unused = inplace, same, reflect, unused

        def forward(self, x):  # x: (2, 4, 5)
            h = self.inplace(x)
            h.relu_()  # the output kept for the weight half would no longer be the conv's
            h = self.reflect(self.same(h)).transpose(1, 2)  # (2, 5, 4)
            self.unused(h)  # its output never reaches the loss
            return self.tied_b(self.tied_a(self.twice(self.twice(h))))

    assert not splittable(same) and not splittable(reflect)
    calls, whole, split = whole_and_split(Tricky(), torch.randn(2, 4, 5))
    assert [c.module for c in calls] == [unused]
    assert_same(whole, split)


def test_subclass_with_its_own_forward_is_not_split():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    assert not splittable(Scaled(3, 3))


@pytest.mark.parametrize("frozen", [True, False])
def test_frozen_weight_not_recorded(frozen):
    layer = nn.Linear(3, 3)
    layer.weight.requires_grad_(not frozen)
    assert splittable(layer) is (not frozen)


class FakeGraph:
    """Stands in for a captured StageGraph: its input half adds 1 and its weight half adds 10 to the sums."""

    def __init__(self, sums, log):
        self.sums, self.log = sums, log

    def run_input_half(self):
        self.log.append("in")
        self.sums.add_into([(p, torch.ones_like(p)) for p in self.sums.params])

    def run_weight_half(self):
        self.log.append("w")
        self.sums.add_into([(p, torch.full_like(p, 10.0)) for p in self.sums.params])


def test_pass_gate_runs_weight_halves_once_and_hands_over_the_sums():
    from devmap.errors import PipelineError
    from devmap.pipelining.grad_sums import GradSums, open_pass

    param = nn.Parameter(torch.zeros(3))
    sums, log = GradSums([param]), []
    graphs = [FakeGraph(sums, log) for _ in range(3)]
    for step in range(2):  # each pass starts from zero; autograd adds the pass's sums into .grad
        phony = open_pass(sums, graphs, torch.device("cpu"))
        for graph in graphs:
            graph.run_input_half()
        assert log[-3:] == ["in"] * 3
        phony.backward(torch.empty(0))
        assert log[-6:] == ["in"] * 3 + ["w"] * 3
        assert torch.equal(param.grad, torch.full((3,), 33.0 * (step + 1)))
        assert param.grad.data_ptr() != sums.sums[0].data_ptr()  # .grad is not the shared buffer
    stale = open_pass(sums, graphs, torch.device("cpu"))
    open_pass(sums, graphs, torch.device("cpu"))
    with pytest.raises(PipelineError, match="call backward after each forward"):
        stale.backward(torch.empty(0))

