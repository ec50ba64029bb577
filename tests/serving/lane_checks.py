"""What the lane tests share: many greedy requests at once to a model whose batches run in lanes, each answer checked
against `devmap.generate` of its prompt alone."""

import asyncio

import torch

import devmap
from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry


def served_and_alone(registry: ModelRegistry, limits: EngineLimits, model_id: str, count: int,
                     metrics: dict | None = None) -> list:
    """(served answer, answer alone) of `count` greedy requests of mixed prompts and budgets sent at once, then
    `count` more sent while those run (they join the running batch's free rows, the emptiest lane first). `metrics`,
    when given, gets the engine's metrics (`EngineMetrics`)."""
    resident = registry.get(model_id)
    eos = list(resident.eos_ids)
    prompts = [[5 + (13 * i + 7 * k) % 400 for k in range(3 + (5 * i) % 23)] for i in range(2 * count)]
    budgets = [4 + (7 * i) % 29 for i in range(2 * count)]

    def alone(ids: list[int], new: int) -> list[int]:
        out = devmap.generate(resident.model, torch.tensor([ids]), max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=eos[0])[0, len(ids):].tolist()
        return out[:next((k + 1 for k, t in enumerate(out) if t in eos), len(out))]

    engine = Engine(registry, limits)
    engine.start()

    async def crowd() -> list:
        greedy = [GenerationParams(max_new_tokens=n, temperature=0) for n in budgets]
        first = [engine.submit(model_id, p, g) for p, g in zip(prompts[:count], greedy[:count])]
        done = [asyncio.ensure_future(_drain(engine, job)) for job in first]
        while not any(job.generated for job in first):
            await asyncio.sleep(0.001)
        later = [engine.submit(model_id, p, g) for p, g in zip(prompts[count:], greedy[count:])]
        done += [asyncio.ensure_future(_drain(engine, job)) for job in later]
        await asyncio.gather(*done)
        return [list(job.generated) for job in first + later]

    try:
        served = asyncio.run(crowd())
    finally:
        engine.close(timeout=120)
    if metrics is not None:
        metrics["engine"] = engine.core.core.metrics
    return list(zip(served, [alone(p, n) for p, n in zip(prompts, budgets)]))


async def _drain(engine: Engine, job) -> None:
    async for _ in engine.stream(job):
        pass
