"""Which models a service compiles, and the compile at load (aot_eager on CPU: inductor's tracing and guards)."""

import copy
import time

import pytest
import torch

from devmap.generation.step_cache import step_cache
from devmap.planning.quantization import parse_quantization
from devmap.serving import EngineLimits, ModelRegistry
from devmap.serving.warm_up import compiles, warm_up


class Placed(torch.nn.Module):
    def __init__(self, device_map):
        super().__init__()
        self.hf_device_map = device_map


def test_a_service_compiles_unquantized_and_int8_models_whose_blocks_are_all_on_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compiles(Placed({"model": 0, "lm_head": 1}), None, None)
    assert compiles(Placed({"": 0}), True, None)
    assert not compiles(Placed({"": 0}), False, None)  # --no-compile
    int8, int4, nf4 = (parse_quantization(scheme) for scheme in ("int8", "int4", "nf4"))
    assert not compiles(Placed({"": 0}), None, int8)  # no joined layers: torchao's products (see below)
    assert not compiles(Placed({"": 0}), None, int4) and not compiles(Placed({"": 0}), None, nf4)  # eager...
    assert compiles(Placed({"": 0}), True, int4)  # unless --compile asks
    assert not compiles(Placed({"": 0}), False, int8)
    assert not compiles(Placed({"model": 0, "lm_head": "cpu"}), None, None)  # offloaded: no graphs at all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not compiles(Placed({"": "cpu"}), True, None)


def test_an_int8_model_compiles_by_default_only_where_devmaps_products_read_every_layer(monkeypatch):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from devmap.compat import torchao_int8_rows
    from devmap.generation.joined_projections import join_projections

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    model = AutoModelForCausalLM.from_config(config).eval()
    torchao_int8_rows([m for m in model.model.layers.modules() if type(m) is torch.nn.Linear],
                      Int8WeightOnlyConfig(set_inductor_config=False))
    model.hf_device_map = {"": 0}
    int8 = parse_quantization("int8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # after transformers' imports, which check it
    unjoined = copy.deepcopy(model)
    assert not compiles(model, None, int8)  # torchao's products in every layer
    assert join_projections(model) == 6
    assert compiles(model, None, int8)  # devmap's products in every layer
    model.model.layers[1] = unjoined.model.layers[1]  # a layer whose projections found no room to join
    assert not compiles(model, None, int8)
    assert compiles(model, True, int8)  # --compile


def test_a_cpu_service_loads_without_compiling(model_root):
    registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=EngineLimits(compile=None))
    resident = registry.load(model_root / "tiny", model_id="plain")
    assert not resident.compiled and resident.describe()["compiled"] is False


def test_the_warm_up_compiles_the_step_once(model_root, compiled_on_cpu):
    import devmap

    counters = compiled_on_cpu
    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    warm_up(model, max_rows=64, context=int(model.config.max_position_embeddings))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert step_cache(model, "continuous").shapes == 1  # its steps stay, for a first batch of its shape


def test_a_warm_up_that_ran_whole_lets_the_next_start_skip_its_pass_over_every_shape(model_root, compiled_on_cpu,
                                                                                      tmp_path, monkeypatch):
    import devmap
    from devmap.compat import ahead_of_time_keeps
    from devmap.generation import region_store
    from devmap.serving import warm_marks
    from devmap.serving import warm_up as warm_up_module

    if not ahead_of_time_keeps("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves inductor's entries only")
    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    assert warm_marks.warm_key(model, 64, 256, None) is None  # no store; and a CPU model never gets a key
    passes = []
    batch = warm_up_module.continuous_batch

    def seen(*args, **kwargs):
        passes.append(kwargs["every_shape"])
        return batch(*args, **kwargs)

    monkeypatch.setattr(warm_up_module, "continuous_batch", seen)
    monkeypatch.setattr(warm_up_module, "warm_key", lambda *args: "tiny")
    context = int(model.config.max_position_embeddings)

    def start() -> region_store.RegionTotals:  # as a fresh process: the store read again, nothing traced yet
        region_store.keep_regions_in(tmp_path)
        torch._dynamo.reset()
        before = region_store.region_totals()
        warm_up(model, max_rows=64, context=context)
        after = region_store.region_totals()
        return region_store.RegionTotals(after.compiled - before.compiled, after.loaded - before.loaded)

    try:
        first = start()
        assert passes == [True] and first.compiled > 0 and warm_marks.warmed("tiny")
        again = start()
        assert passes[-1] is False and again.compiled == 0 and again.loaded > 0 and warm_marks.warmed("tiny")
        for entry in tmp_path.rglob(f"*{region_store.SUFFIX}"):
            entry.unlink()  # the store lost its entries: the light start compiles, and the next one is whole again
        lost = start()
        assert passes[-1] is False and lost.compiled > 0 and not warm_marks.warmed("tiny")
    finally:
        region_store.keep_regions_in(None)


