"""Every use of another library's private or version-dependent API, in one place, each with the releases it was
checked on. Nothing else in devmap touches these; `tests/test_compat.py` checks each one against the installed
releases (CI runs it at both ends of `devmap.releases.SUPPORTED`).

| touchpoint | library | why devmap needs it | checked on |
|---|---|---|---|
| `call_decoder_layer`: the cache keyword of a decoder layer (`past_key_values`, renamed `cache`) | transformers | stages run the layers one run at a time with devmap's KV caches | 5.17, 5.24 |
| `transformers_causal_mask`: `masking_utils.create_causal_mask` | transformers | prompt masks for attention kinds other than sdpa/eager (devmap builds those itself: `devmap.generation.masks`) | 5.17, 5.24 |
| `hide_scipy_and_sklearn`: `utils.is_scipy_available`, `utils.is_sklearn_available` (replaced in `transformers.utils` and `transformers.utils.import_utils`) | transformers | its modeling code imports scipy (object-detection losses) and scikit-learn (assisted generation) wherever they are installed: over a second of an engine core's imports where both are installed (docs/serving.md); the engine core uses neither | 5.17, 5.24 |
| `weights_left_uninitialized`: `initialization.no_init_weights` | transformers | a model whose tensors devmap reads or initializes is built without the constructors' init (0.3 s of a 1.1B model's 0.4 s build on the meta device) | 5.17, 5.24 |
| `attention_implementation`: `config._attn_implementation` | transformers | the decode mask's form (booleans for sdpa, floats for eager) | 5.17, 5.24 |
| `with_decode_attention`, `decode_attention_held`, `pin_decode_attention`, `sdpa_attention`, `attention_function`: `AttentionInterface.register`, `sdpa_attention_forward`, `ALL_ATTENTION_FUNCTIONS`, `config._attn_implementation` set for a step | transformers | decode steps attend over live cache columns only (`kernels.decode_attention`); transformers' sdpa reads every column, and with grouped KV heads and a mask copies the cache to every query head (17% of a 1.1B step) | 5.17, 5.24 |
| `own_forward`, `hook_execution_device`, `device_hooks_bypassed`, `device_hook_moved`: `_hf_hook`, `_old_forward`, `AlignDevicesHook` | accelerate | a placed model's device hooks re-check every argument (2x a decode step) and break compiled steps; a module swapped for devmap's (4-bit Linear layers) keeps its hook | 1.15 |
| `raise_recompile_limit`: `torch._dynamo.config.recompile_limit` | torch | one compiled entry per stage, lane shape and kind | 2.11, 2.14 |
| `fail_on_recompile`: `torch.compiler.set_stance` | torch | a CUDA-graph capture must never compile | 2.11, 2.14 |
| `compile_backend`: `torch._dynamo.lookup_backend` | torch | a region's backend is inductor (aot_eager in tests) wrapped to pause CUDA-graph captures while it compiles, so that a compile beside serving lets the serving thread capture while dynamo traces | 2.11, 2.14 |
| `ahead_of_time`, `ahead_of_time_keeps`, `entry_bytes`, `entry_from_bytes`, `entry_accepts`: `torch.compile(...).aot_compile`, `AOTCompiledFunction` (`serialize`, `deserialize`, `guard_check`, `disable_guard_check`) | torch | a compiled region saved with its guards and loaded by the next process without dynamo tracing it again (`generation.region_store`; 2.11 needs `config.enable_aot_compile` for it, and saves inductor's entries only) | 2.11, 2.14 |
| `compile_totals`: `torch._dynamo.utils.compilation_time_metrics`, `counters` | torch | a load's compile phase in seconds, graphs and compile-cache hits (`serving.warm_up`), so that a slow start shows its cause | 2.11, 2.14 |
| `dynamic_dims`: `torch._dynamo.maybe_mark_dynamic` (its `_dynamo_weak_dynamic_indices` mark) | torch | a continuous batch's decode step compiled once for its rows and cache length only (every size symbolic took minutes to compile) | 2.11, 2.14 |
| `distinct_sizes`: `torch.fx.experimental._config.use_duck_shape` (set directly) | torch | a dynamic decode step must not tie its rows to an equal-sized dimension of the weights (4 rows per lane, 4 KV heads), which specializes them and recompiles per batch shape | 2.11, 2.14 |
| `graph_pool`, `begin_capture`: `graph_pool_handle`, `CUDAGraph.capture_begin(capture_error_mode=)` | torch | steps of one stream share a pool; captures don't sync the device | 2.11, 2.14 |
| `own_blas_workspace`: `torch._C._cuda_clearCublasWorkspaces` | torch | cuBLAS keeps one workspace per (handle, stream) and a captured graph keeps the one of the stream it was captured on: pooled streams come back in other roles, so an eager product there (or a graph destroyed there) would share or free a replaying graph's scratch memory (what torch's own CUDA-graph trees clear around each capture too) | 2.11, 2.14 |
| `gpu_sleep`: `torch.cuda._sleep` | torch | DEVMAP_STREAM_CHECK's delays on hand-off streams | 2.11, 2.14 |
| `foreach_add_`, `foreach_zero_`, `foreach_copies`: `torch._foreach_*` | torch | gradient sums in one fused launch per group | 2.11, 2.14 |
| `pipeline_stage_fixed`: `PipelineStage._shape_inference`, `_get_init_p2p_neighbors_ops` | torch | torch 2.11's shape inference moves BatchNorm statistics, and its start-up handshake sends to its own rank when a V schedule puts neighbouring stages on one rank (gloo refuses: "Pair is not connected") | 2.11, 2.14 |
| `torchao_int8_rows`, `torchao_int8_parts`, `torchao_int8_weight`, `torchao_flat_state_dict`: `Int8Tensor` fields, `flatten_tensor_state_dict` | torchao | int8 per weight shape (2.5x less host time than `quantize_` per Linear); int8 weights joined and read by devmap's decode products (`kernels.int8_products`); pre-quantized saves | 0.18 |
| `torchao_fp8_parts`, `torchao_fp8_weight`, `torchao_fp8_tokens`, `torchao_fp8_fast_accumulation`: `Float8Tensor` fields and constructor, `act_quant_kwargs`, `mm_config`, `quant_primitives._choose_scale_float8` / `_quantize_affine_float8` | torchao | fp8 weights joined (query/key/value, gate/up); decode rows quantized per token as torchao does, then devmap's product or `torch._scaled_mm` as torchao calls it (`kernels.fp8_products`) | 0.18 |
| `torchao_int4_codes`: `Int4TilePackedTo4dTensor.scale_and_zero`, `block_size`, `aten._weight_int4pack_mm` | torchao | int4 weights taken into devmap's plain layout, read by its kernels (`kernels.four_bit_products`) | 0.18 |
| `bitsandbytes_four_bit_codes`: `Params4bit.quant_state` (`absmax`, `code`, `blocksize`, `shape`, `dtype`, `nested`), the packing of two codes a byte, `functional.dequantize_blockwise` | bitsandbytes | nf4 weights taken into devmap's plain layout, read by its kernels (`kernels.four_bit_products`) | 0.50 |
| `gluon`: `triton.experimental.gluon` (layouts, TMA, mbarriers, warpgroup MMA; `tma_load`, `cta_barrier` by release), `GluonASTSource` + `triton.compile` for an sm_90 build without a GPU | triton | Hopper's 4-bit kernel (`kernels.four_bit_products_wgmma`): asynchronous tensor-core products that `tl.dot` does not give | 3.6, 3.8 |
| `stored_tensors`: `tensor_data_names`, `quant_state.absmax`, `SCB` | torchao, bitsandbytes | what a quantized weight stores, for plans and saves | torchao 0.18, bitsandbytes 0.50 |
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from ..releases import require_supported

require_supported()  # what follows was checked on the releases of devmap.releases.SUPPORTED only

# --- transformers -------------------------------------------------------------------------------------------------


def cache_keyword(layer: nn.Module) -> str:
    """The keyword a decoder layer takes its KV cache by: `cache` from transformers 5.2x on (which warns per call
    on the old name), `past_key_values` before. Read once per model, outside any compiled step."""
    parameters = inspect.signature(type(layer).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def call_decoder_layer(layer: nn.Module, hidden: torch.Tensor, cache: Any, context: dict[str, Any],
                       keyword: str) -> torch.Tensor:
    """One decoder layer over `hidden` with `cache` (None: no cache, else passed by `keyword`, from `cache_keyword`)
    and the step's mask, positions and rotary embeddings in `context`; its hidden state out."""
    out = own_forward(layer)(hidden, **{keyword: cache}, use_cache=cache is not None, **context)
    return out[0] if isinstance(out, tuple) else out


