"""The pipeline on ["cpu", "cpu"]: same outputs and gradients as the plain model, errors reach the caller."""

import copy
import threading
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn

from devmap import dispatch
from devmap.errors import PipelineError
from devmap.pipelining import Pipeline, pipeline
from devmap.pipelining.stages import blocks_of
from devmap.testing import ToyModel


def split_in_two(model, at):
    blocks = blocks_of(model)
    first = nn.Sequential(OrderedDict((n.replace(".", "_"), b) for n, b in blocks[:at]))
    second = nn.Sequential(OrderedDict((n.replace(".", "_"), b) for n, b in blocks[at:]))
    return [(first, "cpu"), (second, "cpu")]


def reference_per_micro_batch(model, x, pipe):
    """The plain model run on each micro-batch (BatchNorm sees each micro-batch alone, as in the pipeline)."""
    return torch.cat([model(mb) for mb in pipe.micro_batches(x)])


def assert_same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, atol=1e-5, rtol=1e-4)


def assert_trains_like(pipe, plain, ref, x, relative_grads=False):
    """The pipeline's output equals the reference model run per micro-batch, and so do the gradients of a
    squared-sum loss (`relative_grads`: tolerance scaled to each gradient, for cut blocks that sum in another order)."""
    out = pipe(x)
    expected = reference_per_micro_batch(ref, x, pipe)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    if not relative_grads:
        assert_same_grads(plain, ref)
        return
    for (name, p), q in zip(plain.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-5 * float(q.grad.abs().max()))


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_resnet_two_stages_train(chunks):
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    ref = copy.deepcopy(plain)
    pipe = pipeline(split_in_two(plain, 7), chunks=chunks)  # split inside layer2, flatten before fc
    x = torch.randn(5, 3, 64, 64)  # 2x2 maps at layer4: BatchNorm trains even on one-sample micro-batches
    assert_trains_like(pipe, plain, ref, x)
    for a, b in zip(plain.buffers(), ref.buffers()):  # BN running statistics advance the same way
        torch.testing.assert_close(a, b)


def test_resnet_eval_equals_plain_model():
    plain = torchvision.models.resnet18(num_classes=10).eval()
    pipe = pipeline(split_in_two(copy.deepcopy(plain), 5), chunks=3).eval()
    x = torch.randn(7, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))