def test_served_shapes_are_kept_beside_a_whole_warm_ups_marker_and_read_back_only_where_possible(tmp_path, caplog):
    from devmap.generation import region_store
    from devmap.serving.scheduler import BatchShape
    from devmap.serving.warm_marks import ServedShapes, mark, remember, served_shapes, warmed

    shapes = ServedShapes(BatchShape(32, 448, 512), ((32, 448), (32, 512)))
    region_store.keep_regions_in(tmp_path)
    try:
        remember("m", shapes)
        assert not warmed("m") and served_shapes("m", 4096) is None  # no whole warm-up yet: nothing kept
        mark("m", whole=True)
        assert served_shapes("m", 4096) is None  # a whole warm-up, nothing served yet
        remember("m", shapes)
        mark("m", whole=True)  # a later whole warm-up keeps what was served
        assert warmed("m") and served_shapes("m", 4096) == shapes and served_shapes("m", 0) == shapes
        assert served_shapes("m", 256) is None  # a cache longer than the model's context: not this model's batch
        marker = next((tmp_path / "warmed").glob("m.*"))
        marker.write_text('{"batch": {"rows": 32}}')
        with caplog.at_level("WARNING", logger="devmap.serving"):
            assert served_shapes("m", 4096) is None and warmed("m")  # unreadable: ignored, the marker stays
        assert "ignoring the served shapes" in caplog.text
        mark("m", whole=False)  # the store lost entries: the marker and what it kept go
        assert not warmed("m") and served_shapes("m", 4096) is None
        assert not list((tmp_path / "warmed").glob("*.tmp"))
    finally:
        region_store.keep_regions_in(None)
    assert served_shapes("m", 4096) is None and served_shapes(None, 4096) is None  # no store


def test_a_light_warm_up_runs_its_batch_at_the_shapes_the_model_served_at(model_root, compiled_on_cpu, tmp_path,
                                                                           monkeypatch):
    """Once a whole warm-up ran and the model served, a restart's warm-up runs the batch it served at and makes the
    join shapes it met there (captured on GPUs, kept for its first batch); without the service's lanes, or with a
    record the model cannot have made, it runs its small batch."""
    import devmap
    from devmap.compat import ahead_of_time_keeps
    from devmap.generation import region_store
    from devmap.serving import warm_up as warm_up_module
    from devmap.serving.scheduler import BatchShape
    from devmap.serving.warm_marks import ServedShapes, remember

    if not ahead_of_time_keeps("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves inductor's entries only")
    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    context = int(model.config.max_position_embeddings)
    opened = []
    batch = warm_up_module.continuous_batch

    def seen(*args, **kwargs):
        opened.append(kwargs)
        return batch(*args, **kwargs)

    monkeypatch.setattr(warm_up_module, "continuous_batch", seen)
    monkeypatch.setattr(warm_up_module, "warm_key", lambda *args: "tiny")
    served = ServedShapes(BatchShape(16, 64, 256), ((0, 64), (0, 128)))
    region_store.keep_regions_in(tmp_path)
    try:
        first = warm_up(model, max_rows=64, context=context, lanes=1)
        remember("tiny", served)
        assert first.served is None and opened[-1]["rows"] == 8 and opened[-1]["every_shape"]
        again = warm_up(model, max_rows=64, context=context, lanes=1)
        assert again.served == served and not opened[-1]["every_shape"]
        assert (opened[-1]["rows"], opened[-1]["first_slot"], opened[-1]["cache_len"]) == (16, 64, 256)
        assert opened[-1]["join_shapes"] == served.joins and opened[-1]["lanes"] == 1
        assert warm_up(model, max_rows=64, context=context).served is None  # lanes unknown: its small batch
        assert opened[-1]["rows"] == 8 and not opened[-1]["join_shapes"]
        remember("tiny", ServedShapes(BatchShape(16, 254, 256)))  # no room for the warm-up's tokens
        assert warm_up(model, max_rows=64, context=context, lanes=1).served is None
    finally:
        region_store.keep_regions_in(None)


