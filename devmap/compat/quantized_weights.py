"""torchao's and bitsandbytes' quantized weights, as devmap reads and writes them (the rows for them in
`devmap.compat`'s table): their tensor subclasses' fields, and their layouts taken apart into plain 4-bit codes and
scales for devmap's kernels."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def torchao_int8_rows(layers: list[nn.Module], config: Any) -> None:
    """`quantize_(layer, Int8WeightOnlyConfig())` for each Linear, as one `Int8Tensor.from_hp` per weight shape (rows
    are quantized independently: the same data and scales, without quantize_'s millisecond of Python per Linear)."""
    from torchao.quantization import Int8Tensor
    from torchao.quantization.utils import recommended_inductor_config_setter

    if config.set_inductor_config:
        recommended_inductor_config_setter()
    groups: dict[tuple, list[nn.Module]] = {}
    for layer in layers:
        groups.setdefault((tuple(layer.weight.shape), layer.weight.dtype, layer.weight.device), []).append(layer)
    for same in groups.values():
        stacked = Int8Tensor.from_hp(torch.stack([layer.weight.detach() for layer in same]), config.granularity)
        for i, layer in enumerate(same):
            zero = None if stacked.zero_point is None else stacked.zero_point[i].clone()
            weight = torchao_int8_weight(stacked.qdata[i].clone(), stacked.scale[i].clone(), zero, stacked)
            layer.weight = nn.Parameter(weight, requires_grad=False)


def torchao_int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(int8 data: out × in, scales: out × 1, zero point or None) of torchao's int8 weight-only weight with a scale per
    output row (`Int8Tensor`, no activation quantization); None for any other tensor (no torchao import for those)."""
    if (type(weight).__name__ != "Int8Tensor" or weight.act_quant_kwargs is not None or weight.qdata.dim() != 2
            or weight.act_pre_scale is not None or list(weight.block_size) != [1, weight.qdata.shape[1]]):
        return None
    return weight.qdata, weight.scale, weight.zero_point


def torchao_int8_weight(qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, like: Any) -> Any:
    """torchao's int8 weight-only weight of these tensors (a scale per output row), in `like`'s dtype."""
    from torchao.quantization import Int8Tensor

    return Int8Tensor(qdata, scale, [1, qdata.shape[1]], like.dtype, zero_point=zero)


def torchao_flat_state_dict(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """torchao's flattening of its tensor subclasses into plain tensors and metadata (what transformers reads)."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    return flatten_tensor_state_dict(state)


def stored_tensors(param: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (quantized) parameter is stored as: torchao's inner ones, bitsandbytes' data and scales."""
    names = getattr(param, "tensor_data_names", None)  # torchao's tensor subclasses
    if names:
        return [getattr(param, n) for n in names]
    state, scb = getattr(param, "quant_state", None), getattr(param, "SCB", None)
    return [param.data, *([state.absmax] if state is not None else []),
            *([scb] if isinstance(scb, torch.Tensor) else [])]


def torchao_int4_codes(weight: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor] | None:
    """(codes: out × in uint8 0..15, scales, zeros: out × groups) of torchao's int4 weight in tinygemm's layout
    (`Int4TilePackedTo4dTensor`: w = (q - 8) · scale + zero per group), without its padding; None for any other
    tensor. tinygemm's packing is its kernel's private tiling: the weight is read back through the kernel itself
    (rows of the identity times the weight, `chunk` input columns at a time), and each code recovered from its
    value, scale and zero."""
    if (type(weight).__name__ != "Int4TilePackedTo4dTensor" or getattr(weight, "act_pre_scale", None) is not None
            or weight.qdata.dim() != 4 or not weight.qdata.is_cuda):
        return None
    outs, ins = weight.shape
    group = weight.block_size[-1]
    scale_and_zero = weight.scale_and_zero  # groups (padded) × outs (padded) × (scale, zero)
    padded = scale_and_zero.shape[0] * group
    scale = scale_and_zero[: ins // group, :outs, 0].t().contiguous()
    zero = scale_and_zero[: ins // group, :outs, 1].t().contiguous()
    q = torch.empty((outs, ins), dtype=torch.uint8, device=weight.qdata.device)
    chunk = max(group, chunk // group * group)
    for begin in range(0, ins, chunk):
        end = min(begin + chunk, ins)
        eye = torch.zeros((end - begin, padded), dtype=torch.bfloat16, device=q.device)
        eye[:, begin:end].fill_diagonal_(1)
        values = torch.ops.aten._weight_int4pack_mm(eye, weight.qdata, group, scale_and_zero)[:, :outs].t().float()
        groups = slice(begin // group, -(-end // group))
        grouped = values.reshape(outs, -1, group)
        codes = (grouped - zero[:, groups].float()[..., None]) / scale[:, groups].float()[..., None] + 8
        q[:, begin:end] = codes.round_().clamp_(0, 15).reshape(outs, end - begin).to(torch.uint8)
    return q, scale, zero


def bitsandbytes_four_bit_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[float],
                                                                torch.dtype] | None:
    """(codes: out × in uint8 0..15, absmax: out × blocks float32, the 16 values of its table, its dtype) of
    bitsandbytes' 4-bit weight (`Params4bit`, nf4 or fp4: w = code[q] · absmax per block), on a GPU, whose blocks
    do not straddle rows; None for any other tensor. bitsandbytes packs the flattened weight two a byte, the first
    of each pair in the high half; doubly quantized absmax (`nested`) is dequantized by bitsandbytes itself."""
    state = getattr(weight, "quant_state", None)
    if type(weight).__name__ != "Params4bit" or state is None or not weight.data.is_cuda:
        return None
    outs, ins = state.shape
    if ins % state.blocksize or state.code.numel() != 16:
        return None
    absmax = state.absmax
    if state.nested:
        from bitsandbytes.functional import dequantize_blockwise

        absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
    packed = weight.data.contiguous().view(torch.uint8).reshape(-1)[: outs * ins // 2]
    q = torch.stack([packed >> 4, packed & 15], dim=1).reshape(outs, ins)
    return q, absmax.float().reshape(outs, ins // state.blocksize), state.code.float().tolist(), state.dtype


def torchao_fp8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(float8 e4m3 data: out × in, float32 scales: out × 1) of torchao's float8 weight with a scale per output row
    whose activations are quantized per token as they come (`Float8Tensor` as Float8DynamicActivationFloat8WeightConfig
    with PerRow makes it); None for any other tensor (no torchao import for those)."""
    if type(weight).__name__ != "Float8Tensor" or weight.qdata.dim() != 2 or weight.act_quant_kwargs is None:
        return None
    if weight.qdata.dtype != torch.float8_e4m3fn or list(weight.block_size) != [1, weight.qdata.shape[1]]:
        return None
    return weight.qdata, weight.scale


def torchao_fp8_weight(qdata: torch.Tensor, scale: torch.Tensor, like: Any) -> Any:
    """torchao's float8 weight of these tensors, with `like`'s settings (activation quantization, kernel choice)."""
    return type(like)(qdata, scale, [1, qdata.shape[1]], like.mm_config, like.act_quant_kwargs,
                      like.kernel_preference, like.dtype)


def torchao_fp8_tokens(x: torch.Tensor, like: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data: rows × in, float32 scales: rows × 1) of `x`'s rows quantized as torchao's float8 Linear `like`
    quantizes its input (a scale per token: max |x| / the float8 maximum, within its activation bounds; its torch
    formula, operation for operation, so the numbers are its own)."""
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    kwargs = like.act_quant_kwargs
    block = [1, x.shape[-1]]
    scale = _choose_scale_float8(x, float8_dtype=kwargs.float8_dtype, block_size=block,
                                 hp_value_lb=kwargs.hp_value_lb, hp_value_ub=kwargs.hp_value_ub)
    return _quantize_affine_float8(x, scale, kwargs.float8_dtype), scale


def torchao_fp8_fast_accumulation(like: Any) -> bool:
    """Whether torchao's float8 Linear `like` asks `torch._scaled_mm` for fast accumulation."""
    config = like.mm_config
    return bool(config.use_fast_accum) if config is not None else False

