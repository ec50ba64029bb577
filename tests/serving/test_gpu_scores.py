"""GPU-only, one GPU: a served model's scores (`logprobs`, and `echo`'s prompt scores) are those of transformers'
logits for the same checkpoint, float32."""

import asyncio

import torch
from transformers import AutoModelForCausalLM

from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


def test_served_scores_on_a_gpu_are_transformers_log_softmax(model_root):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = AutoModelForCausalLM.from_pretrained(str(model_root / "tiny"), dtype=torch.float32).to("cuda:0")
    registry = ModelRegistry(model_root, {"": 0})
    engine = Engine(registry, EngineLimits(compile=False))  # scores are taken outside the (compiled) steps
    registry.load(model_root / "tiny", model_id="scored")
    engine.start()
    ids = [1, 15, 27, 9, 88, 140, 7, 300, 41]

    async def ask() -> tuple:
        echo = engine.submit("scored", ids, GenerationParams(max_new_tokens=1, temperature=0, logprobs=1, echo=True))
        echo_text = "".join([p async for p in engine.stream(echo)])
        scored = engine.submit("scored", ids, GenerationParams(max_new_tokens=12, temperature=0, logprobs=3))
        text = "".join([p async for p in engine.stream(scored)])
        return echo, echo_text, scored, text

    try:
        echo, _, scored, _ = asyncio.run(ask())
    finally:
        engine.close(timeout=60)
    with torch.no_grad():
        whole = ids + scored.generated
        logprobs = torch.log_softmax(reference(torch.tensor([whole], device="cuda:0")).logits[0].float(), -1).cpu()
    assert echo.prompt_scores[0] is None and len(echo.prompt_scores) == len(ids)
    for i in range(1, len(ids)):
        value, top = echo.prompt_scores[i]
        assert abs(value - logprobs[i - 1, ids[i]].item()) < 1e-3
        assert top[0][0] == logprobs[i - 1].argmax().item()
    assert len(scored.scores) == len(scored.generated)
    for i, (token, (value, top)) in enumerate(zip(scored.generated, scored.scores)):
        row = logprobs[len(ids) - 1 + i]
        assert token == row.argmax().item() and abs(value - row[token].item()) < 1e-3
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
