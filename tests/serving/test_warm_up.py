"""Which models a service compiles, and the compile at load (aot_eager on CPU: inductor's tracing and guards)."""

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
    assert compiles(Placed({"": 0}), None, int8)  # devmap's own products read torchao's int8 weights
    assert not compiles(Placed({"": 0}), None, int4) and not compiles(Placed({"": 0}), None, nf4)  # eager...
    assert compiles(Placed({"": 0}), True, int4)  # unless --compile asks
    assert not compiles(Placed({"": 0}), False, int8)
    assert not compiles(Placed({"model": 0, "lm_head": "cpu"}), None, None)  # offloaded: no graphs at all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not compiles(Placed({"": "cpu"}), True, None)


def test_a_cpu_service_loads_without_compiling(model_root):
    registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=EngineLimits(compile=None))
    resident = registry.load(model_root / "tiny", model_id="plain")
    assert not resident.compiled and resident.describe()["compiled"] is False


def test_the_warm_up_compiles_the_step_once_and_keeps_no_batch(model_root, compiled_on_cpu):
    import devmap

    counters = compiled_on_cpu
    model = devmap.load(str(model_root / "tiny"), device_map="auto", max_memory="cpu=2GB")
    warm_up(model, max_rows=64, context=int(model.config.max_position_embeddings))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert not step_cache(model, "continuous").shapes  # its captured batch is freed
