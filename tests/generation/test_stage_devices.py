"""Which devices a pipeline stage's work touches besides its own (the embedding's for the first stage, the final
norm's and head's for the last), and so which stages' steps may be captured as CUDA graphs and which streams a stage
must fold into its events: decided from the placement alone (the devices here are never used)."""

import torch

from devmap.generation.causal_lm import CausalLMStages, LMStage


def stages_on(layers: list[str], embed: str, norm: str, head: str) -> CausalLMStages:
    stages = CausalLMStages.__new__(CausalLMStages)  # the placement only: no model behind it
    stages.stages = [LMStage(torch.device(d), []) for d in layers]
    stages.embed_device, stages.norm_device, stages.head_device = map(torch.device, (embed, norm, head))
    return stages


def test_a_tied_head_on_the_first_gpu_is_the_last_stages_other_device():
    stages = stages_on(["cuda:0", "cuda:1"], embed="cuda:0", norm="cuda:1", head="cuda:0")
    assert stages.other_devices(0) == [] and stages.other_devices(1) == [torch.device("cuda:0")]
    assert stages.captures(0) and not stages.captures(1)


def test_an_embedding_elsewhere_keeps_the_first_stage_eager():
    stages = stages_on(["cuda:1", "cuda:2"], embed="cuda:0", norm="cuda:2", head="cuda:2")
    assert stages.other_devices(0) == [torch.device("cuda:0")] and not stages.captures(0)
    assert stages.captures(1)


def test_one_stage_holding_everything_touches_nothing_else():
    assert stages_on(["cuda:0"], "cuda:0", "cuda:0", "cuda:0").captures(0)
    alone = stages_on(["cuda:1"], embed="cuda:0", norm="cuda:1", head="cuda:0")
    assert alone.other_devices(0) == [torch.device("cuda:0")]  # listed once