def transformers_causal_mask(config: Any, like: torch.Tensor, attention_mask: torch.Tensor | None,
                             position_ids: torch.Tensor | None) -> Any:
    """transformers' causal mask for a whole prompt with no cache before it, in the form `config`'s attention takes
    (arguments by position: the fourth, the cache, was renamed from `past_key_values` to `cache` in 5.2x)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config, like, attention_mask, None, position_ids=position_ids)


_BUILDING = threading.Lock()  # builds without weight init, one at a time (`weights_left_uninitialized`)


def hide_scipy_and_sklearn() -> bool:
    """Tell transformers that scipy and scikit-learn are not installed, in a process that imports its modeling code
    and uses neither (the engine core): transformers imports `scipy.optimize` for its object-detection losses and
    `sklearn.metrics` for assisted generation's confidence threshold wherever they are installed, as its modeling
    code loads. Only before that code is imported (after, it changes nothing and returns False)."""
    import sys

    if "transformers.modeling_utils" in sys.modules:
        return False
    import transformers.utils
    import transformers.utils.import_utils

    def absent() -> bool:
        return False

    for name in ("is_scipy_available", "is_sklearn_available"):
        setattr(transformers.utils, name, absent)
        setattr(transformers.utils.import_utils, name, absent)
    return True


@contextlib.contextmanager
def weights_left_uninitialized() -> Iterator[None]:
    """Models built inside skip their constructors' weight init (transformers' `initialization.no_init_weights`, as
    its `from_pretrained` builds): a model whose every tensor devmap then reads or initializes itself. On the meta
    device each init call is a Python decomposition: 0.3 s of a 1.1B model's 0.4 s build. The context swaps torch's
    init functions module-wide, so devmap's builds take turns (one swapping back while another swaps would leave the
    swapped ones in place)."""
    from transformers.initialization import no_init_weights

    with _BUILDING, no_init_weights():
        yield


def attention_implementation(config: Any) -> str:
    """The attention implementation the model was loaded with ('sdpa', 'eager', 'flash_attention_2', ...): 'sdpa'
    also while a decode step of another thread has it set to devmap's (`with_decode_attention`; a service compiles a
    model's steps in one thread while another serves it)."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return "sdpa" if implementation == DECODE_ATTENTION else implementation


