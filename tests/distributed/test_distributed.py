"""devmap splits run on torch.distributed.pipelining: 2 and 4 gloo processes under torchrun (and two torchrun
agents as two "nodes" on one machine) give the losses and parameters of devmap's single-process pipeline."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from devmap.distributed import split_model
from devmap.cli.train_cmd import parse
from devmap.distributed.training import batch, make_model
from devmap.pipelining import pipeline

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the factories are named tests.distributed.models, here as in the ranks
    sys.path.insert(0, str(ROOT))
RESNET = ["--model", "resnet18", "--num-classes", "10", "--input-shape", "3,64,64", "--batch-size", "16",
          "--chunks", "4", "--steps", "2"]


def torchrun(*args: str, procs: int = 2, timeout: int = 240, extra: tuple = ()) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *extra]
    if not extra:
        command += ["--nproc-per-node", str(procs), "--master-port", str(free_port())]
    command += ["-m", "devmap", "train", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(argv: list[str], stages: int, devices: list[str] | None = None):
    """devmap's single-process pipeline on the same split, batches and optimizer: losses, state, eval output.
    One thread, as torchrun's ranks: ResNet micro-batches of 2 rows reach BatchNorm with 2 values per channel,
    whose backward magnifies the last-bit differences of another thread count's reductions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(argv, stages, devices)
    finally:
        torch.set_num_threads(threads)


def _reference(argv: list[str], stages: int, devices: list[str] | None = None):
    args = [a for a in argv if a != "--json"]
    args = parse(args[:args.index("--out")] if "--out" in args else args)
    model = make_model(args, meta=False)
    shape = args.input_shape
    split = split_model(model, split_points=args.split_points) if args.split_points else \
        split_model(model, stages=stages, sample_shape=shape)
    devices = devices or ["cpu"] * len(split.modules)
    pipe = pipeline([(m.to(d), d) for m, d in zip(split.modules, devices)], chunks=args.chunks)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, target = batch(args, step, shape)
        optimizer.zero_grad(set_to_none=True)
        out = pipe(x)
        loss = nn.functional.mse_loss(out, target.to(out.device))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    x, _ = batch(args, args.steps, shape)

    def evaluate(trained: dict) -> torch.Tensor:
        """The plain model (eval mode) with the ranks' trained weights, stage by stage: the eval pass alone is
        compared (weights equal within rounding give outputs ~2e-5 apart on torch 2.14's CPU kernels)."""
        model.load_state_dict(trained)
        model.eval()
        with torch.no_grad():
            if devices[0] == "cpu":
                return model(x)
            return pipeline([(m, d) for m, d in zip(split.modules, devices)], chunks=1)(x.to(devices[0])).cpu()

    return losses, state, evaluate, split.names


def check_run(tmp_path: Path, argv: list[str], procs: int, stages: int, eval_output: bool = True,
              devices: list[str] | None = None, tolerance: float = 1e-5) -> None:
    result = torchrun(*argv, "--out", str(tmp_path), "--json", procs=procs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = json.loads((tmp_path / "losses.json").read_text())
    losses, state, evaluate, names = reference(argv, stages, devices)
    assert got["stage_blocks"] == names and got["stages"] == stages
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=tolerance, atol=tolerance / 10)
    merged = {}
    for rank in range(procs):
        merged.update(load_file(str(tmp_path / f"rank{rank}.safetensors")))
    assert set(merged) == set(state)  # every tensor lives on exactly one rank
    for name, value in merged.items():
        torch.testing.assert_close(value, state[name], rtol=10 * tolerance, atol=tolerance, msg=name)
    if eval_output:
        out = load_file(str(tmp_path / "eval_outputs.safetensors"))["batch0"]
        with torch.no_grad():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                plain = evaluate(merged)
            finally:
                torch.set_num_threads(threads)
        torch.testing.assert_close(out, plain, rtol=10 * tolerance, atol=tolerance)


@pytest.mark.parametrize("schedule, stages", [("1f1b", 2), ("gpipe", 2), ("interleaved", 4)])
def test_two_ranks_equal_the_single_process_pipeline(tmp_path, schedule, stages):
    argv = [*RESNET, "--schedule", schedule, "--eval-batches", "1"]
    if schedule == "1f1b":
        argv += ["--split-points", "layer2.1"]  # a residual-free boundary, as the tutorial's split
    check_run(tmp_path, argv, procs=2, stages=stages)


def test_zero_bubble_trains_like_the_single_process_pipeline(tmp_path):
    check_run(tmp_path, [*RESNET, "--schedule", "zb"], procs=2, stages=4, eval_output=False)


def test_four_ranks_equal_the_single_process_pipeline(tmp_path):
    check_run(tmp_path, [*RESNET, "--schedule", "1f1b", "--eval-batches", "1"], procs=4, stages=4)


def test_a_rank_that_raises_stops_every_rank(tmp_path):
    result = torchrun("--factory", "tests.distributed.models:fails_on_rank_1", "--input-shape", "12",
                      "--batch-size", "8", "--steps", "2", procs=2, timeout=120)
    assert result.returncode != 0
    assert "rank 1 could not build its model" in result.stdout + result.stderr


