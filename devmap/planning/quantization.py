"""Quantization schemes as the planner sees them: which weights shrink, and to how many bytes each.

`int8` is 8-bit weight-only (torchao's Int8WeightOnlyConfig; bitsandbytes' LLM.int8 when a user passes
transformers' `BitsAndBytesConfig(load_in_8bit=True)`), `int4` is 4-bit weight-only with groups of 128 (torchao),
`nf4` is bitsandbytes' 4-bit NormalFloat (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`),
`fp8` is float8 (e4m3) weights with a scale per output row and activations quantized per token as they come
(torchao's Float8DynamicActivationFloat8WeightConfig with PerRow granularity: FP8 tensor cores, GPUs of compute
capability 8.9 and up).
As in transformers, only the Linear layers inside the model's blocks are quantized: embeddings, norms and the
output head (`lm_head`, and any module a BitsAndBytesConfig names in `llm_int8_skip_modules`) keep the model's
dtype. Sizes are the libraries' layouts: 1 byte (int8, fp8) or half a byte (int4, nf4) per weight through accelerate's
accounting, plus the scales (and int4's padding) each library keeps beside them (`extra_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import DoesNotFitError, UsageError

SCHEMES = ("int8", "int4", "nf4", "fp8")
LIBRARIES = {"int8": "torchao", "int4": "torchao", "nf4": "bitsandbytes", "fp8": "torchao"}
FP8_CAPABILITY = (8, 9)  # the first GPUs with FP8 tensor cores (Ada; Hopper is 9.0)
DEFAULT_SKIP = ("lm_head",)
INT4_GROUP = 128  # torchao Int4WeightOnlyConfig's group size
NF4_BLOCK = 64  # bitsandbytes' 4-bit block size


@dataclass(frozen=True)
class Quantization:
    """A scheme, the library that carries it out, and the modules left at the model's dtype."""

    scheme: str
    library: str
    skip_modules: tuple[str, ...] = DEFAULT_SKIP

    @property
    def bits(self) -> int:
        return 8 if self.scheme in ("int8", "fp8") else 4

    def weight_dtype(self) -> Any:
        """What accelerate counts each quantized weight as."""
        from accelerate.utils import CustomDtype

        return torch.int8 if self.bits == 8 else CustomDtype.INT4

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "library": self.library, "skip_modules": list(self.skip_modules)}


def parse_quantization(spec: Any) -> Quantization | None:
    """None, "int8" / "int4" / "nf4" / "fp8", a Quantization, or transformers' BitsAndBytesConfig."""
    if spec is None or isinstance(spec, Quantization):
        return spec
    if isinstance(spec, str):
        scheme = spec.strip().lower()
        if scheme in ("", "none"):
            return None
        if scheme not in SCHEMES:
            raise UsageError(f"unknown quantization {spec!r}: use one of {', '.join(SCHEMES)}")
        return Quantization(scheme, LIBRARIES[scheme])
    if type(spec).__name__ == "BitsAndBytesConfig":
        return _from_bitsandbytes(spec)
    raise UsageError(f"quantization must be one of {', '.join(SCHEMES)} or a transformers BitsAndBytesConfig, "
                     f"got {type(spec).__name__}")


def _from_bitsandbytes(config: Any) -> Quantization:
    skip = tuple(getattr(config, "llm_int8_skip_modules", None) or DEFAULT_SKIP)
    if getattr(config, "load_in_8bit", False):
        return Quantization("int8", "bitsandbytes", skip)
    if getattr(config, "load_in_4bit", False):
        kind = getattr(config, "bnb_4bit_quant_type", "fp4")
        if kind != "nf4":
            raise UsageError(f"BitsAndBytesConfig with bnb_4bit_quant_type={kind!r}: devmap loads 4-bit weights "
                             "as nf4 only; pass bnb_4bit_quant_type=\"nf4\"")
        return Quantization("nf4", "bitsandbytes", skip)
    raise UsageError("this BitsAndBytesConfig quantizes nothing: set load_in_8bit=True or load_in_4bit=True")


def check_quantizable(quantization: Quantization, is_causal_lm: bool, name: str, dtype: torch.dtype) -> None:
    """Refuse combinations that make no sense: a model without LLaMA-style blocks, or a float32 model (the
    quantized layers compute in 16-bit; ask for bfloat16 or float16, the default with quantization)."""
    if not is_causal_lm:
        raise UsageError(f"--quantize {quantization.scheme} applies to LLaMA-style models; {name} is not one "
                         "(its layers stay in floating point: drop --quantize)")
    if dtype not in (torch.bfloat16, torch.float16):
        raise UsageError(f"--quantize {quantization.scheme} with --dtype {str(dtype).removeprefix('torch.')}: "
                         "quantized layers compute in 16-bit and keep unquantized ones at the model's dtype; use "
                         "--dtype bfloat16 or float16")
    if quantization.scheme == "int4" and dtype != torch.bfloat16:
        raise UsageError("--quantize int4 with --dtype float16: torchao's int4 kernel (tinygemm) computes in "
                         "bfloat16 only; use --dtype bfloat16, or --quantize nf4 for float16")
    if quantization.scheme == "fp8" and dtype != torch.bfloat16:
        raise UsageError("--quantize fp8 with --dtype float16: torchao's float8 products with a scale per row "
                         "(torch._scaled_mm) give bfloat16 only; use --dtype bfloat16")