DECODE_ATTENTION = "devmap_decode_sdpa"


def with_decode_attention(config: Any, step: Any, attention: Any) -> Any:
    """`step` (a decode step of a model whose attention is sdpa) run with `attention` in place of transformers' sdpa
    (registered through `AttentionInterface`, chosen by `config._attn_implementation` while the step runs; it takes
    sdpa's arguments and may hand any call on to `sdpa_attention`). Steps of other attentions are returned as is."""
    if attention_implementation(config) != "sdpa":
        return step

    def with_attention(*args: Any, **kwargs: Any) -> Any:
        with decode_attention_held(config, attention):
            return step(*args, **kwargs)

    return with_attention


@contextlib.contextmanager
def decode_attention_held(config: Any, attention: Any) -> Iterator[None]:
    """`config` (of a model whose attention is sdpa) chooses `attention` while any thread holds it: the choice is the
    model's, so calls that overlap (a service's steps and its model's compile in another thread) share one hold, and
    sdpa comes back when the last of them ends. A step traced while another thread's hold ended half-way was compiled
    for sdpa, and the serving thread's capture of it then needed a recompile and ran uncaptured. A thread that runs a
    prompt meanwhile gets the same computation (`attention` hands a prompt's call to sdpa)."""
    if attention_implementation(config) != "sdpa":
        yield
        return
    _hold(config, attention)
    try:
        yield
    finally:
        _let_go(id(config), config)


