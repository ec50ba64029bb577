"""Which models a service compiles, and the compile at load (aot_eager on CPU: inductor's tracing and guards)."""

import copy

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


def test_a_model_that_compiles_beside_its_serving_runs_its_eager_steps_before_it_answers(model_root):
    import devmap
    from devmap.serving.warm_up import eager_first_steps

    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    context = int(model.config.max_position_embeddings)
    eager_first_steps(model, max_rows=64, context=context)
    assert step_cache(model, "continuous").shapes == 0  # nothing kept: its steps run uncaptured, as while it compiles
    eager_first_steps(model, max_rows=1, context=8)  # a context shorter than its prompt
