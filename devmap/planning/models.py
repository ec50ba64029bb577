"""Model sources: torchvision ResNets, LLaMA presets, local Hugging Face directories and user modules, built on the
meta device."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
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
    """Where a model comes from and how to build it; `kind` is torchvision, llama-preset, hf-dir or module.

    A LLaMA source (a preset, or a directory whose config.json says model_type "llama") keeps its config's values
    (`settings`) and reads transformers' config from them on first use (`config`): a plan of its weights places its
    `layout`, built from those values, and never imports transformers. Other causal LMs read transformers' config
    when they are resolved."""

    name: str
    kind: str
    path: Path | None = None
    module: nn.Module | None = None
    default_dtype: torch.dtype = torch.float32
    extra: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] | None = None
    min_params: int = 0  # a lower bound on the parameter count, from the config's sizes (0: not known)
    transformers_config: Any = field(default=None, repr=False, compare=False)

    @property
    def is_causal_lm(self) -> bool:
        return self.kind in ("llama-preset", "hf-dir")

    @property
    def config(self) -> Any:
        """transformers' config of a causal LM (read on first use), None for torchvision models and modules."""
        if self.transformers_config is None and self.settings is not None:
            if self.kind == "llama-preset":
                self.transformers_config = _preset_config(self.settings)
            else:
                assert self.path is not None
                self.transformers_config = _read_hf_config(self.path, self.settings["model_type"])
        return self.transformers_config

    def with_config(self, config: Any) -> "ModelSource":
        """This source with another transformers config (a shard's, of the same kind): built from it alone."""
        return replace(self, settings=None, transformers_config=config)

    def layout(self) -> nn.Module:
        """What a plan of the weights alone places: a LLaMA source's layout (`devmap.planning.llama_layout`, no
        transformers import), else the model built on the meta device."""
        if self.settings is not None:
            from .llama_layout import build_layout

            where = self.name if self.path is None else f"{self.path}/config.json"
            return build_layout(self.settings, where, lambda: self.config)
        return self.build("meta")

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
        config = self.config
        with context:
            if self.kind == "torchvision":
                import torchvision

                model = getattr(torchvision.models, self.name)(**self.extra)
            else:
                from transformers import AutoModelForCausalLM

                from ..compat import weights_left_uninitialized

                with weights_left_uninitialized():  # devmap reads or initializes every tensor itself
                    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
    return _preset_config(_preset_settings(preset))


def _preset_settings(preset: str) -> dict[str, Any]:
    """A preset's config values, as a config.json would spell them."""
    return {"model_type": "llama", "rms_norm_eps": 1e-5, "dtype": "bfloat16", **LLAMA_PRESETS[preset]}


def _preset_config(settings: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    kwargs = {k: v for k, v in settings.items() if k not in ("model_type", "dtype")}
    config = LlamaConfig(**kwargs)
    config.dtype = settings["dtype"]
    return config


def _settings_dtype(settings: dict[str, Any]) -> torch.dtype:
    value = settings.get("dtype", settings.get("torch_dtype"))
    return getattr(torch, value) if value in ("float32", "float16", "bfloat16") else torch.float32


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in ("float32", "float16", "bfloat16"):
        return getattr(torch, value)
    return torch.float32


def _read_hf_config(path: Path, model_type: str) -> Any:
    """transformers' config of a directory whose config.json `_hf_dir` checked; one line where it cannot read it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(
            f"{path / 'config.json'} describes model_type {model_type!r}, which transformers cannot read: {first}"
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
        settings = _preset_settings(name)
        return ModelSource(name=name, kind="llama-preset", settings=settings, default_dtype=_settings_dtype(settings),
                           min_params=check_config(settings, name))
    path = Path(name).expanduser()
    if path.is_dir():
        check_metadata_paths(path)
        torchvision_source = _torchvision_dir(path)
        if torchvision_source is not None:
            return torchvision_source
        return _hf_dir(name, path)
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


def _hf_dir(name: str, path: Path) -> ModelSource:
    """A local Hugging Face directory: a LLaMA one keeps its config's values (transformers reads them on first use),
    any other is read by transformers now, and must be a causal LM it knows."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SourceError(f"{path} has no config.json: "
                          "a model directory needs the config.json that transformers writes")
    raw = _read_json(config_file)
    if "model_type" not in raw:
        raise SourceError(f"{config_file} has no 'model_type': it is not a config.json transformers wrote")
    min_params = check_config(raw, str(config_file))
    quantized = raw.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        raise SourceError(
            f"{path} holds pre-quantized weights ({method}); devmap quantizes while it loads a full-precision "
            "checkpoint: pass the original checkpoint with --quantize, or load this one with transformers' "
            "from_pretrained"
        )
    from .llama_layout import names_every_size

    if raw["model_type"] == "llama" and names_every_size(raw):
        return ModelSource(name=name, kind="hf-dir", path=path, settings=raw, default_dtype=_settings_dtype(raw),
                           min_params=min_params)
    config = _read_hf_config(path, raw["model_type"])
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise SourceError(
            f"{path}/config.json describes a {config.model_type!r} model, which is not a causal language model "
            "transformers knows; devmap loads causal LMs (LLaMA first) and torchvision ResNets"
        )
    return ModelSource(name=name, kind="hf-dir", path=path, transformers_config=config,
                       default_dtype=_config_dtype(config), min_params=min_params)


def _module_dtype(module: nn.Module) -> torch.dtype:
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32