def pin_decode_attention(config: Any, attention: Any) -> None:
    """Hold `decode_attention_held` for as long as `config` lives: a served model's steps, prompts and compiles (in
    whichever thread) all see one attention choice, so none is traced for one and replayed under the other."""
    if attention_implementation(config) == "sdpa":
        _hold(config, attention)
        weakref.finalize(config, _let_go, id(config), None)


def _hold(config: Any, attention: Any) -> None:
    from transformers import AttentionInterface

    with _ATTENTION_HOLDS_LOCK:
        key = id(config)
        if key not in _ATTENTION_HOLDS:
            AttentionInterface.register(DECODE_ATTENTION, attention)
            config._attn_implementation = DECODE_ATTENTION
            _ATTENTION_HOLDS[key] = 0
        _ATTENTION_HOLDS[key] += 1


def _let_go(key: int, config: Any) -> None:
    """One hold of the config `key` ends (`config`: None once it was freed, at the end of a pin)."""
    with _ATTENTION_HOLDS_LOCK:
        _ATTENTION_HOLDS[key] -= 1
        if _ATTENTION_HOLDS[key] == 0:
            del _ATTENTION_HOLDS[key]
            if config is not None:
                config._attn_implementation = "sdpa"


_ATTENTION_HOLDS: dict[int, int] = {}  # id(config): holds now (`decode_attention_held`, `pin_decode_attention`)
_ATTENTION_HOLDS_LOCK = threading.Lock()


