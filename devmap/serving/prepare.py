"""A loaded model made ready to serve: its LLaMA layers' input projections joined (two products where transformers
runs five per decode step, `generation.joined_projections`), the variants of devmap's product kernels for its
quantized weights compiled, its decode steps compiled and warmed up now or while it serves (or left as captured eager
steps where compiling does not pay or fails), its tokenizer and end-of-sequence ids. The registry loads, this
prepares, each phase timed.

A serving process runs torch's scaled_dot_product_attention without its cuDNN backend (`attention_without_plans`),
which torch picks first on Hopper: cuDNN builds a plan at the first call of every shape, and a service meets new
shapes while it serves (each new prompt length of a prefill, each pack width of an eager step), each one stalling
every stream of its batch for that build (docs/serving.md has the figures, `benchmarks/probes/sdpa_first_call.py`
makes them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..planning.quantization import Quantization
from .errors import ServiceError
from .limits import EngineLimits
from .load_phases import LoadPhases

if TYPE_CHECKING:
    from .warm_marks import ServedShapes
    from .warm_up import WarmUpTimes

log = logging.getLogger("devmap.serving")


@dataclass(frozen=True)
class Ready:
    """What serving a prepared model needs beside it: its tokenizer, context (0: unbounded), end-of-sequence ids,
    whether its decode steps run compiled, and whether they are to be compiled while it serves (`compile_later`);
    the key its served shapes are kept under (`warm_marks`; None: none kept), and the shapes it served at when it
    last ran, whose steps its warm-up made (None: none): its batches start at that shape."""

    tokenizer: Any
    context: int
    eos_ids: tuple[int, ...]
    compiled: bool
    compile_later: bool = False
    warm_key: str | None = None
    served: ServedShapes | None = None


def prepare_for_serving(model: nn.Module, path: Path, model_id: str, limits: EngineLimits, rows: int,
                        phases: LoadPhases, compile_beside: bool | None = False, lanes: int | None = None) -> Ready:
    """Prepare the loaded `model` (from `path`) for batches of up to `rows` rows in `lanes` lanes under `limits`; the
    "prepare" phase and its compile's timed in `phases`. The caller frees the model if this raises.

    `compile_beside`: steps that compile by default are left to compile while the model serves (`Ready.compile_later`,
    `step_compile`; None: where they would compile anew, `compiles_beside`); asked for (`limits.compile`), they compile
    now, and a compile that fails fails the load."""
    from ..generation.joined_projections import join_projections
    from .warm_marks import warm_key
    from .warm_up import eager_first_steps

    attention_without_plans()

    with phases.timed("prepare"):
        joined = join_projections(model)  # the service owns the model and never saves it: see there
        log.debug("%s: %d projection groups joined for decode steps", model_id, joined)
        runs = prepare_product_kernels(model)
        if runs:
            log.debug("%s: product kernels prepared for %d shapes", model_id, runs)
        tokenizer = load_tokenizer(path)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    eos_ids = end_of_sequence_ids(model, tokenizer)
    key = warm_key(model, rows, context, limits.riding)
    if compiles_beside(model, limits, compile_beside, key):
        pin_attention(model)
        with phases.timed("warm_up"):
            eager_first_steps(model, rows, context, limits.riding)
        return Ready(tokenizer, context, eos_ids, compiled=False, compile_later=True, warm_key=key)
    times = _compiled(model, limits, model.devmap_plan.quantization, rows, context, lanes, phases)
    if times is None:
        return Ready(tokenizer, context, eos_ids, compiled=False)
    return Ready(tokenizer, context, eos_ids, compiled=True, warm_key=key, served=times.served)


def compiles_beside(model: nn.Module, limits: EngineLimits, wanted: bool | None, key: str | None) -> bool:
    """Whether the model's steps compile while it serves: steps that compile by default (`limits.compile` None) where
    `wanted` says so, or, with `wanted` None, where they would compile anew: no warm-up of the model (its marker
    `key`) ran whole with this compile cache (`warm_marks`). A first start then answers as soon as the weights are
    placed, on eager steps, instead of after a compile of tens of seconds; a later start loads its stored steps in a
    few seconds before it answers, and its first requests replay captured steps (docs/serving.md)."""
    from .warm_marks import warmed

    if wanted is False or limits.compile is not None or not _compiles(model, limits):
        return False
    return wanted or not warmed(key)


def _compiles(model: nn.Module, limits: EngineLimits) -> bool:
    from .warm_up import compiles

    return compiles(model, limits.compile, model.devmap_plan.quantization)


def prepare_product_kernels(model: nn.Module) -> int:
    """Compile the variants of the product kernels for the model's joined quantized weights (int8, 4-bit, fp8) now,
    at load, rather than in its first requests; how many (none without such weights or off GPUs)."""
    from ..kernels.quantized_products import prepare_kernels
    from ..generation.joined_projections import joined_products

    products, dtype = joined_products(model), model.get_input_embeddings().weight.dtype
    return prepare_kernels([p.quantized for p in products if p.quantized is not None], dtype)


def attention_without_plans() -> None:
    """scaled_dot_product_attention without its cuDNN backend in this process, every thread and model in it: the
    backends left (flash, memory-efficient, math) build nothing per shape."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