def test_a_service_keeps_the_shapes_its_compiled_batches_served_at_for_its_next_start(tmp_path):
    from devmap.generation import region_store
    from devmap.serving.core import EngineCore
    from devmap.serving.jobs import GenerationParams, Job
    from devmap.serving.scheduler import BatchShape
    from devmap.serving.warm_marks import ServedShapes, mark, served_shapes

    from .fakes import Collected, FakeBatches, alone, fake_resident

    region_store.keep_regions_in(tmp_path)
    registry = ModelRegistry()
    resident = fake_resident()
    resident.compiled, resident.warm_key = True, "m-key"
    registry.add(resident)
    batches, collected = FakeBatches(), Collected()
    core = EngineCore(registry, EngineLimits(), collected, batches=batches)
    core.start()
    try:
        mark("m-key", whole=True)
        jobs = [Job(n, "m", [5, 6, 7], GenerationParams(max_new_tokens=8)) for n in range(3)]
        for job in jobs:
            core.add(job)
        assert collected.wait([job.id for job in jobs], 30)
        assert all(collected.tokens[job.id] == alone([5, 6, 7], 8) for job in jobs)
        kept = ServedShapes(BatchShape(*batches.shapes[-1]), ((0, 64),))
        deadline = time.monotonic() + 30  # written as the batch ends, after its requests got their last tokens
        while served_shapes("m-key", 256) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served_shapes("m-key", 256) == kept and resident.kept_shapes == kept
    finally:
        core.close(30)
        region_store.keep_regions_in(None)


def test_a_model_compiles_beside_its_serving_on_its_first_start_and_before_it_serves_on_later_ones(tmp_path,
                                                                                                    monkeypatch):
    from devmap.generation import region_store
    from devmap.serving import prepare, warm_marks

    monkeypatch.setattr(prepare, "_compiles", lambda model, limits: True)
    model, auto = object(), EngineLimits(compile_beside=None)
    region_store.keep_regions_in(tmp_path)
    try:
        assert prepare.compiles_beside(model, auto, None, "m")  # nothing of it stored: it answers at once
        warm_marks.mark("m", whole=True)  # a warm-up of it ran whole with this cache
        assert not prepare.compiles_beside(model, auto, None, "m")  # a restart loads its steps first
        assert prepare.compiles_beside(model, auto, True, "m")  # --compile-beside: at every start
        assert not prepare.compiles_beside(model, auto, False, "m")  # --compile-first
        warm_marks.mark("m", whole=False)
        assert not prepare.compiles_beside(model, EngineLimits(compile=True), None, "m")  # --compile: first
        monkeypatch.setattr(prepare, "_compiles", lambda model, limits: False)
        assert not prepare.compiles_beside(model, auto, True, "m")  # steps that do not compile
    finally:
        region_store.keep_regions_in(None)


def test_a_model_that_compiles_beside_its_serving_runs_its_eager_steps_before_it_answers(model_root):
    import devmap
    from devmap.serving.warm_up import eager_first_steps

    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    context = int(model.config.max_position_embeddings)
    eager_first_steps(model, max_rows=64, context=context)
    assert step_cache(model, "continuous").shapes == 0  # nothing kept: its steps run uncaptured, as while it compiles
    eager_first_steps(model, max_rows=1, context=8)  # a context shorter than its prompt