def attention_function(config: Any) -> Any:
    """The attention function a layer of `config` calls now (`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`:
    inside a `with_decode_attention` step, the step's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[getattr(config, "_attn_implementation", None) or "eager"]


def sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' own sdpa attention (its output in rows × tokens × heads × dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# --- accelerate ---------------------------------------------------------------------------------------------------


def own_forward(module: nn.Module) -> Any:
    """The module's own forward, past accelerate's AlignDevicesHook (its per-call device checks doubled a decode
    step's cost): callers pass arguments already on the right device."""
    hooked = getattr(module, "_hf_hook", None) is not None and hasattr(module, "_old_forward")
    return module._old_forward if hooked else module


def hook_execution_device(module: nn.Module) -> torch.device | None:
    """Where accelerate's hook runs the module (its execution device when weights are offloaded), or None."""
    execution = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return None if execution is None else torch.device(f"cuda:{execution}" if isinstance(execution, int) else execution)


def _only_moves_arguments(hook: Any) -> bool:
    """Every hook (of a SequentialHook too) is an AlignDevicesHook without offload: skipping it moves nothing."""
    from accelerate.hooks import AlignDevicesHook

    hooks = getattr(hook, "hooks", None) or [hook]
    return all(isinstance(h, AlignDevicesHook) and not h.offload for h in hooks)


def device_hook_moved(old: nn.Module, new: nn.Module) -> bool:
    """Give `new` (taking `old`'s place) the accelerate hook `old` has: True where there is none or it only moves
    arguments (`new` then runs where `old` ran); False, nothing done, for a hook that brings offloaded weights in."""
    hook = getattr(old, "_hf_hook", None)
    if hook is None:
        return True
    if not _only_moves_arguments(hook):
        return False
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(new, hook)
    return True


@contextlib.contextmanager
def device_hooks_bypassed(model: nn.Module) -> Iterator[None]:
    """accelerate's device hooks taken off `model`'s submodules for one call, put back after (also on error). Each
    AlignDevicesHook moves the arguments again and is `torch.compiler.disable`d, which broke every compiled stage
    step into one graph per module. Hooks that bring offloaded weights in are left alone. Calls that overlap (a
    service's batch and its model's compile in another thread) share one bypass: the hooks come back when the last
    of them ends."""
    with _BYPASSING:
        state = model.__dict__.get("_devmap_hooks_bypassed")
        if state is None:
            swapped = []
            for module in model.modules():
                hook = getattr(module, "_hf_hook", None)
                hooked = module.__dict__.get("forward")
                own = getattr(module, "_old_forward", None)
                if module is model or hook is None or hooked is None or own is None or hooked is own \
                        or not _only_moves_arguments(hook):
                    continue
                swapped.append((module, hooked))
                module.forward = own
            state = model.__dict__["_devmap_hooks_bypassed"] = [0, swapped]
        state[0] += 1
    try:
        yield
    finally:
        with _BYPASSING:
            state[0] -= 1
            if state[0] == 0:
                del model.__dict__["_devmap_hooks_bypassed"]
                for module, hooked in state[1]:
                    module.forward = hooked


_BYPASSING = threading.Lock()


# --- torch --------------------------------------------------------------------------------------------------------


def graph_pool() -> Any:
    """A new memory pool for CUDA graphs to share."""
    return torch.cuda.graph_pool_handle()


def begin_capture(graph: torch.cuda.CUDAGraph, pool: Any) -> None:
    """Start capturing into `graph` on the current stream (into `pool`), with no device sync, garbage collection or
    emptied allocator first; "thread_local": another thread's CUDA calls (a load beside a capture) do no harm."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")


@contextlib.contextmanager
def own_blas_workspace() -> Iterator[None]:
    """A capture with a cuBLAS / cuBLASLt workspace of its own: every stream's cached workspace is dropped before
    (the capture's first product allocates one in the graph's pool, where only captures of that pool, which never
    replay at the same time, can reuse it) and after (the capture stream, handed out again by torch's stream pool,
    must not keep writing the graph's workspace eagerly, nor free it with a graph of its next role). Eager streams
    simply allocate a new workspace on their next product."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


def gpu_sleep(cycles: int) -> None:  # the current stream busy for about `cycles` GPU clock cycles, no data changed
    torch.cuda._sleep(cycles)


def foreach_add_(targets: list[torch.Tensor], addends: list[torch.Tensor]) -> None:
    """targets[i] += addends[i], in one fused launch per group of tensors."""
    torch._foreach_add_(targets, addends)


def foreach_zero_(tensors: list[torch.Tensor]) -> None:  # one fused launch per group
    torch._foreach_zero_(tensors)


def foreach_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """New copies of `tensors`, made in one fused launch per group (not one clone each)."""
    return list(torch._foreach_mul(tensors, 1.0))


def pipeline_stage_fixed(stage: Any) -> Any:
    """A `torch.distributed.pipelining.PipelineStage` with two faults of torch 2.11 worked around (a no-op without
    them): `_shape_inference` runs the stage once on zeros in training mode on the real buffers (every BatchNorm
    counted one batch too many: its buffers are put back after); `_get_init_p2p_neighbors_ops` also sends to this
    very rank when a neighbouring stage lives here (V schedules), which gloo fails: those ops are dropped, as a
    stage hands tensors to a neighbour on its own rank directly."""
    infer = getattr(stage, "_shape_inference", None)
    if infer is not None:
        def inferred_without_side_effects(*args: Any, **kwargs: Any) -> Any:
            saved = [(b, b.detach().clone()) for b in stage.submod.buffers()]
            try:
                return infer(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, value in saved:
                        buffer.copy_(value)

        stage._shape_inference = inferred_without_side_effects
    handshake = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if handshake is not None:
        def handshake_with_other_ranks() -> list[Any]:
            own = getattr(stage, "group_rank", None)
            return [op for op in handshake() if getattr(op, "group_peer", None) != own]

        stage._get_init_p2p_neighbors_ops = handshake_with_other_ranks
    return stage


# --- torch.compile: `compiling` ---------------------------------------------------------------------------------

from .compiling import (  # noqa: E402, F401  (re-exported; imported after require_supported)
    CompileTotals, ahead_of_time, ahead_of_time_keeps, ahead_of_time_possible, compile_backend, compile_totals,
    distinct_sizes, dynamic_dims, entry_accepts, entry_bytes, entry_from_bytes, fail_on_recompile,
    raise_recompile_limit)

# --- torchao and bitsandbytes: `quantized_weights` -----------------------------------------------------------

from .quantized_weights import (  # noqa: E402, F401  (re-exported; imported after require_supported)
    bitsandbytes_four_bit_codes, stored_tensors, torchao_flat_state_dict, torchao_fp8_fast_accumulation,
    torchao_fp8_parts, torchao_fp8_tokens, torchao_fp8_weight, torchao_int4_codes, torchao_int8_parts,
    torchao_int8_rows, torchao_int8_weight)
