"""A model whose steps compile while it serves (aot_eager on CPU: dynamo's tracing and guards): it answers before its
compile ends, its running batch moves to compiled steps at a step boundary and its requests get the tokens they would
have had alone, and an unload stops the compile."""

import asyncio
import threading
import time

import pytest
import torch

import devmap
from devmap.generation.continuous_rows import ContinuousBatch
import devmap.serving.warm_up as warm_up
from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry

from .lane_checks import _drain

BESIDE = 3  # eager steps run beside the compile, after which the batch waits for its end (if it has not ended)


@pytest.fixture
def compile_beside(compiled_on_cpu, monkeypatch):
    """Models compile beside their serving on this CPU, once `gate` is set; `moved` gets each serving batch that
    moved to compiled steps, with the steps it had run then."""
    gate, moved = threading.Event(), []
    real_warm_up, recompile = warm_up.warm_up, ContinuousBatch.recompile

    def gated(*args, **kwargs):
        assert gate.wait(120)
        return real_warm_up(*args, **kwargs)

    def recorded(self):
        moved.append(self.steps)
        recompile(self)

    monkeypatch.setattr(warm_up, "compiles", lambda model, wanted, quantization: wanted is not False)
    monkeypatch.setattr(warm_up, "warm_up", gated)
    monkeypatch.setattr(ContinuousBatch, "recompile", recorded)
    return gate, moved


@pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])
def test_a_model_answers_while_its_steps_compile_and_its_requests_move_to_them(model_root, compile_beside,
                                                                               monkeypatch, riding):
    gate, moved = compile_beside
    limits = EngineLimits(riding=riding, compile_beside=True)
    registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=limits)
    resident = registry.load(model_root / "tiny")
    assert not resident.compiled and resident.describe()["compiling"] and "compile" not in resident.load_seconds

    steps = [0]
    step = ContinuousBatch.step

    def held(self, joining=None):  # the eager batch steps beside the compile, then waits for its end
        if gate.is_set() and not self.run.compile:
            steps[0] += 1
            if steps[0] == BESIDE:
                assert resident.compiling.wait(300)
        return step(self, joining)

    monkeypatch.setattr(ContinuousBatch, "step", held)
    prompts = [[5 + (13 * i + 7 * k) % 400 for k in range(3 + (5 * i) % 11)] for i in range(5)]
    budgets = [24 + 3 * i for i in range(5)]
    engine = Engine(registry, limits)
    engine.start()

    async def crowd() -> list:
        jobs = [engine.submit("tiny", p, GenerationParams(max_new_tokens=n, temperature=0))
                for p, n in zip(prompts, budgets)]
        done = [asyncio.ensure_future(_drain(engine, job)) for job in jobs]
        while not all(job.generated for job in jobs):  # every request has tokens from eager steps
            await asyncio.sleep(0.001)
        gate.set()
        await asyncio.gather(*done)
        return [list(job.generated) for job in jobs]

    try:
        served = asyncio.run(crowd())
    finally:
        engine.close(timeout=120)
    assert resident.compiled and not resident.describe()["compiling"] and resident.compiling.failure is None
    assert resident.load_seconds["compile"] > 0 and resident.load_seconds["warm_up"] > 0
    assert resident.load_seconds["capture"] == 0  # nothing captures beside serving (nor on a CPU)
    graphs = resident.describe()["compiled_graphs"]
    assert graphs["total"] > 0 and graphs["from_cache"] == 0  # aot_eager: no inductor, so no compile cache
    assert len(moved) == 1 and moved[0] > BESIDE  # the running batch went on with compiled steps
    eos = list(resident.eos_ids)
    for ids, new, answer in zip(prompts, budgets, served):
        out = devmap.generate(resident.model, torch.tensor([ids]), max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=eos[0])[0, len(ids):].tolist()
        assert answer == out[:next((k for k, t in enumerate(out) if t in eos), len(out))]


def test_an_unload_stops_the_compile_and_a_failed_compile_leaves_eager_steps(model_root, compile_beside,
                                                                             monkeypatch, caplog):
    gate, _ = compile_beside
    registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=EngineLimits(compile_beside=True))
    resident = registry.load(model_root / "tiny", model_id="stopped")
    gate.set()
    time.sleep(0.05)
    registry.unload("stopped")  # waits for the compile to end at its next step
    assert not resident.compiling.running and not resident.compiled

    def failing(*args, **kwargs):
        raise RuntimeError("no C++ compiler (a test's)")

    monkeypatch.setattr(warm_up, "warm_up", failing)
    resident = registry.load(model_root / "tiny", model_id="failing")
    assert resident.compiling.wait(60)
    assert not resident.compiled and "no C++ compiler" in resident.compiling.failure
    assert "decode steps stay eager" in caplog.text


@pytest.mark.parametrize("limits", [EngineLimits(), EngineLimits(compile=True)], ids=["by default", "asked for"])
def test_a_compile_happens_before_the_model_serves_unless_beside_was_asked_for(model_root, compile_beside, limits):
    gate, _ = compile_beside
    gate.set()
    registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=limits)
    resident = registry.load(model_root / "tiny")
    assert resident.compiled and resident.compiling is None
    assert list(resident.load_seconds) == ["plan", "weights", "prepare", "compile", "capture", "warm_up"]
    assert resident.load_seconds["compile"] > 0 and resident.compiled_graphs.total > 0


def test_batches_eager_steps_carry_more_prompt_tokens_while_a_models_steps_compile():
    """A compile beside serving runs inside `compiling_beside` (wherever it compiles: in a process of its own the
    serving thread's captures are not paused), which ends with it, failed or not."""
    from devmap.generation import mixed_joins
    from devmap.serving.step_compile import StepCompile

    seen = []
    done = StepCompile("m", lambda stop: seen.append(mixed_joins._compiles_beside), lambda result: None)
    assert done.wait(10) and seen == [1]

    def failing(stop):
        raise RuntimeError("no compiler")

    failed = StepCompile("m", failing, lambda result: None)
    assert failed.wait(10) and failed.failure == "no compiler"
    assert mixed_joins._compiles_beside == 0
