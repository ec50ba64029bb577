"""GPU-only: a model whose steps compile (inductor) while it serves. Requests whose batch starts on captured eager steps
and moves to compiled ones mid-stream (its graphs captured anew) get the greedy tokens of generating alone (float32),
on one GPU and over two, both ways of joining; a service started again on the compile caches its first start filled
answers the same."""

import asyncio
import threading
import time

import httpx
import pytest
import torch

import devmap
from devmap.generation.continuous_rows import ContinuousBatch
from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry
from devmap.testing import gpu_count, require_gpus

from .conftest import running_server
from .lane_checks import _drain, served_and_alone
from .test_split_serving import SENTENCES, ask_together, whole_model_answers

pytestmark = require_gpus(1)

BESIDE = 4  # eager steps run beside the compile, after which the batch waits for its end (if it has not ended)


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])
def test_requests_moving_to_compiled_steps_mid_stream_get_the_tokens_of_generating_alone(model_root, gpus, riding,
                                                                                       monkeypatch, caplog):
    if gpu_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, {gpu_count()} visible")
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", "1")  # a reader that does not wait for its writer reads stale data
    torch.backends.cuda.matmul.allow_tf32 = False
    limits = EngineLimits(max_batch=4, riding=riding, compile_beside=True)
    registry = ModelRegistry(model_root, "balanced", {i: "8GiB" for i in range(gpus)}, limits=limits)
    resident = registry.load(model_root / "tiny")
    assert not resident.compiled and resident.describe()["compiling"]

    moved, steps, step, recompile = [], [0], ContinuousBatch.step, ContinuousBatch.recompile
    lock = threading.Lock()

    def recorded(self):
        moved.append(self.steps)
        recompile(self)

    def held(self, joining=None):
        if not self.run.compile:
            with lock:
                steps[0] += 1
                wait = steps[0] == BESIDE
            if wait:
                assert resident.compiling.wait(600)
        return step(self, joining)

    monkeypatch.setattr(ContinuousBatch, "recompile", recorded)
    monkeypatch.setattr(ContinuousBatch, "step", held)
    for served, alone in served_and_alone(registry, limits, "tiny", 4 * gpus):
        assert served == alone
    assert resident.compiled and resident.compiling.failure is None
    assert moved  # a running batch went on with compiled steps
    # and captured them: the steps made anew capture into fresh pools (their old pools take no new capture)
    assert not [r.getMessage() for r in caplog.records if "stays eager" in r.getMessage()]


def test_steps_capture_while_the_compile_beside_traces_and_requests_get_the_tokens_of_generating_alone(
        model_root, monkeypatch, caplog):
    """The serving thread keeps taking requests (new batch shapes, joiners mid-stream) throughout the compile: its
    steps capture while dynamo traces (the compile thread's pause lifted), never while inductor compiles or compiled
    code runs, and no capture fails."""
    from devmap.generation import graphed_step

    torch._dynamo.reset()  # the compile traces its regions anew (not dynamo's entries from an earlier test)
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    limits = EngineLimits(max_batch=4, compile_beside=True)
    registry = ModelRegistry(model_root, "balanced", {0: "8GiB"}, limits=limits)
    resident = registry.load(model_root / "tiny")
    during, begin = [], graphed_step.begin_capture

    def counted(graph, pool):
        if resident.compiling.running and threading.current_thread() is not threading.main_thread():
            during.append(graphed_step._paused)  # the engine's thread (not generating alone, for the references)
        return begin(graph, pool)

    monkeypatch.setattr(graphed_step, "begin_capture", counted)
    eos = list(resident.eos_ids)
    engine = Engine(registry, limits)  # one engine throughout: closing it would stop the compile
    engine.start()

    async def waves() -> list:
        asked, wave = [], 0
        while resident.compiling.running or not wave:
            count = 1 + wave % 3
            requests = [([5 + (13 * i + 7 * k + wave) % 400 for k in range(3 + (5 * i + wave) % 23)],
                         4 + (7 * i + wave) % 29) for i in range(2 * count)]
            jobs = [engine.submit("tiny", p, GenerationParams(max_new_tokens=n, temperature=0))
                    for p, n in requests[:count]]
            done = [asyncio.ensure_future(_drain(engine, job)) for job in jobs]
            while not any(job.generated for job in jobs):
                await asyncio.sleep(0.001)
            later = [engine.submit("tiny", p, GenerationParams(max_new_tokens=n, temperature=0))
                     for p, n in requests[count:]]
            done += [asyncio.ensure_future(_drain(engine, job)) for job in later]
            await asyncio.gather(*done)
            asked += [(p, n, list(job.generated)) for (p, n), job in zip(requests, jobs + later)]
            wave += 1
        return asked

    try:
        asked = asyncio.run(waves())
    finally:
        engine.close(timeout=120)
    assert resident.compiled and resident.compiling.failure is None
    assert during and not any(during), during  # captured during the compile, each with no pause in force
    for prompt, new, served in asked:
        out = devmap.generate(resident.model, torch.tensor([prompt]), max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=eos[0])[0, len(prompt):].tolist()
        assert served == out[:next((k + 1 for k, t in enumerate(out) if t in eos), len(out))]
    assert not [r.getMessage() for r in caplog.records if "stays eager" in r.getMessage()]