def pin_attention(model: nn.Module) -> None:
    """One attention choice for every step, prompt and compile of `model`, in whichever thread, while it lives (its
    steps compile beside its serving)."""
    from ..compat import pin_decode_attention
    from ..kernels.decode_attention import decode_step_attention

    pin_decode_attention(model.config, decode_step_attention)


def _compiled(model: nn.Module, limits: EngineLimits, quantization: Quantization | None, rows: int,
              context: int, lanes: int | None, phases: LoadPhases) -> WarmUpTimes | None:
    """The model's decode steps compiled now where they run compiled (`warm_up.compiles`): what its warm-up did (its
    compile, capture and warm-up phases timed in `phases` too), or None where they stay eager. A compile that fails
    (no C compiler for inductor, an operator it cannot trace) leaves the model on captured eager steps, with a warning
    in the log, unless it was asked for (`limits.compile`): then the load fails with the reason."""
    from ..generation.step_cache import release_graphs
    from .compile_cache import compiled_anew
    from .warm_up import compiles, warm_up

    wanted = limits.compile
    if not compiles(model, wanted, quantization):
        return None
    started = time.perf_counter()
    compile = lambda: warm_up(model, rows, context, limits.riding, lanes=lanes)  # noqa: E731
    try:
        # a split's processes warm up in step (their collectives pair up in order): one of them alone must not start
        # its warm-up again, so only a whole model's compile is made anew past an unreadable cache entry
        split = model.devmap_plan.tensor_parallel is not None
        times = compile() if split else compiled_anew(compile, lambda: release_graphs(model))
    except Exception as exc:
        phases.add("compile", time.perf_counter() - started)  # what the failed compile cost
        release_graphs(model)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if wanted:
            raise ServiceError(f"cannot compile the model's decode steps: {reason}; serve it without --compile")
        log.warning("decode steps stay eager (captured): compiling them failed: %s", reason)
        return None
    for phase, seconds in times.phases().items():
        phases.add(phase, seconds)
    phases.graphs = times.graphs
    return times


def end_of_sequence_ids(model: nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a request: the model's generation config's (or config's) EOS ids and the tokenizer's."""
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ServiceError(f"{path.name} has no usable tokenizer ({str(exc).splitlines()[0]}); a server answers "
                           "text, so the directory needs tokenizer files (devmap save writes them)") from None
    tokenizer.padding_side = "left"
    # transformers sets the truncation and padding of its shared Rust tokenizer whenever a call asks for others
    # than it has, which fails ("Already borrowed") while another thread encodes or decodes with it: set them here,
    # before the API's threads share it, to what all of its calls ask for (none)
    tokenizer("", add_special_tokens=False)
    return tokenizer
