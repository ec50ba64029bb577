"""Compiling a served model's steps in a process of its own: the cut-down model, its entries serving the whole one,
and the process's failures and ends (aot_eager on CPU for the compile itself)."""

import json
import logging

import pytest
import torch

from devmap.serving import compile_process
from devmap.serving.compile_process import CompileJob, compile_elsewhere, cut_down


def test_the_cut_down_model_keeps_a_layer_per_run_of_layers_on_a_device():
    config = {"num_hidden_layers": 4, "hidden_size": 8, "layer_types": ["a", "b", "c", "d"]}
    device_map = {"model.embed_tokens": "0", "model.layers.0": "0", "model.layers.1": "0", "model.layers.2": "1",
                  "model.layers.3": "1", "model.norm": "1", "lm_head": "1"}
    small, cut = cut_down(config, device_map)
    assert small == {"num_hidden_layers": 2, "hidden_size": 8, "layer_types": ["a", "c"]}
    assert cut == {"model.embed_tokens": "0", "model.layers.0": "0", "model.layers.1": "1", "model.norm": "1",
                   "lm_head": "1"}
    assert config["num_hidden_layers"] == 4  # the served model's config is left as it is
    assert cut_down(config, {"": "0"}) == ({**small, "num_hidden_layers": 1, "layer_types": ["a"]}, {"": "0"})
    assert cut_down(config, {"model.embed_tokens": "0", "lm_head": "0"}) is None  # no layer named
    assert cut_down({"hidden_size": 8}, {"": "0"}) is None


class _OnGPU:
    """A tensor's size and GPU, as `room` reads them."""

    def __init__(self, index, gib):
        self.is_cuda, self.device, self.nbytes = True, type("Device", (), {"index": index}), int(gib * 2**30)


class _Held:
    """A module (or a model) holding `tensors`, its `layers` named as a decoder stack's."""

    def __init__(self, tensors, layers=()):
        self.tensors, self.layers = tensors, layers

    def parameters(self):
        return iter(self.tensors + [t for layer in self.layers for t in layer.tensors])

    def buffers(self):
        return iter([])

    def named_modules(self):
        return [("", self), *((f"model.layers.{i}", layer) for i, layer in enumerate(self.layers))]


def test_a_gpu_lends_the_compile_what_serving_will_not_take_there(monkeypatch):
    """GPU 0 holds a model of 1 GiB outside its 4 layers of 2 GiB, whose plan made room for 8 GiB of KV cache, 3 GiB
    of it taken already (12 GiB reserved): serving may still take 9 + 8 + KEEP − 12 = 7 GiB there. The one-layer
    model's compile needs 3 (ROOM) + 1 + 2 GiB: 14 GiB free lend it, 12 do not, nor 14 beside a second resident model
    that may take 2 GiB more."""
    model = _Held([_OnGPU(0, 1)], [_Held([_OnGPU(0, 2)]) for _ in range(4)])
    other = _Held([_OnGPU(0, 0.5)], [_Held([_OnGPU(0, 0.5)])])
    cut = {"model.embed_tokens": "0", "model.layers.0": "0", "lm_head": "0"}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 12 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (14 << 30, 80 << 30))
    assert compile_process.room(model, cut, 8 << 30) == {"0": 6 << 30}
    assert "GPU 0 lends 5.0 GiB" in compile_process.room(model, cut, 8 << 30, [(other, 1 << 30)])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (12 << 30, 80 << 30))
    assert "needs 6.0 GiB" in compile_process.room(model, cut, 8 << 30)


def test_entries_compiled_on_the_cut_down_model_serve_the_whole_one(model_root, compiled_on_cpu, tmp_path,
                                                                    monkeypatch):
    """The compile's process (run here: its function) compiles every shape of a one-layer model into the store and
    marks the served model's key; the served model's light warm-up then loads those entries and compiles nothing."""
    import devmap
    from devmap.compat import ahead_of_time_keeps
    from devmap.generation import region_store
    from devmap.generation.joined_projections import join_projections
    from devmap.serving import warm_marks
    from devmap.serving.prepare import pin_attention
    from devmap.serving.compile_cache import REGIONS
    from devmap.serving.warm_up import warm_up

    if not ahead_of_time_keeps("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves inductor's entries only")
    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    join_projections(model)  # as the service prepares a model that compiles beside its serving
    pin_attention(model)
    context = int(model.config.max_position_embeddings)
    config = json.loads((model_root / "tiny" / "config.json").read_text())
    small, cut = cut_down(config, {name: str(device) for name, device in model.hf_device_map.items()})
    job = CompileJob(config=small, device_map=cut, dtype="float32", quantization=None, rows=64, context=context,
                     riding=False, threads=torch.get_num_threads(), key="served", memory={})
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(job.config))
    (folder / "job.json").write_text(json.dumps(job.__dict__))
    monkeypatch.setenv(REGIONS, str(tmp_path / "store"))
    try:
        compile_process.run(folder)
        assert warm_marks.warmed("served") and region_store.region_totals().compiled > 0
        torch._dynamo.reset()  # as the serving process: nothing traced, the store read again
        region_store.keep_regions_in(tmp_path / "store")
        before = region_store.region_totals()
        warm_up(model, max_rows=64, context=context, beside_serving=True, key="served")
        after = region_store.region_totals()
        assert after.compiled == before.compiled and after.loaded > before.loaded
        compiled, eager = (tokens(model, compile=True), tokens(model, compile=False))
        assert compiled == eager and region_store.region_totals().compiled == before.compiled  # run by those entries
    finally:
        region_store.keep_regions_in(None)


