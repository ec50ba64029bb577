"""A LLaMA layout (what a plan of its weights places, without transformers) against transformers' own model: the same
names, shapes, buffers, ties and whole blocks, hence the same plans; and a fresh `devmap plan` imports no
transformers."""

import json
import subprocess
import sys

import pytest
import torch
from accelerate.utils import find_tied_parameters

import devmap
from devmap.errors import SourceError
from devmap.planning.budget import Budget
from devmap.planning.llama_layout import build_layout, is_layout
from devmap.planning.models import LLAMA_PRESETS, resolve_source
from devmap.planning.placement import STRATEGIES
from devmap.planning.planner import plan_model

VARIANTS = {  # config values transformers' LLaMA reads beyond the presets' (each changes a tensor's shape or a tie)
    "biased": dict(attention_bias=True, mlp_bias=True),
    "head_dim": dict(head_dim=24),
    "untied": dict(tie_word_embeddings=False),
    "no kv heads": dict(num_key_value_heads=None),
}


def described(model):
    """Everything planning reads of a module tree."""
    modules = {name: type(module).__name__ for name, module in model.named_modules()
               if not name.endswith("act_fn")}  # transformers' activation class; no tensors, inside a whole block
    return {
        "parameters": [(n, tuple(p.shape), p.dtype, p.device.type) for n, p in model.named_parameters()],
        "buffers": [(n, tuple(b.shape), b.dtype, b.device.type) for n, b in model.named_buffers()],
        "kept": {n: sorted(m._non_persistent_buffers_set) for n, m in model.named_modules()
                 if m._non_persistent_buffers_set},
        "tied": sorted(map(sorted, find_tied_parameters(model))),
        "modules": modules,
        "no split": sorted(model._no_split_modules),
    }


def tiny_settings(**changes):
    settings = {"model_type": "llama", **LLAMA_PRESETS["llama-tiny"], "hidden_size": 96, **changes}
    return {k: v for k, v in settings.items() if v is not None}


@pytest.mark.parametrize("preset", list(LLAMA_PRESETS))
def test_a_presets_layout_is_transformers_model_as_planning_reads_it(preset):
    source = resolve_source(preset)
    layout = source.layout()
    assert is_layout(layout) and not is_layout(source.build("meta"))
    assert described(layout) == described(source.build("meta"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_config_variants_layout_is_transformers_model(tmp_path, variant):
    settings = tiny_settings(**VARIANTS[variant])
    (tmp_path / "config.json").write_text(json.dumps(settings))
    source = resolve_source(str(tmp_path))
    assert source.settings == settings and source.transformers_config is None  # read lazily
    assert described(source.layout()) == described(source.build("meta"))
    assert source.layout().config.hidden_size == 96  # transformers' config, read when asked for


@pytest.mark.parametrize("preset", ["tinyllama-1.1b", "llama-2-13b", "llama-3-8b"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plans_of_a_layout_are_the_plans_of_transformers_model(preset, strategy):
    """Budgets that split the model over GPUs, cpu and disk: every map and every device's bytes agree."""
    source = resolve_source(preset)
    whole = source.min_params * 2
    limits = {0: whole // 5, 1: whole // 4, 2: whole // 4, "cpu": whole // 5, "disk": whole}
    plans = [plan_model(model, source, strategy, Budget(limits, True), torch.bfloat16)
             for model in (source.layout(), source.build("meta"))]
    assert plans[0].device_map == plans[1].device_map
    assert plans[0].devices == plans[1].devices
    assert (plans[0].total_params, plans[0].total_bytes) == (plans[1].total_params, plans[1].total_bytes)


def test_the_layer_table_and_runtime_plans_run_transformers_model():
    result = devmap.plan("llama-tiny", gpus=2, gpu_memory="1GiB", dtype="bf16")
    assert is_layout(result.model)
    from devmap.planning.layers import layer_table

    rows = layer_table(result, (1, 8))
    assert rows[0].output_shape == [1, 8, 64] and {r.device for r in rows} == {"cuda:0", "cuda:1"}
    workload = devmap.planning.workload.parse_workload("generate", causal_lm=True, batch=2, seq_len=32)
    assert not is_layout(devmap.plan("llama-tiny", gpus=2, gpu_memory="1GiB", workload=workload).model)


def test_a_layout_refuses_what_it_cannot_build(tmp_path):
    with pytest.raises(SourceError, match="has no intermediate_size"):
        build_layout({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4}, "x",
                     lambda: None)
    (tmp_path / "config.json").write_text(json.dumps(tiny_settings(num_attention_heads=5)))
    with pytest.raises(SourceError, match="not a multiple of num_attention_heads"):
        devmap.plan(str(tmp_path))
    partial = {k: v for k, v in tiny_settings().items() if k != "vocab_size"}  # transformers' default fills it in
    (tmp_path / "config.json").write_text(json.dumps(partial))
    source = resolve_source(str(tmp_path))
    assert source.settings is None and not is_layout(source.layout())
    (tmp_path / "config.json").write_text(json.dumps(tiny_settings(quantization_config={"quant_method": "awq"})))
    with pytest.raises(SourceError, match="pre-quantized weights"):
        resolve_source(str(tmp_path))


def test_a_fresh_plan_of_a_llama_model_imports_neither_transformers_nor_torchs_compiler(tmp_path):
    """What keeps `devmap plan llama-tiny` near the import of torch itself in a fresh process (nor devmap's
    serving, generation or kernels)."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_settings()))
    for source in ("llama-tiny", str(tmp_path)):
        code = ("import sys, json\nfrom devmap.cli import main\n"
                f"try:\n    main.main(['plan', {source!r}, '--gpus', '2', '--gpu-memory', '1GiB', '--json'])\n"
                "except SystemExit:\n    pass\n"
                "print(json.dumps(sorted(m for m in ('transformers', 'torchvision', 'torch._dynamo', "
                "'devmap.serving', 'devmap.generation', 'devmap.kernels') if m in sys.modules)))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        *printed, imported = done.stdout.strip().splitlines()
        assert json.loads(imported) == [], source
        expected = devmap.plan(source, gpus=2, gpu_memory="1GiB").device_map
        assert json.loads("\n".join(printed))["device_map"] == expected