def test_a_service_started_again_on_its_filled_compile_cache_answers_the_same(model_root, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's products in float32, as the service's
    requests = [(SENTENCES[i % len(SENTENCES)] + " " * (i // len(SENTENCES)), 4 + (5 * i) % 13) for i in range(10)]
    reference = whole_model_answers(model_root, "tiny", 0)
    expected = [reference(p, n) for p, n in requests]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    for start in range(2):  # a fresh cache, then the one the first start filled
        with running_server(model_root, "--max-tokens", "32", "--log-level", "info", max_memory=None,
                            env=env) as (url, process):
            assert ask_together(url, "tiny", requests) == expected  # eager steps, or compiled ones by now
            deadline = time.monotonic() + 600
            while any(m["compiling"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]):
                assert time.monotonic() < deadline, "the compile beside serving did not end"
                time.sleep(0.2)
            described = httpx.get(url + "/v1/models", timeout=30).json()["data"]
            assert all(m["compiled"] for m in described)
            graphs = [m["compiled_graphs"] for m in described]
            assert all(g["total"] > 0 for g in graphs)
            assert ask_together(url, "tiny", requests) == expected  # compiled steps
        print(process.stdout.read())  # the server's log: its compiled entries made, or why they compiled here
        if start == 0:  # an empty cache: the steps compiled in a process of their own, this one loaded all of them
            assert all(g["from_cache"] == g["total"] for g in graphs), graphs
        else:  # the restart read the cache its first start filled
            assert all(g["from_cache"] > 0 for g in graphs), graphs


def test_a_first_batch_of_the_warm_ups_shape_replays_its_steps_and_answers_as_alone(model_root, monkeypatch):
    """A model compiled before it serves keeps the steps its warm-up captured: a first batch of a few short requests
    (the warm-up's shape) replays them instead of capturing in the engine's loop, where every model's streams would
    wait for it; its greedy tokens are those of generating alone. Without them (freed), the same batch captures."""
    from devmap.generation import graphed_step
    from devmap.generation.step_cache import release_graphs, step_cache

    torch.backends.cuda.matmul.allow_tf32 = False
    limits = EngineLimits(max_batch=4)
    registry = ModelRegistry(model_root, "balanced", {0: "8GiB"}, limits=limits)
    resident = registry.load(model_root / "tiny")
    assert resident.compiled and step_cache(resident.model, "continuous").shapes == 1
    captures = [0]
    begin = graphed_step.begin_capture

    def counted(graph, pool):
        captures[0] += 1
        return begin(graph, pool)

    monkeypatch.setattr(graphed_step, "begin_capture", counted)
    for served, alone in served_and_alone(registry, limits, "tiny", 2):
        assert served == alone
    kept = captures[0]
    release_graphs(resident.model)
    captures[0] = 0
    for served, alone in served_and_alone(registry, limits, "tiny", 2):
        assert served == alone
    assert kept < captures[0], (kept, captures[0])


def test_a_model_loaded_again_warms_up_at_the_shapes_it_served_at_and_answers_as_alone(model_root, tmp_path):
    """Once a model served (its warm-up whole, its region store set), the shapes its batches served at are kept; a
    later load of it warms up at that batch shape with those join shapes made and captured before it answers, starts
    its batches at that shape, and its requests get the greedy tokens of generating alone."""
    from devmap.generation import region_store
    from devmap.generation.step_cache import step_cache

    torch.backends.cuda.matmul.allow_tf32 = False
    limits = EngineLimits(max_batch=4)
    region_store.keep_regions_in(tmp_path)
    try:
        registry = ModelRegistry(model_root, "balanced", {0: "8GiB"}, limits=limits)
        first = registry.load(model_root / "tiny")
        assert first.compiled and first.warm_key is not None and first.kept_shapes is None
        for served, alone in served_and_alone(registry, limits, "tiny", 4):
            assert served == alone
        kept = first.kept_shapes
        assert kept is not None and kept.joins and kept.batch == first.batch_shape
        registry.unload("tiny")
        torch._dynamo.reset()  # as a fresh process: the store's entries load
        again = registry.load(model_root / "tiny")
        assert again.batch_shape == kept.batch and again.kept_shapes == kept
        entries = step_cache(again.model, "continuous").entries
        made = {(0, key[1]) for key in entries if isinstance(key, tuple) and key[0] == "join"}
        made |= {key[1:] for key in entries.get(("rows", 0), {}) if isinstance(key, tuple) and key[0] == "mixed"}
        assert set(kept.joins) <= made
        for served, alone in served_and_alone(registry, limits, "tiny", 4):
            assert served == alone
    finally:
        region_store.keep_regions_in(None)