def tokens(model, compile: bool) -> list[tuple[object, int]]:
    """Greedy tokens of a continuous batch on `model` whose prompts join as it runs (its steps compiled or eager)."""
    from devmap.generation.continuous import SlotRequest, generate_continuous

    waiting = [SlotRequest([3, 9, 4, 7, 1], 6, "b"), SlotRequest(list(range(5, 17)), 5, "c")]
    got: list[tuple[object, int]] = []
    generate_continuous(model, [SlotRequest([5, 8, 2], 8, "a")], lambda *a: [waiting.pop()] if waiting else [],
                        lambda owner, token: got.append((owner, token)) or False, rows=4, first_slot=16,
                        cache_len=32, compile=compile)
    return got


def _job(**changes) -> CompileJob:
    fields = dict(config={}, device_map={"": "cpu"}, dtype="float32", quantization=None,
                  rows=8, context=64, riding=False, threads=1, key="k", memory={})
    return CompileJob(**{**fields, **changes})


def test_a_compile_process_that_fails_is_logged_with_its_reason_and_leaves_the_compile_here(caplog):
    with caplog.at_level(logging.WARNING, logger="devmap.serving"):
        assert compile_elsewhere(_job(), lambda: False, poll=0.05) is None
    assert "compiling the steps in a process of their own failed" in caplog.text
    assert "config.json" in caplog.text  # its last line: why the cut-down model did not load


def test_a_compile_process_ends_when_its_model_is_unloaded(monkeypatch, caplog):
    started = []
    popen = compile_process.subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(compile_process.subprocess, "Popen", recorded)
    with caplog.at_level(logging.WARNING, logger="devmap.serving"):
        assert compile_elsewhere(_job(), lambda: True, poll=0.05) is None
    assert started[0].returncode is not None and started[0].returncode != 0  # ended, not left running
    assert "failed" not in caplog.text  # an unload is not a failure


def test_the_job_carries_the_served_models_choices_not_the_cut_down_ones(model_root, monkeypatch, tmp_path):
    """Whether joiners ride follows a model's size where nobody says: the job names the served model's choice, which
    the one-layer model would not make; no region store (no key), a store that holds the entries already or no room on
    a GPU: no job."""
    import devmap
    from devmap.generation import mixed_joins, region_store
    from devmap.serving import warm_marks
    from devmap.serving.compile_process import job_for

    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    assert "on cpu" in job_for(model, model_root / "tiny", 8, 256, None, "k", 0)  # no GPU memory to compile on
    monkeypatch.setattr(compile_process, "room", lambda model, device_map, kv_room, others: {"0": 1 << 30})
    monkeypatch.setattr(mixed_joins, "rides_by_default", lambda model: model.config.num_hidden_layers > 1)
    job = job_for(model, model_root / "tiny", 8, 256, None, "k", 0)
    assert job.riding is True and job.config["num_hidden_layers"] == 1 and job.key == "k"
    assert job_for(model, model_root / "tiny", 8, 256, False, "k", 0).riding is False
    assert "no compile cache" in job_for(model, model_root / "tiny", 8, 256, None, None, 0)  # no entries come back
    region_store.keep_regions_in(tmp_path)
    try:
        warm_marks.mark("k", whole=True)
        assert "holds them already" in job_for(model, model_root / "tiny", 8, 256, None, "k", 0)
    finally:
        region_store.keep_regions_in(None)


def test_regions_the_compile_process_left_out_compile_here_and_the_next_start_loads_them(model_root, compiled_on_cpu,
                                                                                         monkeypatch, tmp_path,
                                                                                         caplog):
    """A compile's process whose entries did not cover a call (here: none at all): the light warm-up compiles the
    region in the serving process, with a warning, and the warm marker stays, so the next start loads every entry
    instead of compiling beside again (and again)."""
    from devmap.compat import ahead_of_time_keeps
    from devmap.generation import region_store
    from devmap.serving import EngineLimits, ModelRegistry, warm_marks
    from devmap.serving import warm_up as warm_up_module

    if not ahead_of_time_keeps("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves inductor's entries only")
    monkeypatch.setattr(warm_up_module, "compiles", lambda model, wanted, quantization: wanted is not False)
    monkeypatch.setattr(warm_marks, "warm_key", lambda *args: "tiny")
    monkeypatch.setattr(warm_up_module, "warm_key", lambda *args: "tiny")
    monkeypatch.setattr(compile_process, "job_for", lambda *args: object())

    def elsewhere(job, stop):
        warm_marks.mark("tiny", whole=True)  # as a whole pass that kept nothing this process's calls accept
        return 1.0

    monkeypatch.setattr(compile_process, "compile_elsewhere", elsewhere)
    region_store.keep_regions_in(tmp_path)
    try:
        registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=EngineLimits(compile_beside=True))
        with caplog.at_level(logging.WARNING, logger="devmap.serving"):
            resident = registry.load(model_root / "tiny")
            assert resident.compiling.wait(300) and resident.compiling.failure is None
        assert resident.compiled and warm_marks.warmed("tiny")
        assert "the compile's process left" in caplog.text
        assert resident.load_seconds["compile"] >= 1.0  # the process's seconds count in the compile phase
    finally:
        region_store.keep_regions_in(None)
