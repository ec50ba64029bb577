"""A placed Hugging Face causal LM (LLaMA-style) as stages: embeddings, runs of decoder layers per device, norm + head.

Each stage runs transformers' own modules; only the glue of `LlamaModel.forward` (positions from the
attention mask, the causal mask, rotary embeddings) is redone here so that the layers can run one stage
at a time, with a KV cache per lane.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..compat import (attention_implementation, cache_keyword, device_hooks_bypassed,
                      hook_execution_device, own_forward, transformers_causal_mask)
from ..errors import PipelineError, UsageError
from ..planning.devices import offloaded, parse_device_key
from .compiled import Regions
from .joined_projections import JoinedLayer
from .lane_cache import LaneCache
from .rotary import Rotary
from .masks import prompt_mask

# model types whose base model's forward is LLaMA's glue (embed, one rotary, causal mask, layers, norm): the glue
# redone here is theirs. Others (Gemma scales its embeddings, for one) would come out silently wrong: refused.
SAME_GLUE = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LMStage:
    """Consecutive decoder layers on one device (stage 0 also embeds; the last also normalizes and projects)."""

    device: torch.device
    layers: list[nn.Module]


def _device_of(module: nn.Module) -> torch.device:
    execution = hook_execution_device(module)
    if execution is not None:  # accelerate offloads: the hook's device is where it runs
        return execution
    param = next(module.parameters(), None)
    if param is None or param.device.type == "meta":
        raise PipelineError("the model has offloaded or unloaded weights; load it onto devices first")
    return param.device


class CausalLMStages:
    """The stages of a LLaMA-style model, split where consecutive decoder layers change device (and before
    each index in `split_layers`, which is how tests run two stages on one CPU)."""

    def __init__(self, model: nn.Module, split_layers: Sequence[int] | None = None) -> None:
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
            raise PipelineError(
                f"{type(model).__name__} is not a LLaMA-style causal LM (model.layers, model.norm, lm_head)"
            )
        self.model, self.base, self.config = model, base, model.config
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SAME_GLUE:
            raise PipelineError(
                f"pipelined inference runs {', '.join(SAME_GLUE)} models; this one is {model_type!r}, whose layers "
                "need glue devmap does not redo: run it with model(...) or model.generate(...)"
            )
        if offloaded(parse_device_key(d) for d in getattr(model, "hf_device_map", {}).values()):
            raise PipelineError("the model has offloaded blocks (cpu or disk beside GPUs): pipelined inference "
                                "needs every block on a device; load it with enough GPU memory")
        starts = set(split_layers or ())
        if any(not 0 < i < len(base.layers) for i in starts):
            raise PipelineError(f"split_layers must be layer indices between 1 and {len(base.layers) - 1}")
        self.stages: list[LMStage] = []
        for index, layer in enumerate(base.layers):
            device = _device_of(layer)
            if self.stages and self.stages[-1].device == device and index not in starts:
                self.stages[-1].layers.append(layer)
            else:
                self.stages.append(LMStage(device, [layer]))
        self.embed_device = _device_of(base.embed_tokens)
        self.dtype = base.embed_tokens.weight.dtype
        self.head_device = _device_of(model.lm_head)
        # tied embeddings put lm_head with embed_tokens (the first GPU), the final norm stays after the last layer
        self.norm_device = _device_of(base.norm)
        self.cache_keyword = cache_keyword(base.layers[0])
        # layers whose projections were joined (`join_projections`) run with two products for five; sdpa models
        # only (eager ones keep transformers' layers and their float-mask attention)
        sdpa = attention_implementation(model.config) == "sdpa"
        self.joined = {id(layer): joined for layer in base.layers
                       if sdpa and (joined := JoinedLayer.of(layer, model_type)) is not None}
        self._rotary: dict[torch.device, Rotary] = {}
        for device in {*self.devices, self.embed_device}:  # copied here, not inside a compiled step
            self._rotary[device] = Rotary(module_on(self.base.rotary_emb, device))
        self._indices = {id(layer): getattr(getattr(layer, "self_attn", None), "layer_idx", None)
                         for layer in base.layers}
        self.regions = Regions()  # eager until `compile_regions`

    def compile_regions(self, dynamic: bool) -> None:
        """Run the decoder layers, decode steps' contexts and the head through torch.compile from now on, region by
        region (`devmap.generation.compiled`); `dynamic`: one compile for every batch size and cache length."""
        if not self.regions.compiled or self.regions.dynamic != dynamic:
            self.regions = Regions(dynamic)

    @contextlib.contextmanager
    def hooks_bypassed(self) -> Iterator[None]:
        """accelerate's device hooks taken off the model's modules for one call (the stages move the arguments
        themselves), put back after, also on error."""
        with device_hooks_bypassed(self.model):
            yield

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.stages]

    def captures(self, stage: int, head: bool = True) -> bool:
        """Whether the stage's steps can be captured as CUDA graphs: all their work on its own device (work on another
        device would run once during the capture and never on replay; a copy across devices cannot be captured).
        `head`: whether the last stage's steps end in the head (decode steps do, prefills do not)."""
        return not self.other_devices(stage, head)

    def other_devices(self, stage: int, head: bool = True) -> list[torch.device]:
        """The devices besides its own that stage `stage`'s work runs on: the embedding's for the first stage, the
        final norm's and the head's for the last (tied embeddings put lm_head on the first GPU); `head` False leaves
        the head's work out."""
        touched = [self.embed_device] if stage == 0 else []
        if head and stage == len(self.stages) - 1:
            touched += [self.norm_device, self.head_device]
        own = self.stages[stage].device
        return list(dict.fromkeys(d for d in touched if d != own))

    def check_window(self, total: int) -> None:
        """Refuse sequences longer than a sliding attention window (devmap's masks are plain causal masks, which
        equal the sliding ones up to the window's length)."""
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None) or ()
        sliding = self.config.model_type == "mistral" or "sliding_attention" in types
        if sliding and isinstance(window, int) and total > window:
            raise UsageError(
                f"prompt + new tokens = {total:,} is more than the model's sliding attention window of {window:,} "
                "tokens, which devmap's pipelined inference does not apply; shorten the prompt or --max-new-tokens"
            )

    def kv_layout(self, stage: int) -> tuple[list[int], int, int] | None:
        """(layer indices, KV heads, head size) of a stage's attention, for its static caches (None if unknown)."""
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        indices = [getattr(getattr(layer, "self_attn", None), "layer_idx", None) for layer in self.stages[stage].layers]
        if any(not isinstance(i, int) for i in indices):
            return None
        return indices, kv_heads, head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return own_forward(self.base.embed_tokens)(input_ids.to(self.embed_device))

    def prompt_context(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                       like: torch.Tensor) -> dict[str, Any]:
        """The causal mask of a whole prompt (no cache before it) with its position ids; `attention_mask` is None
        when no row is padded, and `like` gives batch, length, dtype and device. sdpa and eager masks are devmap's
        own (no host reads); other attention implementations get transformers' mask code."""
        implementation = attention_implementation(self.config)
        rows, length = like.shape[0], like.shape[1]
        if implementation in ("sdpa", "eager"):
            float_dtype = like.dtype if implementation == "eager" else None
            mask = prompt_mask(attention_mask, rows, length, like.device, float_dtype)
        else:
            mask = transformers_causal_mask(self.config, like, attention_mask,
                                            position_ids if attention_mask is not None else None)
        return {"attention_mask": mask, "position_ids": position_ids}

    def run(self, stage: int, hidden: torch.Tensor, context: dict[str, Any], cache: Any) -> torch.Tensor:
        """Stage `stage`'s decoder layers; `context` tensors must already be on the stage's device (its rotary
        cos/sin under `position_embeddings`). Layers with joined projections run devmap's forward over them."""
        for layer in self.stages[stage].layers:
            hidden = self.regions.layer(layer, self.joined.get(id(layer)), hidden, self._layer_cache(cache, layer),
                                        context, self.cache_keyword)
        return hidden

    def _layer_cache(self, cache: Any, layer: nn.Module) -> Any:
        """A layer's part of a lane's cache (`LaneCache.layer`); any other cache as it is."""
        index = self._indices.get(id(layer))
        return cache.layer(index) if isinstance(cache, LaneCache) and index is not None else cache

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos/sin computed on hidden's device, from a copy of the rotary module's buffers there (no
        cross-device read inside a captured decode step)."""
        return self.rotary_on(hidden.device)(hidden, position_ids)

    def rotary_on(self, device: torch.device) -> Rotary:
        """The rotary embedding on `device` (made at the first use there)."""
        rotary = self._rotary.get(device)
        if rotary is None:
            rotary = self._rotary[device] = Rotary(module_on(self.base.rotary_emb, device))
        return rotary

    def float_mask_dtype(self) -> torch.dtype | None:
        """The decode mask's form for this model's attention: booleans for sdpa, additive floats for eager."""
        implementation = attention_implementation(self.config)
        if implementation == "sdpa":
            return None
        if implementation == "eager":
            return next(self.stages[0].layers[0].parameters()).dtype
        raise PipelineError(f"generation supports attn_implementation 'sdpa' or 'eager', not {implementation!r}; "
                            "load the model with one of those")

    def decode(self, stage: int, hidden: torch.Tensor, inputs: Any) -> torch.Tensor:
        """One decode step of one lane on stage `stage`, reading and writing only fixed buffers: token ids in
        (stage 0) or the hidden state; the hidden state out, or the last stage's float logits (rows × vocab).
        `inputs` is the lane's `DecodeInputs` on this stage; the step advances its cache slot."""
        device = self.stages[stage].device
        if stage == 0:
            hidden = self.embed(hidden)
        hidden = hidden.to(device)
        context = self.regions.context(self.rotary_on(device), hidden, inputs)
        hidden = self.run(stage, hidden, context, inputs.cache)
        inputs.cache.advance()
        if stage + 1 < len(self.stages):
            return hidden
        return self.logits(hidden)

    def mixes(self) -> bool:
        """Whether every decoder layer is joined (`JoinedLayer`): a decode step can then carry a pack of prompts."""
        return len(self.joined) == len(self.base.layers)

    def mixed(self, stage: int, flat: torch.Tensor, rows: int, inputs: Any, pack_cache: Any,
              pack: dict[str, Any]) -> Any:
        """One decode step of a lane's first `rows` rows on stage `stage` carrying a pack of prompts (every layer
        joined: `mixes`): `flat` is tokens × hidden size (stage 0: token ids), the rows' one token each, then the
        pack's; `inputs` the rows' `DecodeInputs` (the step advances its slot), `pack_cache` where the pack's keys
        and values go, `pack` its mask and position ids. Returns the hidden state, or on the last stage (the rows'
        float logits, the pack's hidden state)."""
        device = self.stages[stage].device
        if stage == 0:
            flat = self.embed(flat)
        flat = flat.to(device)
        step = self.regions.context(self.rotary_on(device), flat[:rows, None], inputs)
        packed = {"attention_mask": pack["attention_mask"], "position_ids": pack["position_ids"],
                  "position_embeddings": self.rotary(flat[None, rows:], pack["position_ids"])}
        for layer in self.stages[stage].layers:
            caches = (self._layer_cache(inputs.cache, layer), self._layer_cache(pack_cache, layer))
            flat = self.regions.mixed(self.joined[id(layer)], flat, caches, (step, packed))
        inputs.cache.advance()
        if stage + 1 < len(self.stages):
            return flat
        return self.logits(flat[:rows, None]), flat[rows:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float logits of each row's last token (the head region: final norm and lm_head)."""
        return self.regions.logits(self.base.norm, self.model.lm_head, hidden, self.norm_device, self.head_device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head (logits in the model's dtype, as transformers returns them)."""
        return own_forward(self.model.lm_head)(self.final_norm(hidden))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm on its own device, its output on the head's."""
        return own_forward(self.base.norm)(hidden.to(self.norm_device)).to(self.head_device)

    def head_into(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """`head(hidden)` written straight into `out` (a slice of the batch's logits: no concatenation after)."""
        if not self.head_splittable() or not out.is_contiguous():
            out.copy_(self.head(hidden))
            return
        project_into(self.final_norm(hidden), self.model.lm_head.weight, out)

    def head_splittable(self) -> bool:
        """A plain bias-free Linear head: its projection can be written into a slice, or done elsewhere by rows."""
        head = self.model.lm_head
        return type(head) is nn.Linear and head.bias is None


class FrontHead:
    """The final norm and LM head on another device (the first stage's, which has no head of its own), on copies of
    their weights made when created (issued on the current stream; made per call, so they are never stale)."""

    def __init__(self, stages: CausalLMStages, device: torch.device) -> None:
        self.weight = stages.model.lm_head.weight.detach().to(device, non_blocking=True)
        self.norm = module_on(stages.base.norm, device)

    def into(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        project_into(type(self.norm).forward(self.norm, hidden), self.weight, out)


def module_on(module: nn.Module, device: torch.device) -> nn.Module:
    """A shallow copy of a parameter-light module (rotary embedding, norm) whose weights live on `device`; call it
    as `type(m).forward(m, ...)`, which also passes by any accelerate hook of the original."""
    clone = copy.copy(module)
    clone._parameters = {k: None if v is None else nn.Parameter(v.detach().to(device), requires_grad=False)
                         for k, v in module._parameters.items()}
    clone._buffers = {k: None if v is None else v.to(device) for k, v in module._buffers.items()}
    clone.__dict__.pop("forward", None)
    return clone


def project_into(normed: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = normed @ weight.T, written in place into a contiguous `out` (rows × ... × vocab)."""
    torch.mm(normed.reshape(-1, normed.shape[-1]), weight.t(), out=out.view(-1, out.shape[-1]))


def positions(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of the last `length` tokens, counting only attended tokens (left padding), as transformers does."""
    ids = attention_mask.long().cumsum(-1) - 1
    ids.masked_fill_(attention_mask == 0, 1)
    return ids[:, -length:]
