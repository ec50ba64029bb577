"""`devmap compare` on cpu,cpu: the tutorial's defaults, its systems' outputs, results.json, the PNGs and the errors."""

import json

import pytest
import torch
import torchvision
from click.testing import CliRunner

from devmap.comparison import tutorial_models as tm
from devmap.cli import main
from devmap.comparison.plots import write_plots
from devmap.comparison.timing import PIPELINE, TUTORIAL_SYSTEMS, HarnessConfig, run_comparison, time_system, total_runs

SPLITS = [2, 4, 8]  # with 32x32 images a micro-batch of 1 cannot train (see test_bad_arguments)
SMALL = ["--devices", "cpu,cpu", "--batch-size", "4", "--image-size", "32", "--num-batches", "1", "--repeat", "2",
         "--split-sizes", ",".join(map(str, SPLITS)), "--num-classes", "10"]
PNGS = ["mp_vs_rn.png", "mp_vs_rn_vs_pp.png", "split_size_tradeoff.png"]
WITH_DEVMAP = PNGS + ["mp_vs_rn_vs_pp_vs_devmap.png"]
TOY = dict(num_batches=1, repeat=2, split_sizes=(1, 5, 20))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny CPU workloads: two OpenMP threads on a busy 2-core machine run ~30x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = invoke("compare", *SMALL, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_defaults_are_the_tutorials():
    cfg = HarnessConfig()
    assert (cfg.num_batches, cfg.batch_size, cfg.image_w, cfg.image_h, cfg.num_classes) == (3, 120, 128, 128, 1000)
    assert (cfg.repeat, cfg.number, cfg.lr, cfg.pipeline_split_size, cfg.warmup) == (10, 1, 0.001, 20, 0)
    assert cfg.split_sizes == (1, 3, 5, 8, 10, 12, 20, 40, 60)
    stages = tm.ModelParallelResNet50(["cpu", "cpu"], num_classes=10).stage_layout
    assert [names for names, _ in stages] == [("conv1", "bn1", "relu", "maxpool", "layer1", "layer2"),
                                              ("layer3", "layer4", "avgpool", "fc")]
    options = {p.name: p.default for p in main.get_command(None, "compare").params}
    assert (options["batch_size"], options["image_size"], options["num_batches"]) == (120, 128, 3)
    assert (options["repeat"], options["warmup"]) == (10, 0)
    assert options["split_sizes"] == "1,3,5,8,10,12,20,40,60" and options["pipeline_split_size"] == 20


def test_results_json_has_every_system_and_split(resnet_run):
    data, out = resnet_run
    # devmap's own pipeline joins the tutorial's systems by default (--no-devmap leaves it out)
    assert list(data["systems"])[:3] == list(TUTORIAL_SYSTEMS)
    devmap_label = list(data["systems"])[3]
    assert devmap_label.startswith("devmap pipeline") and len(data["systems"]) == 4
    for timing in data["systems"].values():
        assert len(timing["times"]) == 2 and timing["mean"] > 0 and timing["std"] >= 0
    assert [p["split_size"] for p in data["sweep"]] == SPLITS
    assert data["best_split_size"] in SPLITS
    assert data["ratios"]["Single GPU"] == 1.0
    assert data["config"]["batch_size"] == 4 and data["config"]["split_sizes"] == SPLITS
    assert data["devices"] == ["cpu", "cpu"] and data["extra_systems"] == [devmap_label]
    assert data["placement"]["layer2"] == 0 and data["placement"]["layer3"] == 1
    assert json.loads((out / "results.json").read_text()) == data


def test_pngs_are_valid(resnet_run):
    from PIL import Image

    _, out = resnet_run
    assert sorted(p.name for p in out.glob("*.png")) == sorted(WITH_DEVMAP)  # the fourth adds devmap's pipeline
    assert not list(out.glob(".*"))  # no temporary files left behind
    for name in WITH_DEVMAP:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(out / name) as image:
            image.verify()
        with Image.open(out / name) as image:
            assert image.size[0] > 100 and image.size[1] > 100


@pytest.mark.parametrize("placement", [None, tm.placement_from_split([2, 5, 9], 4)])
def test_split_models_match_plain_resnet50(placement):
    plain = torchvision.models.resnet50(num_classes=10).eval()
    devices = ["cpu"] * (2 if placement is None else 4)
    x = torch.randn(4, 3, 32, 32)
    models = [tm.ModelParallelResNet50(devices, placement, 10)]
    models += [tm.PipelineParallelResNet50(devices, placement, 10, split_size=s) for s in (1, 3, 4, 20)]
    with torch.no_grad():
        expected = plain(x)
        for model in models:
            model.load_state_dict(plain.state_dict())  # same keys as torchvision's resnet50
            torch.testing.assert_close(model.eval()(x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("split_size, calls", [(1, 4), (2, 2), (3, 2), (4, 1), (60, 1)])
def test_split_size_at_or_above_batch_is_one_micro_batch(split_size, calls):
    model = tm.PipelineParallelResNet50(["cpu", "cpu"], num_classes=10, split_size=split_size).eval()
    seen = []
    model.conv1.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    with torch.no_grad():
        assert model(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert len(seen) == calls and sum(seen) == 4


def test_pipeline_loop_is_the_tutorials():
    log = []

    def stage(name, device):
        return (lambda x: log.append((name, x.tolist())) or x), torch.device(device)

    def tutorial_forward(x, split_size):  # PipelineParallelResNet50.forward, verbatim but for the logging stages
        seq1, seq2 = stage("seq1", "cpu")[0], stage("seq2+fc", "cpu")[0]
        splits = iter(x.split(split_size, dim=0))
        s_next = next(splits)
        s_prev = seq1(s_next).to("cpu")
        ret = []
        for s_next in splits:
            s_prev = seq2(s_prev)
            ret.append(s_prev)
            s_prev = seq1(s_next).to("cpu")
        s_prev = seq2(s_prev)
        ret.append(s_prev)
        return torch.cat(ret)

    x = torch.arange(7.0)
    for split_size in (1, 2, 3, 7, 9):
        log.clear()
        expected = tutorial_forward(x, split_size)
        want = list(log)
        log.clear()
        got = tm.pipeline_stages([stage("seq1", "cpu"), stage("seq2+fc", "cpu")], x, split_size)
        assert log == want and torch.equal(got, expected)


def test_planner_map_rounds_to_whole_children():
    balanced = tm.resolve_placement(["cpu", "cpu"], "balanced")  # planner: layer4.0 -> 0, layer4.1 -> 1
    assert balanced == [0] * 8 + [1, 1]
    assert tm.resolve_placement(["cpu", "cpu"], "sequential") == [0] * 10  # planner: {"": 0}
    assert tm.placement_from_device_map({"conv1": 0, "": 1}, 2) == [0] + [1] * 9


@pytest.mark.parametrize("args, words", [
    (["--repeat", "0"], "repeat must be a positive integer"),
    (["--batch-size", "0"], "batch_size must be a positive integer"),
    (["--warmup", "-1"], "warmup must be a non-negative integer"),
    (["--devices", "tpu:0,cpu"], "unknown device 'tpu:0'"),
    (["--devices", "cuda:7,cuda:0"], "does not exist"),
    (["--devices", "cpu"], "needs at least 2 devices"),
    (["--split-sizes", "0,abc"], "--split-sizes"),
    (["--split-sizes", "abc"], "'abc' is not an integer"),
    (["--split-sizes", "1,2"], "micro-batch of 1 image of 32x32"),
    (["--device-map", "fastest"], "unknown device map strategy"),
    (["--toy", "--device-map", "balanced"], "not to --toy"),
])
def test_bad_arguments(args, words, tmp_path):
    base = ["--devices", "cpu,cpu", "--batch-size", "4", "--image-size", "32", "--split-sizes", "2,4"]
    result = invoke("compare", *base, *args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_default_devices_need_two_gpus():
    result = invoke("compare")
    assert result.exit_code == 2
    assert result.output.strip().startswith("Error: needs 2 CUDA GPUs, found ")
    assert "--devices cpu,cpu" in result.output


def test_toy_table(tmp_path):
    result = invoke("compare", "--toy", "--devices", "cpu,cpu", "--num-batches", "1", "--repeat", "2",
                    "--split-sizes", "1,5,20", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    for words in (*TUTORIAL_SYSTEMS, "baseline", "Best split size: ", "net1 … relu → cpu (#0) | net2 → cpu (#1)"):
        assert words in result.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["model"] == "toy" and [p["split_size"] for p in data["sweep"]] == [1, 5, 20]
    assert all((tmp_path / name).exists() for name in PNGS)


def test_extra_system_gets_timed_and_the_fourth_plot(tmp_path):
    cfg = HarnessConfig(**TOY)
    built, calls = [], []

    def devmap_pipeline(devices, config):
        built.append((list(devices), config))
        return tm.PipelineToyModel(devices, split_size=5)

    extra = {"devmap pipeline": devmap_pipeline}
    result = run_comparison(["cpu", "cpu"], cfg, toy=True, extra_systems=extra, progress=lambda: calls.append(1))
    assert len(calls) == total_runs(cfg, extra) == 2 * (3 + 3 + 1)
    assert list(result.systems) == [*TUTORIAL_SYSTEMS, "devmap pipeline"] and len(built) == cfg.repeat
    assert built[0] == ([torch.device("cpu")] * 2, cfg)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["extra_systems"] == ["devmap pipeline"] and "devmap pipeline" in data["ratios"]
    names = [p.name for p in write_plots(result, tmp_path)]
    assert names == [*PNGS, "mp_vs_rn_vs_pp_vs_devmap.png"]
    with pytest.raises(ValueError, match="clash"):
        run_comparison(["cpu", "cpu"], cfg, toy=True, extra_systems={PIPELINE: devmap_pipeline})


@pytest.mark.parametrize("warmup", [0, 2])
def test_time_system_builds_in_setup_and_warms_up_untimed(warmup):
    events = []
    times = time_system(lambda: events.append("build") or len(events), lambda model: events.append(("step", model)),
                        HarnessConfig(repeat=3, warmup=warmup), progress=lambda: events.append("progress"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    warm = ["build", *[("step", 1)] * warmup] if warmup else []
    timed = []
    for _ in range(3):
        timed += ["build", ("step", len(warm) + len(timed) + 1), "progress"]
    assert events == warm + timed