@pytest.mark.parametrize("split_size", [1, 3, 4, 20, 100])
def test_sequential_split_sizes(split_size):
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(seq)
    pipe = pipeline([(seq[:2], "cpu"), (seq[2:4], "cpu"), (seq[4:], "cpu")], split_size=split_size)
    x = torch.randn(10, 8)
    assert len(pipe.micro_batches(x)) == -(-10 // split_size)  # split >= batch: one micro-batch
    out = pipe(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    assert_same_grads(seq, ref)


def test_toy_model_placed_by_dispatch_trains():
    torch.manual_seed(0)
    toy, ref = ToyModel(), ToyModel()
    ref.load_state_dict(toy.state_dict())
    dispatch(toy, {"net1": "cpu", "relu": "cpu", "net2": "cpu"}, max_memory={"cpu": "1GiB"})
    with pytest.raises(PipelineError, match="cannot split a ToyModel"):
        pipeline(toy, chunks=2)
    pipe = pipeline([(nn.Sequential(toy.net1, toy.relu), "cpu"), (toy.net2, "cpu")], chunks=4)
    x, y = torch.randn(20, 10), torch.randn(20, 5)
    for model in (pipe, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.testing.assert_close(toy.net1.weight, ref.net1.weight)
    torch.testing.assert_close(pipe(x), ref(x))


def test_pipeline_of_a_dispatched_sequential_uses_its_map():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    dispatch(seq, {"0": "cpu", "1": "cpu", "2": "cpu"}, max_memory={"cpu": "1GiB"})
    pipe = pipeline(seq, chunks=2)
    assert len(pipe.partitions) == 1 and pipe.devices == [torch.device("cpu")]
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), seq(x))


class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom in stage 1")


def test_stage_error_reaches_caller_and_no_thread_leaks():
    before = threading.active_count()
    pipe = pipeline([(nn.Linear(3, 3), "cpu"), (Boom(), "cpu")], chunks=4)
    for _ in range(3):
        with pytest.raises(ValueError, match="boom in stage 1"):
            pipe(torch.randn(8, 3))
    assert threading.active_count() == before


def test_bad_arguments():
    stages = [(nn.Linear(3, 3), "cpu"), (nn.Linear(3, 3), "cpu")]
    with pytest.raises(PipelineError, match="chunks=0"):
        pipeline(stages, chunks=0)
    with pytest.raises(PipelineError, match="split_size=-2"):
        pipeline(stages, split_size=-2)
    with pytest.raises(PipelineError, match="not both"):
        pipeline(stages, chunks=2, split_size=2)
    with pytest.raises(PipelineError, match="no placement"):
        pipeline(torchvision.models.resnet18(), chunks=2)
    with pytest.raises(PipelineError, match="declared on cuda:0 but its weight is on cpu"):
        pipeline([(nn.Linear(3, 3), "cpu"), (nn.Linear(3, 3), "cuda:0")], chunks=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(PipelineError, match="deferred_weights="):
            pipeline(stages, chunks=2, deferred_weights=bad)
    with pytest.raises(PipelineError, match="graphs="):
        Pipeline([(nn.Linear(3, 3), torch.device("cpu"))], graphs="maybe")
    with pytest.raises(PipelineError, match="one tensor"):
        pipeline(stages, chunks=2)([torch.randn(2, 3)])


def test_pipeline_is_a_module():
    """Its parameters are its stages', and eval()/train() reach every stage: dropout is off in eval (the output is
    the linear layer's alone) and on in training."""
    linear = nn.Linear(3, 3)
    pipe = pipeline([(linear, "cpu"), (nn.Dropout(0.5), "cpu")], chunks=2)
    assert len(list(pipe.parameters())) == 2
    x = torch.randn(64, 3)
    pipe.eval()
    assert not pipe.partitions[1].training
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), linear(x))
        pipe.train()
        assert pipe.partitions[1].training
        assert (pipe(x) == 0).any() and not torch.allclose(pipe(x), linear(x))


def test_tune_picks_a_candidate_and_keeps_weights():
    from devmap.pipelining.tuning import tune

    seq = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.BatchNorm1d(32), nn.Linear(32, 4))
    before = [t.detach().clone() for t in [*seq.parameters(), *seq.buffers()]]
    build = lambda c: pipeline([(seq[:2], "cpu"), (seq[2:], "cpu")], chunks=c)  # noqa: E731
    result = tune(build, torch.randn(16, 8), candidates=[1, 2, 4, 32], steps=2, warmup=1)
    assert [row["chunks"] for row in result.table] == [1, 2, 4]  # 32 > batch: skipped
    assert result.best_chunks in (1, 2, 4)
    for a, b in zip(before, [*seq.parameters(), *seq.buffers()]):
        torch.testing.assert_close(a, b)


def test_refine_split_keeps_a_valid_placement():
    from devmap.pipelining.refine import refine_split

    seq = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    dispatch(seq, {"0": "cpu", "1": "cpu", "2": "cpu", "3": "cpu", "4": "cpu"}, max_memory={"cpu": "1GiB"})
    result = refine_split(seq, torch.randn(16, 8), chunks=2, steps=1, warmup=0)
    assert result["seconds"] > 0 and result["boundaries"] == []  # one device: one stage, nothing to move
    pipe = pipeline(seq, chunks=2)
    x = torch.randn(4, 8)
    torch.testing.assert_close(pipe(x), seq(x))


