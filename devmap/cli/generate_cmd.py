"""`devmap generate`: load a LLaMA-style model onto its devices and generate with the stages working at once."""

from __future__ import annotations

import click

from .options import load_options
from .output import echo_json


@click.command()
@click.argument("source")
@load_options
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default=64, show_default=True, type=click.IntRange(min=1),
              help="Length of the random prompts (without --prompt).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--lanes", default=None, type=click.IntRange(min=1), help="Micro-batches in flight (default: stages).")
@click.option("--prompt", default=None, help="Text prompt (needs a tokenizer in the model directory).")
@click.option("--do-sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--no-graphs", is_flag=True, help="Run every decode step eagerly (no CUDA graphs).")
@click.option("--compile", "compile_steps", is_flag=True,
              help="Run each stage's steps as torch.compile code (the first call compiles: tens of seconds).")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1),
              help="Generate this many times; reports the first call and the fastest later one.")
@click.option("--tensor-parallel", default=1, show_default=True, type=click.IntRange(min=1),
              help="Split every attention and MLP block over N processes (started here, or by torchrun; on a "
                   "multiple of N GPUs each group of N is a pipeline stage); rank 0 reports.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate(source: str, device_map: str, max_memory: str | None, dtype: str | None, quantize: str | None,
             batch_size: int,
             prompt_len: int, max_new_tokens: int, lanes: int | None, prompt: str | None, do_sample: bool,
             temperature: float, top_k: int, top_p: float, seed: int, no_graphs: bool, compile_steps: bool, repeat: int,
             tensor_parallel: int, as_json: bool) -> None:
    """Generate with SOURCE (a local LLaMA-style directory or preset) and report new tokens per second."""
    import os

    import torch

    from devmap.generation import generate as run_generate
    from devmap.generation import timed
    from devmap.generation import check_length
    from devmap.loading.loader import load
    from devmap.planning.models import resolve_source

    model_source = resolve_source(source)
    if prompt is None:  # refuse an impossible length before loading anything
        check_length(model_source.config, prompt_len + max_new_tokens)
    if tensor_parallel > 1:
        _check_split(model_source, tensor_parallel, device_map, max_memory, quantize)
        if "RANK" not in os.environ:
            from .rank_launch import relaunch

            relaunch(tensor_parallel, "generate", "--tensor-parallel")
            return
        model = load(source, dtype=dtype, tensor_parallel=tensor_parallel)
    else:
        model = load(source, device_map, max_memory, dtype, quantization=quantize)
    source_info = model.devmap_plan.model_source
    tokenizer = None
    if prompt is not None:
        if source_info.path is None:
            raise click.UsageError("--prompt needs a model directory with a tokenizer; presets have none")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source_info.path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"{source_info.path} has no usable tokenizer ({str(exc).splitlines()[0]})") from None
        tokenizer.padding_side = "left"  # generation continues every row from its last token
        encoded = tokenizer([prompt] * batch_size, return_tensors="pt", padding=True)
        input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
    else:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, model_source.config.vocab_size, (batch_size, prompt_len), generator=generator)
        attention_mask = None
    calls = []
    for _ in range(repeat):  # later calls of the same shapes replay the first one's graphs (and compiled code)
        out, seconds = timed(run_generate, model, input_ids, attention_mask, max_new_tokens, lanes,
                             do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             graphs=not no_graphs, keep_graphs=repeat > 1, compile=compile_steps)
        calls.append(seconds)
    if tensor_parallel > 1:
        import torch.distributed as dist

        from devmap.generation.step_cache import release_graphs

        release_graphs(model)  # before the group goes: a captured collective can hang its destruction (pytorch#115388)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:  # every rank has the same tokens: rank 0 reports
            return
    seconds = min(calls[1:]) if repeat > 1 else calls[0]
    new = out.shape[1] - input_ids.shape[1]
    data = {
        "source": source, "device_map": {k: str(v) for k, v in model.hf_device_map.items()},
        "batch_size": batch_size, "prompt_len": input_ids.shape[1], "new_tokens": new,
        "lanes": lanes, "tensor_parallel": tensor_parallel, "cuda_graphs": not no_graphs, "compile": compile_steps,
        "first_call_seconds": calls[0],
        "seconds": seconds, "new_tokens_per_s": batch_size * new / seconds,
    }
    if tokenizer is not None:
        data["text"] = tokenizer.decode(out[0], skip_special_tokens=True)
    if as_json:
        echo_json(data)
        return
    which = f"fastest of {repeat - 1} calls after the first ({calls[0]:.2f} s)" if repeat > 1 else "one call"
    click.echo(f"{source}: batch {batch_size}, prompt {input_ids.shape[1]}, {new} new tokens in {seconds:.2f} s "
               f"= {data['new_tokens_per_s']:.0f} new tokens/s ({which})")
    if "text" in data:
        click.echo(shown(data["text"]))


def _check_split(model_source, size: int, device_map: str, max_memory: str | None,  # type: ignore[no-untyped-def]
                 quantize: str | None) -> None:
    """Refuse, before any process starts, a split the model does not allow or options that place whole blocks."""
    from devmap.planning.tensor_parallel import check_split

    check_split(model_source, size)
    placing = [flag for flag, value in (("--device-map", device_map != "auto"), ("--max-memory", max_memory),
                                        ("--quantize", quantize)) if value]
    if placing:
        raise click.UsageError("--tensor-parallel places each process's shard itself (its GPU of each group of "
                               f"N, the groups the pipeline's stages): leave out {', '.join(placing)}")


def shown(text: str) -> str:
    """The text as a terminal should show it: control characters other than newlines and tabs written as escapes
    (a random-weight model's tokens are often carriage returns, which would hide the line they end)."""
    import unicodedata

    return "".join(c if c in "\n\t" or unicodedata.category(c)[0] != "C" else repr(c)[1:-1] for c in text)