def quantized_weights(model: nn.Module, quantization: Quantization) -> list[str]:
    """Names of the weights the scheme quantizes: those of the Linear layers outside the skipped modules."""
    names = []
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if any(skip + "." in module_name + "." for skip in quantization.skip_modules):  # transformers' matching
            continue
        names.append(f"{module_name}.weight")
    return names


def special_dtypes(model: nn.Module, quantization: Quantization | None) -> dict[str, Any]:
    """{weight name: accelerate dtype} for the planner's size accounting (empty without quantization)."""
    if quantization is None:
        return {}
    dtype = quantization.weight_dtype()
    return {name: dtype for name in quantized_weights(model, quantization)}


def resolve_quantization(spec: Any, dtype: torch.dtype | None, source: Any) -> tuple[Quantization | None, torch.dtype]:
    """The quantization a plan or load asked for and its dtype (bfloat16 when quantizing and none was asked for,
    else the source's default), refusing combinations that make no sense for `source` (a ModelSource)."""
    quantization = parse_quantization(spec)
    if quantization is None:
        return None, dtype or source.default_dtype
    dtype = dtype or torch.bfloat16
    check_quantizable(quantization, source.is_causal_lm, source.name, dtype)
    return quantization, dtype


def check_placement(quantization: Quantization, devices: set[Any]) -> None:
    """Refuse a plan that puts quantized weights where their library cannot run them (what a load would refuse,
    so a plan says it first): no quantized block on disk, no 4-bit block on the CPU. It is a `DoesNotFitError`: the
    weights do not fit where they can run (a serving plan's search for its most rows takes it as "fewer rows")."""
    if "disk" in devices:
        raise DoesNotFitError(f"{quantization.scheme} blocks cannot be offloaded to disk (accelerate's offload "
                              "writes plain tensors, not the library's quantized ones): give the GPUs or the CPU "
                              "more --max-memory")
    if quantization.bits == 4 and "cpu" in devices:
        raise DoesNotFitError(f"{quantization.scheme} runs on GPUs only ({quantization.library}'s 4-bit kernels are "
                              "CUDA kernels), and the plan puts quantized blocks on the CPU: give the GPUs more "
                              "memory, or use --quantize int8 (torchao runs it on the CPU too)")
    if quantization.scheme == "fp8" and "cpu" in devices:
        raise DoesNotFitError("fp8 runs on GPUs with FP8 tensor cores only (compute capability 8.9 and up), and the "
                              "plan puts quantized blocks on the CPU: give the GPUs more memory, or use --quantize "
                              "int8 (torchao runs it on the CPU too)")


def check_fp8_cards(quantization: Quantization, capabilities: dict[Any, tuple[int, int] | None]) -> None:
    """Refuse fp8 on a device without FP8 tensor cores: `capabilities` maps each device that holds quantized blocks
    to its CUDA compute capability (None: not a GPU, or none visible)."""
    if quantization.scheme != "fp8":
        return
    for device, capability in capabilities.items():
        if capability is None or capability < FP8_CAPABILITY:
            found = "no CUDA GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
            raise UsageError(f"--quantize fp8 needs GPUs with FP8 tensor cores (compute capability 8.9 and up: Ada, "
                             f"Hopper and later); {device} has {found}: use --quantize int8 instead")


def larger_than_unquantized(quantization: Quantization) -> str:
    """Why a quantized plan can be larger than the unquantized one (narrow layers)."""
    if quantization.scheme == "int4":
        return ("int4 is larger here: torchao's tinygemm layout pads each weight to a multiple of 1024 input "
                "features and keeps a scale and zero point per group of 128; on layers this narrow the padding "
                "costs more than 4 bits save")
    return (f"{quantization.scheme} is larger here: its scales ({quantization.library}) cost more than the "
            "smaller weights save on layers this narrow")


def weight_extra_bytes(quantization: Quantization, out_features: int, in_features: int) -> int:
    """Bytes a library keeps for one quantized weight of shape (out, in) beyond 1 (int8, fp8) or ½ (4-bit) byte per
    weight: int8 (torchao and bitsandbytes) and fp8 (torchao) a float32 scale per output row; int4 (torchao's
    tinygemm layout) rows padded to a multiple of 1024 columns and columns to a multiple of 8 rows, plus a bfloat16
    scale and zero point per group of 128 of the padded weight; nf4 (bitsandbytes, blocks of 64) a float32 absmax
    per block."""
    if quantization.scheme in ("int8", "fp8"):
        return 4 * out_features
    if quantization.scheme == "int4":
        rows, columns = -(-out_features // 8) * 8, -(-in_features // 1024) * 1024
        padding = (rows * columns - out_features * in_features) // 2
        return padding + 2 * 2 * rows * (columns // INT4_GROUP)
    return 4 * -(-out_features * in_features // NF4_BLOCK)


def extra_bytes(model: nn.Module, quantization: Quantization | None) -> dict[str, int]:
    """{weight name: bytes the library keeps beyond accelerate's count (scales, padding)} for the planner."""
    if quantization is None:
        return {}
    return {name: weight_extra_bytes(quantization, *model.get_parameter(name).shape)
            for name in quantized_weights(model, quantization)}
