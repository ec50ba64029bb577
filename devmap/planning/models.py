"""Model sources: torchvision ResNets, LLaMA presets, local Hugging Face directories and user modules, built on the
meta device."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from .config_limits import MAX_CONFIG_BYTES, check_config
from ..errors import SourceError
from .member_paths import check_metadata_paths

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")

# Published shapes (hidden, intermediate, layers, heads, kv heads, vocab, context, rope theta).
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True, dtype="float32",
    ),
    "tinyllama-1.1b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
        vocab_size=32000, max_position_embeddings=2048,
    ),
    "llama-2-7b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    ),
    "llama-2-13b": dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096,
    ),
    "llama-2-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=32000, max_position_embeddings=4096,
    ),
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    ),
    "llama-3-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    ),
}
PRESETS = RESNETS + tuple(LLAMA_PRESETS)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class ModelSource:
    """Where a model comes from and how to build it; `kind` is torchvision, llama-preset, hf-dir or module."""

    name: str
    kind: str
    config: Any = None
    path: Path | None = None
    module: nn.Module | None = None
    default_dtype: torch.dtype = torch.float32
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_causal_lm(self) -> bool:
        return self.kind in ("llama-preset", "hf-dir")

    def build(self, device: str | torch.device = "meta", cpu_buffers: bool = False) -> nn.Module:
        """Build the model's modules on `device` (meta: no memory, no weights) in float32; a transformers model
        without its constructor's weight init (whoever builds it reads or initializes its tensors).

        With `cpu_buffers`, parameters go on meta but buffers are real CPU tensors, so buffers that no
        checkpoint holds (rotary inv_freq) keep the values the constructor computed.
        """
        if self.module is not None:
            return self.module
        if cpu_buffers:
            from accelerate import init_empty_weights

            context = init_empty_weights(include_buffers=False)
        else:
            context = torch.device(device)
        with context:
            if self.kind == "torchvision":
                import torchvision

                model = getattr(torchvision.models, self.name)(**self.extra)
            else:
                from transformers import AutoModelForCausalLM

                from ..compat import weights_left_uninitialized

                with weights_left_uninitialized():  # devmap reads or initializes every tensor itself
                    model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        if hasattr(model, "tie_weights"):  # transformers ties in its init, left out above; init_empty_weights also
            model.tie_weights()  # re-wraps each registered parameter, which unties them
        return model.eval()

    def sample_input(self, shape: tuple[int, ...] | None = None, device: str | torch.device = "meta") -> torch.Tensor:
        """A random input of `shape` (default: one 224x224 image, or 128 tokens)."""
        if self.is_causal_lm:
            shape = shape or (1, 128)
            if device == "meta":
                return torch.zeros(shape, dtype=torch.long, device=device)
            return torch.randint(0, self.config.vocab_size, shape, device=device)
        shape = shape or (1, 3, 224, 224)
        if device == "meta":
            return torch.zeros(shape, device=device)
        return torch.randn(shape, device=device)


def default_no_split(model: nn.Module) -> list[str]:
    """Classes whose instances must stay whole on one device: residual blocks and transformer layers."""
    found = getattr(model, "_no_split_modules", None) or []
    names = set(found)
    for module in model.modules():
        if type(module).__name__ in ("Bottleneck", "BasicBlock"):
            names.add(type(module).__name__)
    return sorted(names)


def llama_config(preset: str) -> Any:
    """The transformers LlamaConfig of a preset."""
    from transformers import LlamaConfig

    kwargs = dict(LLAMA_PRESETS[preset])
    dtype = kwargs.pop("dtype", "bfloat16")
    config = LlamaConfig(rms_norm_eps=1e-5, **kwargs)
    config.dtype = dtype
    return config


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in ("float32", "float16", "bfloat16"):
        return getattr(torch, value)
    return torch.float32


def _read_hf_config(path: Path) -> Any:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SourceError(f"{path} has no config.json: "
                          "a model directory needs the config.json that transformers writes")
    raw = _read_json(config_file)
    if "model_type" not in raw:
        raise SourceError(f"{config_file} has no 'model_type': it is not a config.json transformers wrote")
    min_params = check_config(raw, str(config_file))
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        config.devmap_min_params = min_params
        return config
    except (ValueError, KeyError, OSError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(
            f"{config_file} describes model_type {raw['model_type']!r}, which transformers cannot read: {first}"
        ) from None


def _read_json(config_file: Path) -> dict[str, Any]:
    try:
        if config_file.stat().st_size > MAX_CONFIG_BYTES:
            raise SourceError(f"{config_file} is over {MAX_CONFIG_BYTES >> 20} MiB: "
                              "not a config.json transformers wrote")
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise SourceError(f"{config_file} is not valid JSON ({exc}); rewrite it or re-save the model") from None
    except OSError as exc:
        raise SourceError(f"cannot read {config_file}: {exc.strerror or exc}") from None
    if not isinstance(raw, dict):
        raise SourceError(f"{config_file} is not a JSON object: it is not a config.json transformers wrote")
    return raw


def _torchvision_dir(path: Path) -> ModelSource | None:
    """A directory written by `devmap save` for a torchvision ResNet: config.json names "torchvision_model"."""
    config_file = path / "config.json"
    raw = _read_json(config_file) if config_file.is_file() else None
    if raw is None or "torchvision_model" not in raw:
        return None
    check_config(raw, str(config_file))
    arch = raw["torchvision_model"]
    if arch not in RESNETS:
        raise SourceError(f"{config_file} names torchvision model {arch!r}; devmap knows {', '.join(RESNETS)}")
    extra = {"num_classes": raw.get("num_classes") or 1000}
    dtype = raw.get("dtype")
    default = getattr(torch, dtype) if dtype in ("float32", "float16", "bfloat16") else torch.float32
    return ModelSource(name=arch, kind="torchvision", path=path, extra=extra, default_dtype=default)


def resolve_source(source: Union[str, Path, nn.Module, ModelSource]) -> ModelSource:
    """Turn a preset name, a local directory or an nn.Module into a ModelSource (one already resolved is returned as
    it is: its config is read once); never contacts a hub."""
    if isinstance(source, ModelSource):
        return source
    if isinstance(source, nn.Module):
        return ModelSource(name=type(source).__name__, kind="module", module=source,
                           default_dtype=_module_dtype(source))
    if not isinstance(source, (str, Path)):
        raise SourceError(f"unknown model source {source!r}: pass a preset name, a local directory or an nn.Module")
    name = str(source)
    if name in RESNETS:
        return ModelSource(name=name, kind="torchvision")
    if name in LLAMA_PRESETS:
        config = llama_config(name)
        return ModelSource(name=name, kind="llama-preset", config=config, default_dtype=_config_dtype(config))
    path = Path(name).expanduser()
    if path.is_dir():
        check_metadata_paths(path)
        torchvision_source = _torchvision_dir(path)
        if torchvision_source is not None:
            return torchvision_source
        config = _read_hf_config(path)
        from transformers import AutoModelForCausalLM

        if type(config) not in AutoModelForCausalLM._model_mapping:
            raise SourceError(
                f"{path}/config.json describes a {config.model_type!r} model, which is not a causal language model "
                "transformers knows; devmap loads causal LMs (LLaMA first) and torchvision ResNets"
            )
        quantized = getattr(config, "quantization_config", None)
        if quantized is not None:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
            raise SourceError(
                f"{path} holds pre-quantized weights ({method}); devmap quantizes while it loads a full-precision "
                "checkpoint: pass the original checkpoint with --quantize, or load this one with transformers' "
                "from_pretrained"
            )
        return ModelSource(name=name, kind="hf-dir", config=config, path=path, default_dtype=_config_dtype(config))
    if path.exists():
        raise SourceError(f"{path} is a file: a model source is a preset name or a directory with config.json")
    if _HUB_ID.match(name):
        raise SourceError(
            f"{name!r} is not a local path: devmap never contacts a model hub; "
            "pass a local directory holding config.json and safetensors files"
        )
    raise SourceError(
        f"unknown model source {name!r}: use a preset ({', '.join(PRESETS)}) "
        "or a local directory holding a config.json"
    )


def _module_dtype(module: nn.Module) -> torch.dtype:
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32
