"""A serving process's attention: scaled_dot_product_attention without its cuDNN backend, which builds a plan at the
first call of every shape (each new prompt length, each new pack width), stalling the batch that meets it."""

import torch

from devmap.serving import EngineLimits, ModelRegistry


def test_a_model_prepared_for_serving_leaves_cudnn_attention_off(model_root):
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        registry = ModelRegistry(model_root, "auto", "cpu=2GB",
                                 limits=EngineLimits(max_batch=4, max_prompt_tokens=32, max_new_tokens=8))
        registry.load(model_root / "tiny")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