def test_two_nodes_on_one_machine(tmp_path):
    port = free_port()
    argv = ["--factory", "tests.distributed.models:small_sequential", "--num-classes", "10", "--input-shape", "12",
            "--batch-size", "8", "--chunks", "2", "--steps", "3", "--split-points", "4", "--out", str(tmp_path),
            "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "devmap",
                               "--node-rank", str(rank), "-m", "devmap", "train", *argv],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-2000:] for o in outputs)
    got = json.loads((tmp_path / "losses.json").read_text())
    losses, state, _, _ = reference(argv, stages=2)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)


def test_bad_splits_are_refused():
    from devmap.errors import PipelineError
    from devmap.distributed import stage_indices

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(PipelineError, match="one of"):
        split_model(model)
    with pytest.raises(PipelineError, match="not blocks"):
        split_model(model, split_points=["nope"])
    with pytest.raises(PipelineError, match="2 ranks need 4 stages"):
        stage_indices("zb", 0, 2, 2)
    with pytest.raises(PipelineError, match="unknown schedule"):
        stage_indices("fast", 0, 2, 2)
    assert stage_indices("zb", 0, 2, 4) == [0, 3] and stage_indices("interleaved", 1, 2, 4) == [1, 3]
    from devmap.cli.train_cmd import SCHEDULE_NAMES
    from devmap.distributed import SCHEDULES

    assert SCHEDULE_NAMES == SCHEDULES  # the CLI's copy (it imports no torch for --help)


def test_train_command_refuses_bad_use():
    from click.testing import CliRunner

    from devmap.cli import main

    result = CliRunner().invoke(main, ["train", "--model", "resnet18"], env={"RANK": None})
    assert result.exit_code == 2 and "torchrun" in result.output
    result = CliRunner().invoke(main, ["train", "--stages", "2", "--split-points", "layer3"], env={"RANK": "0"})
    assert result.exit_code == 2 and "one of" in result.output


def test_each_rank_reads_only_its_own_stage_from_a_checkpoint(tmp_path):
    import devmap
    from devmap.loading.checkpoint import index_checkpoint

    devmap.save("resnet18", tmp_path / "ckpt", seed=3)
    out = tmp_path / "out"
    result = torchrun("--model", "resnet18", "--checkpoint", str(tmp_path / "ckpt"), "--input-shape", "3,32,32",
                      "--batch-size", "4", "--chunks", "2", "--steps", "0", "--split-points", "layer3", "--out",
                      str(out), procs=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1])
    assert all(n.startswith(("conv1", "bn1", "layer1", "layer2")) for n in ranks[0])
    saved = {}
    for name, entry in index_checkpoint(tmp_path / "ckpt").items():
        saved[name] = load_file(str(entry.file))[name]
    merged = {**ranks[0], **ranks[1]}
    assert set(merged) == set(saved)
    assert all(torch.equal(merged[n], saved[n]) for n in saved)


def test_a_residual_block_cut_by_the_map_is_cut_the_same_way():
    import torchvision

    from devmap.pipelining.stages import blocks_of, placement_entries, split_units

    model = torchvision.models.resnet18(num_classes=10).eval()
    units = split_units(blocks_of(model))
    cut = next(i for i, (name, _) in enumerate(units) if name.startswith("layer2.0[tail"))
    devices = [torch.device("cuda", 0 if i < cut else 1) for i in range(len(units))]
    split = split_model(model, device_map=placement_entries(units, devices))
    assert split.names[0][-1].startswith("layer2.0[head") and split.names[1][0].startswith("layer2.0[tail")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(split.modules[1](split.modules[0](x)), model(x))


def devmap_train(*args: str, timeout: int = 240, terminal: bool = False) -> tuple[int, str, str]:
    """`python -m devmap train ARGS` (exit code, stdout, stderr); with `terminal`, stdout and stderr are one
    pseudo-terminal (returned as stdout), as a user at a shell sees them."""
    command = [sys.executable, "-m", "devmap", "train", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    if not terminal:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a width
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=follower,
                               stderr=follower)
    os.close(follower)
    seen = bytearray()
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the terminal closed: every process writing to it ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    return process.wait(timeout=timeout), seen.decode(errors="replace"), ""


def test_bad_input_to_a_distributed_run_exits_2_with_one_line():
    """Under torchrun a rank's usage error became torchrun's exit 1 and a report of every rank; `devmap train
    --nproc-per-node` gives back exit 2 and the one line."""
    code, out, err = devmap_train(*RESNET, "--stages", "99", "--nproc-per-node", "2")
    assert code == 2, out + err
    assert err.strip().splitlines() == [
        "Error: cannot make 99 stages out of 15 blocks: ask for at most 15 stages (fewer ranks, or --stages / "
        "--split-points with fewer cuts)"]
    code, _, err = devmap_train(*RESNET)
    assert code == 2 and "--nproc-per-node" in err and len(err.strip().splitlines()) == 1


def test_a_distributed_run_shows_its_steps_and_a_final_table(tmp_path):
    """A distributed run printed nothing until its end: rank 0 shows the steps on a terminal, the last stage's
    rank a table of the losses; with --json, one JSON line and no progress."""
    code, seen, _ = devmap_train(*RESNET, "--nproc-per-node", "2", terminal=True)
    assert code == 0, seen
    assert "train:" in seen and ("s/step" in seen or "step/s" in seen), seen  # tqdm's bar on rank 0 (its rate)
    assert "2 ranks, 2 stages, 1f1b" in seen and "step" in seen and "loss" in seen and "seconds" in seen
    code, out, err = devmap_train(*RESNET, "--nproc-per-node", "2", "--json", "--out", str(tmp_path))
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1 and json.loads(out)["losses"] and "train:" not in err
