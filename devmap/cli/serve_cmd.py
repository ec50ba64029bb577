"""`devmap serve`: keep models on their devices and answer an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import time
from pathlib import Path

import click

from .options import load_options


@click.command()
@click.argument("model_dirs", nargs=-1, type=click.Path(exists=True, file_okay=False))
@load_options
@click.option("--model-root", default=None, type=click.Path(exists=True, file_okay=False),
              help="Directory whose sub-directories clients may load with POST /v1/models/load.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --api-key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on, bound before any model loads (0: a free one, which the console names).")
@click.option("--api-key", default=None, envvar="DEVMAP_API_KEY",
              help="Bearer key every request must send (or DEVMAP_API_KEY).")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(min=1),
              help="Most requests in one lane of a continuous batch: a batch over S pipeline stages runs S lanes, "
                   "up to S times this many rows.")
@click.option("--join-tokens", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens that join the running batch at one step, at most (vLLM's max-num-batched-tokens; a "
                   "larger first request joins alone): a burst of requests joins over a few short steps instead of "
                   "one long one. Where the decode steps carry joiners' prompts, each lane's step carries up to 512.")
@click.option("--ride/--no-ride", "riding", default=None,
              help="Joiners' prompts ride the running batch's decode steps (vLLM's mixed batches: the weights are "
                   "read once for both) instead of prefilling between two steps; only LLaMA-family models in bf16, "
                   "fp16, int8, int4 or nf4 with sdpa attention can. Default: where that pays, models of 10B "
                   "parameters or more, whose steps are bound by reading the weights (a small model's steps are "
                   "bound by the host, which a riding step keeps busier), unless 4-bit (their products of a step's "
                   "rows and prompts run slower than bf16's).")
@click.option("--max-queue", default=256, show_default=True, type=click.IntRange(min=1),
              help="Most waiting requests; more get 429.")
@click.option("--max-prompt-tokens", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Largest max_tokens a request may ask for.")
@click.option("--request-timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds before a request is given up (504).")
@click.option("--idle-timeout", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Unload a model unused for this many seconds.")
@click.option("--unload-drain", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds an unloaded model's running requests may still take (DELETE /v1/models/{id} refuses new "
                   "ones at once); those left then end with a 503.")
@click.option("--lanes", default=None, type=click.IntRange(min=1),
              help="Lanes (micro-batches) of each batch, each of up to --max-batch rows (default: the model's "
                   "pipeline stages).")
@click.option("--compile/--no-compile", "compile_steps", default=None,
              help="torch.compile each model's decode and prefill steps (fused kernels, one compile for all shapes: "
                   "see docs/serving.md), before the model serves. Default: where every block is on a GPU and the "
                   "weights are floating point, int8, int4 or nf4 (LLaMA layers read by devmap's kernels); a compile "
                   "that fails leaves captured eager steps, with a warning. --compile: other quantized models' steps "
                   "too, and a compile that fails fails the load.")
@click.option("--compile-beside/--compile-first", "compile_beside", default=None,
              help="--compile-beside: serve each model as soon as its weights are placed, on eager steps, and compile "
                   "its steps while it serves (not with --compile, --no-compile or --tensor-parallel): answers "
                   "sooner, serves slower until the switch to compiled steps, as fast after it. --compile-first: "
                   "compile before the model serves. Default: beside where the model's steps were never compiled "
                   "in --compile-cache (its first start), first where they were (a restart loads them in seconds "
                   "and replays captured steps from its first request; docs/serving.md).")
@click.option("--compile-cache", default=None, envvar="DEVMAP_COMPILE_CACHE", type=click.Path(file_okay=False),
              help="Where compiled steps are kept for the next start (inductor's and Triton's on-disk caches, keyed "
                   "by their graphs, the card and the releases, in a sub-folder per torch, Triton and transformers "
                   "release; delete the folder to clear it; an entry torch cannot read is made anew, with a "
                   "warning). Default: ~/.cache/devmap/compile, unless TORCHINDUCTOR_CACHE_DIR is set.")
@click.option("--load-format", default="auto", show_default=True,
              type=click.Choice(["auto", "dummy"], case_sensitive=False),
              help="auto: the weights in each model directory; dummy: random weights made on their devices from the "
                   "directory's config (as vLLM's), to measure a model whose weights are not at hand "
                   "(devmap save MODEL DIR --config-only writes such a directory).")
@click.option("--profile-dir", default=None, type=click.Path(file_okay=False),
              help="Let POST /start_profile and /stop_profile record the engine core's steps with torch.profiler "
                   "(host ops, CUDA calls, kernels) and write a Chrome trace and an op table here (vLLM's profiler "
                   "endpoints); without it those answer 404.")
@click.option("--tensor-parallel", default=1, show_default=True, type=click.IntRange(min=1),
              help="Split every attention and MLP block of each model over N processes, started and stopped with "
                   "the service; on a multiple of N GPUs each group of N is a pipeline stage.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"], case_sensitive=False))
def serve(model_dirs: tuple[str, ...], device_map: str, max_memory: str | None, dtype: str | None,
          quantize: str | None,
          model_root: str | None, host: str, port: int, api_key: str | None, max_batch: int,
          join_tokens: int, riding: bool | None, max_queue: int,
          max_prompt_tokens: int, max_tokens: int, request_timeout: float, idle_timeout: float | None,
          unload_drain: float, lanes: int | None, compile_steps: bool | None, compile_beside: bool | None,
          compile_cache: str | None, load_format: str,
          profile_dir: str | None, tensor_parallel: int, log_level: str) -> None:
    """Serve models on their devices over an OpenAI-compatible HTTP API.

    Loads MODEL_DIR... (ids: their directory names) and serves them until SIGTERM or Ctrl-C.

    POST /v1/completions and /v1/chat/completions (streaming with stream=true), GET /v1/models,
    POST /v1/models/load and DELETE /v1/models/{id}, GET /health and /metrics (Prometheus);
    with --profile-dir, POST /start_profile and /stop_profile.
    """
    if not _loopback(host) and not api_key:
        raise click.UsageError(f"binding {host} exposes the service beyond this machine: pass --api-key KEY "
                               "(or set DEVMAP_API_KEY), or bind 127.0.0.1")
    if not model_dirs and model_root is None:
        raise click.UsageError("nothing to serve: name model directories, or --model-root for loads on request")
    if tensor_parallel > 1:
        placing = [flag for flag, value in (("--device-map", device_map != "auto"), ("--quantize", quantize),
                                            ("--lanes", lanes)) if value]
        if placing:
            raise click.UsageError("--tensor-parallel places each process's shard itself (its GPU of each group of "
                                   f"N, the groups the pipeline's stages): leave out {', '.join(placing)}")
        _check_splits(model_dirs, tensor_parallel)
    if compile_beside and (compile_steps is not None or tensor_parallel > 1):
        raise click.UsageError("--compile-beside compiles a whole model's steps while it serves: leave out "
                               "--compile / --no-compile and --tensor-parallel")

    listening = _bound(host, port)  # before anything loads: an address in use fails now, not after the loads
    from devmap.serving.compile_cache import use_compile_cache
    from devmap.serving.core_parts import RegistrySettings
    from devmap.serving.core_start import start_core
    from devmap.serving.limits import EngineLimits

    limits = EngineLimits(max_batch=max_batch, max_queue=max_queue, join_tokens=join_tokens, riding=riding,
                          max_prompt_tokens=max_prompt_tokens,
                          max_new_tokens=max_tokens, request_timeout=request_timeout, idle_timeout=idle_timeout,
                          unload_drain=unload_drain, lanes=lanes, compile=compile_steps, compile_beside=compile_beside,
                          profile_dir=str(Path(profile_dir).expanduser().resolve()) if profile_dir else None)
    # the models and the loop that batches them run in a process of their own (the engine core); this one answers
    # HTTP, tokenizes and detokenizes, so that no request's Python work holds the loop that issues the GPUs' work.
    # The core starts first: its imports and loads run while this process imports its own stack below
    use_compile_cache(compile_cache)  # before the engine core's process starts: it inherits the environment
    settings = RegistrySettings(model_root, device_map, max_memory, dtype, quantize,
                                random_weights=load_format.lower() == "dummy", tensor_parallel=tensor_parallel)
    paths = [Path(directory).expanduser().resolve() for directory in model_dirs]
    # the core loads them as soon as its own imports are done, not once this process's are
    started = start_core(settings, limits, log_level, models=[str(path) for path in paths])
    from devmap.bytecode import bytecode_advice, recompiled_packages

    if recompiled := recompiled_packages():  # the engine core and every restart pay for it
        click.echo(f"warning: {bytecode_advice(recompiled)}", err=True)

    import uvicorn
    from transformers import AutoTokenizer  # noqa: F401 - each model's tokenizer is read here once it is loaded

    from devmap.serving import Engine
    from devmap.serving.app import create_app
    from devmap.serving.errors import ServiceError

    imported = _process_age()  # this process's start, through its imports (beside the core's)
    engine = Engine.spawned(settings, limits, log_level=log_level, started=started)
    loading = time.perf_counter()
    try:
        engine.read_tokenizers(paths)  # while the core loads the models
        for path in paths:
            click.echo(f"loading {path.name}", err=True)
            described = engine.load(str(path), under_root=False)
            lanes = f" in {described['lanes']} lanes" if described["lanes"] > 1 else ""
            click.echo(f"loaded {described['id']} from {path} onto "
                       f"{', '.join(sorted(set(described['device_map'].values())))}: batches of up to "
                       f"{described['max_batch']} rows{lanes} of {described['cache_tokens_per_row']} cache tokens "
                       f"(more rows of shorter caches), {_steps(described)}; {_phases(described)}", err=True)
    except BaseException as exc:
        engine.close(timeout=30)
        listening.close()
        if isinstance(exc, ServiceError):
            raise click.ClickException(exc.message) from None
        raise
    loaded = time.perf_counter() - loading
    if imported is not None:
        engine.record_startup("api_imports", imported)
    engine.record_startup("command_line_loads", loaded)
    app = create_app(engine, api_key=api_key)
    age = _process_age()
    address = _address(listening)
    if age is not None:
        engine.metrics.ready_seconds.set(age)
        imports = f"its imports {imported:.1f} s beside the engine core's start, " if imported is not None else ""
        click.echo(f"answering on {address} {age:.1f} s after devmap serve started: {imports}then {loaded:.1f} s "
                   "reading tokenizers and waiting for the loads above (/metrics: devmap_startup_seconds, "
                   "devmap_serve_ready_seconds)", err=True)
    else:
        click.echo(f"answering on {address}", err=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import gc
    import logging

    # what is alive now (torch, transformers, the app, tokenizers: ~400k objects) is left out of this process's
    # later collections: a full one walks them all, in which no stream moves (docs/serving.md; the engine core's
    # process does the same after each load)
    gc.collect()
    gc.freeze()

    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")  # uvicorn's look
    logging.getLogger("devmap").setLevel(log_level.upper())  # per-batch timings at debug
    # uvicorn handles SIGTERM and SIGINT: it stops accepting, lets in-flight requests finish, then the app's
    # lifespan drains the engine
    config = uvicorn.Config(app, host=host, port=listening.getsockname()[1], log_level=log_level,
                            timeout_graceful_shutdown=int(request_timeout) + 5)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the signal it stopped on again, once stopped
        uvicorn.Server(config).run(sockets=[listening])


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to the service's address (uvicorn listens on it), or one line saying why it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    listening = socket.socket(family, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart rebinds at once
        listening.bind((host, port))
    except OSError as exc:
        listening.close()
        fix = ("stop what listens there or pick another --port" if exc.errno == errno.EADDRINUSE else
               "pick another --host or --port")
        raise click.ClickException(f"cannot listen on {host}:{port} ({exc.strerror or exc}): {fix}") from None
    return listening


def _address(listening: socket.socket) -> str:
    """The URL clients reach the service at (the port the system gave, where --port 0 asked for any)."""
    host, port = listening.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _steps(described: dict) -> str:
    """How a loaded model's steps run, for the console."""
    if described["compiled"]:
        return "steps compiled"
    if described.get("compiling"):
        return "steps captured eagerly while they compile (the log says when compiled ones take over)"
    return "steps captured eagerly"


def _phases(described: dict) -> str:
    """Where a load's time went, for the console: "plan 0.4 s, ..., compile 9.5 s (5 graphs, all from the compile
    cache), ..."."""
    from devmap.serving.load_phases import CompiledGraphs, phases_text

    graphs = described.get("compiled_graphs")
    return phases_text(described["load_seconds"], CompiledGraphs(**graphs) if graphs else None)


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/stat") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_splits(model_dirs: tuple[str, ...], size: int) -> None:
    """Refuse, before any process starts, a model directory the split does not divide, or more processes than GPUs."""
    from devmap.planning import hardware
    from devmap.planning.models import resolve_source
    from devmap.planning.tensor_parallel import check_split

    gpus = hardware.gpu_count()
    if gpus and gpus < size:
        raise click.UsageError(f"--tensor-parallel {size} runs one process per GPU, and {gpus} are visible")
    for directory in model_dirs:
        check_split(resolve_source(directory), size)