@pytest.mark.parametrize("balance", ["time", "measure"])
def test_balance_modes_on_a_dispatched_model(balance):
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    dispatch(seq, {"0": "cpu", "1": "cpu", "2": "cpu"}, max_memory={"cpu": "1GiB"})
    x = torch.randn(6, 8)
    with pytest.raises(PipelineError, match="needs sample"):
        pipeline(seq, chunks=2, balance=balance)
    pipe = pipeline(seq, chunks=2, balance=balance, sample=x)
    torch.testing.assert_close(pipe(x), seq(x))
    with pytest.raises(PipelineError, match="invalid balance"):
        pipeline(seq, balance="bytes")


def test_tune_cli_on_cpu():
    import json

    from click.testing import CliRunner

    from devmap.cli import main

    result = CliRunner().invoke(main, ["tune", "resnet18", "--devices", "cpu", "--batch-size", "4", "--image-size",
                                       "64", "--chunks", "1,2", "--steps", "1", "--balance", "memory", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["best_chunks"] in (1, 2) and [r["chunks"] for r in data["table"]] == [1, 2]
    result = CliRunner().invoke(main, ["tune", "llama-tiny", "--devices", "cpu"])
    assert result.exit_code == 2 and "measures torchvision ResNets" in result.output
    result = CliRunner().invoke(main, ["tune", "resnet18", "--chunks", "0,x", "--devices", "cpu"])
    assert result.exit_code == 2 and result.output.startswith("Error: ")


@pytest.mark.parametrize("arch,cut", [("resnet50", "layer2.0"), ("resnet50", "layer1.1"), ("resnet18", "layer3.0")])
def test_stage_boundary_inside_a_residual_block(arch, cut):
    """A residual block cut between head and tail computes what the block does, outputs and gradients."""
    from devmap.pipelining.stages import merge_units, placed_units, placement_entries, split_units

    torch.manual_seed(0)
    plain = getattr(torchvision.models, arch)(num_classes=10)
    ref = copy.deepcopy(plain)
    blocks = blocks_of(plain)
    units = split_units(blocks)
    at = [n for n, _ in units].index(f"{cut}[tail]")
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)  # labels only: nothing moves here
    merged, devices = merge_units(units, [first] * at + [second] * (len(units) - at), blocks)
    assert [n for n, _ in merged].count(f"{cut}[head]") == 1 and len(merged) == len(blocks) + 1
    boundary = devices.index(second)
    stages = [(nn.Sequential(*[m for _, m in merged[:boundary]]), "cpu"),
              (nn.Sequential(*[m for _, m in merged[boundary:]]), "cpu")]
    pipe = pipeline(stages, chunks=2)
    x = torch.randn(4, 3, 64, 64)
    assert_trains_like(pipe, plain, ref, x, relative_grads=True)  # the split sums in another order
    # the device map of such a placement names the parts' submodules, and reads back as the same units
    plain.hf_device_map = placement_entries(merged, devices)
    assert plain.hf_device_map[f"{cut}.conv1"] == 0 and plain.hf_device_map[f"{cut}.bn2"] == 1 - (arch == "resnet50")
    assert [n for n, _ in placed_units(plain)] == [n for n, _ in merged]


@pytest.mark.parametrize("n", [4, 8])
def test_resnet_over_n_stages_trains_like_the_model(n):
    """Any number of stages (4 and 8 GPUs' layouts, as n CPU stages): same outputs and gradients."""
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    ref = copy.deepcopy(plain)
    blocks = blocks_of(plain)
    bounds = [round(i * len(blocks) / n) for i in range(n + 1)]
    stages = [(nn.Sequential(OrderedDict((name.replace(".", "_"), b) for name, b in blocks[lo:hi])), "cpu")
              for lo, hi in zip(bounds, bounds[1:])]
    pipe = pipeline(stages, chunks=3)
    x = torch.randn(6, 3, 64, 64)
    assert_trains_like(pipe, plain, ref, x)


def test_partition_into_many_stages_minimizes_the_slowest():
    from devmap.pipelining.balance import partition

    times = [3.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 4.0, 1.0, 1.0, 2.0]
    for stages in (2, 4, 8):
        owner = partition(times, stages)
        assert owner == sorted(owner) and set(owner) == set(range(stages))  # contiguous, none empty
        slowest = max(sum(t for t, o in zip(times, owner) if o == s) for s in range(stages))
        assert slowest <= max(times) + sum(times) / stages  # within one block of a perfect split
    assert max(sum(t for t, o in zip(times, partition(times, 8)) if o == s) for s in range(8)) == 4.0


def test_bottleneck_cut_after_conv1_and_its_device_map():
    """The second cut point of a Bottleneck that does not downsample: same outputs and gradients, and a device
    map placing its submodules that way reads back as that cut."""
    from devmap.pipelining.residual_parts import cuts_of, split_residual, unit_name
    from devmap.pipelining.stages import placed_units, placement_entries

    torch.manual_seed(0)
    plain = torchvision.models.resnet50(num_classes=10)
    ref = copy.deepcopy(plain)
    assert cuts_of(plain.layer2[0]) == ["conv2"] and cuts_of(plain.layer2[1]) == ["conv2", "conv1"]
    blocks = blocks_of(plain)
    at = [n for n, _ in blocks].index("layer2.1")
    head, tail = split_residual(plain.layer2[1], "conv1")
    units = blocks[:at] + [(unit_name("layer2.1", "head", plain.layer2[1], "conv1"), head),
                           (unit_name("layer2.1", "tail", plain.layer2[1], "conv1"), tail)] + blocks[at + 1:]
    assert units[at][0] == "layer2.1[head@conv1]"
    stages = [(nn.Sequential(*[m for _, m in units[:at + 1]]), "cpu"),
              (nn.Sequential(*[m for _, m in units[at + 1:]]), "cpu")]
    pipe = pipeline(stages, chunks=2)
    x = torch.randn(4, 3, 64, 64)
    assert_trains_like(pipe, plain, ref, x, relative_grads=True)
    devices = [torch.device("cuda", 0)] * (at + 1) + [torch.device("cuda", 1)] * (len(units) - at - 1)
    plain.hf_device_map = placement_entries(units, devices)
    assert plain.hf_device_map["layer2.1.bn1"] == 0 and plain.hf_device_map["layer2.1.conv2"] == 1
    assert [n for n, _ in placed_units(plain)] == [n for n, _ in units]


@pytest.mark.parametrize("deferred, expected",
                         [(1, [3]), (2, [2, 3]), (None, [0, 1, 2, 3]), (0, []), (9, [0, 1, 2, 3])])
def test_which_micro_batches_defer_their_weight_gradients(deferred, expected):
    stages = [(nn.Linear(4, 4), "cpu") for _ in range(3)]
    pipe = pipeline(stages, chunks=4, deferred_weights=deferred)
    assert not any(pipe._defers_weights(0, i, 4) for i in range(4))  # the first stage hands no gradient back
    for j in (1, 2):  # the last micro-batches forward are the first backward: theirs are worth deferring
        assert [i for i in range(4) if pipe._defers_weights(j, i, 4)] == expected


def test_backward_twice_through_one_pass_without_graphs():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    pipe = pipeline([(a, "cpu"), (b, "cpu")], chunks=3)
    loss = pipe(torch.randn(6, 4)).square().sum()
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in pipe.parameters()]
    loss.backward()
    for p, g in zip(pipe.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g)


def test_a_backward_out_of_capture_order_is_refused():
    # a stage's micro-batch graphs share one memory pool, captured for backwards from the last micro-batch to the
    # first; any other order would replay over a slot's live activations, so it is an error, never wrong gradients
    from devmap.pipelining.graphs import BackwardOrder

    order = BackwardOrder([2, 1, 0])
    for slot in (2, 1, 0):
        order.check(slot, generation=1)
    order.check(2, generation=2)  # a new pass starts over
    with pytest.raises(PipelineError, match="backward of micro-batch 0 ran before that of micro-batch 1"):
        order.check(0, generation=2)
