"""Pipelined LLaMA inference on CPU, two stages: greedy tokens equal transformers' generate; forward equals the
model."""

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from devmap import generate, load
from devmap.cli import main
from devmap.errors import PipelineError, UsageError
from devmap.generation import forward

def prompts(batch=5, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of different lengths
    mask[3, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("lanes", [1, 2, 3, 5])
def test_greedy_equals_transformers(model, lanes):
    ids, mask = prompts()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    out = generate(model, ids, mask, max_new_tokens=12, lanes=lanes, split_layers=[2], eos_token_id=[])
    assert torch.equal(out, expected)


def test_eos_stops_each_row_like_transformers(model):
    ids, mask = prompts(seed=3)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 2])  # a token that row 0 produces third
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                              eos_token_id=eos)
    out = generate(model, ids, mask, max_new_tokens=10, lanes=2, split_layers=[1, 3], eos_token_id=eos,
                   pad_token_id=0)
    assert torch.equal(out, expected)
    assert (out[0, ids.shape[1] + 3:] == 0).all()  # padded after EOS


def test_forward_equals_the_model(model):
    ids, mask = prompts()
    logits = forward(model, ids, mask, lanes=3, split_layers=[1, 3])
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    ids, mask = prompts()
    kwargs = dict(max_new_tokens=8, lanes=2, split_layers=[2], eos_token_id=[])
    a = generate(model, ids, mask, do_sample=True, temperature=0.7, top_p=0.9, seed=5, **kwargs)
    b = generate(model, ids, mask, do_sample=True, temperature=0.7, top_p=0.9, seed=5, **kwargs)
    c = generate(model, ids, mask, do_sample=True, temperature=0.7, top_p=0.9, seed=6, **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = generate(model, ids, mask, **kwargs)
    assert torch.equal(generate(model, ids, mask, do_sample=True, top_k=1, seed=1, **kwargs), greedy)


def test_loaded_model_generates_like_transformers(tmp_path):
    from devmap.loading.saver import save

    save("llama-tiny", tmp_path / "ckpt", seed=1)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    placed = load(str(tmp_path / "ckpt"), max_memory={"cpu": "1GiB"})
    ids, mask = prompts()
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
    assert torch.equal(generate(placed, ids, mask, max_new_tokens=6, split_layers=[2], eos_token_id=[]), expected)


def test_bad_arguments(model):
    ids, mask = prompts()
    with pytest.raises(UsageError, match="max_new_tokens"):
        generate(model, ids, max_new_tokens=0)
    with pytest.raises(UsageError, match="lanes"):
        generate(model, ids, lanes=0)
    with pytest.raises(UsageError, match="temperature"):
        generate(model, ids, do_sample=True, temperature=0)
    with pytest.raises(UsageError, match="attention_mask has shape"):
        generate(model, ids, mask[:, 1:])
    with pytest.raises(UsageError, match="non-empty"):
        generate(model, ids[0])
    with pytest.raises(PipelineError, match="split_layers"):
        generate(model, ids, split_layers=[9])
    import torchvision

    with pytest.raises(PipelineError, match="not a LLaMA-style causal LM"):
        generate(torchvision.models.resnet18(), ids)


def test_errors_in_a_stage_reach_the_caller(model, monkeypatch):
    from devmap.generation import causal_lm

    def boom(self, stage, hidden, context, cache):
        raise RuntimeError("stage failed")

    monkeypatch.setattr(causal_lm.CausalLMStages, "run", boom)
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match="stage failed"):
        generate(model, ids, mask, lanes=2, split_layers=[2])


def test_cli_generate():
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "llama-tiny", "--max-memory", "cpu=1GB", "--batch-size", "3",
                                  "--prompt-len", "5", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["new_tokens"] <= 4 and data["new_tokens_per_s"] > 0
    result = runner.invoke(main, ["generate", "llama-tiny", "--max-memory", "cpu=1GB", "--batch-size", "2",
                                  "--prompt-len", "3", "--max-new-tokens", "2", "--no-graphs", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["cuda_graphs"] is False
    result = runner.invoke(main, ["generate", "llama-tiny", "--prompt", "hi", "--max-memory", "cpu=1GB"])
    assert result.exit_code == 2 and "needs a model directory with a tokenizer" in result.output
    result = runner.invoke(main, ["generate", "resnet18", "--max-memory", "cpu=1GB"])
    assert result.exit_code != 0 and result.output.startswith("Error: ")


def test_eager_attention_generates_like_transformers(tiny_llama):
    torch.manual_seed(1)
    model = tiny_llama(attn_implementation="eager")
    ids, mask = prompts(seed=2)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=7, lanes=2, split_layers=[2], eos_token_id=[]),
                       expected)


def test_unsupported_attention_is_refused(model, monkeypatch):
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    ids, mask = prompts()
    with pytest.raises(PipelineError, match="attn_implementation 'sdpa' or 'eager'"):
        generate(model, ids, mask, max_new_tokens=2)


def test_cached_steps_are_reused_across_calls_and_dropped_on_change(model, monkeypatch):
    """The paths that keep fixed-buffer steps on the model between calls (graphs on GPUs; eager here)."""
    from devmap import release_graphs
    from devmap.generation import lanes

    monkeypatch.setattr(lanes, "graphs_possible", lambda devices: True)
    ids, mask = prompts()
    kwargs = dict(max_new_tokens=6, lanes=2, split_layers=[2], eos_token_id=[])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    assert torch.equal(generate(model, ids, mask, **kwargs), expected)
    steps = model._devmap_steps["generate"].entries[0][1]
    other_ids, other_mask = prompts(seed=4)
    other_mask[0, :2] = 0  # another padding, same shapes: the same steps, reset
    other_ids = other_ids.masked_fill(other_mask == 0, 0)
    again = model.generate(other_ids, attention_mask=other_mask, max_new_tokens=6, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(model, other_ids, other_mask, **kwargs), again)
    assert model._devmap_steps["generate"].entries[0][1] is steps
    assert torch.equal(generate(model, ids[:, 2:], mask[:, 2:], **kwargs)[:, :3], ids[:, 2:5])  # new shapes
    assert model._devmap_steps["generate"].entries[0][1] is not steps
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    for _ in range(2):
        torch.testing.assert_close(forward(model, ids, mask, lanes=3, split_layers=[1, 3]), reference,
                                   atol=1e-5, rtol=1e-5)
    no_padding = torch.ones_like(mask)
    with torch.no_grad():
        plain = model(ids, attention_mask=no_padding).logits
    torch.testing.assert_close(forward(model, ids, no_padding, lanes=3, split_layers=[1, 3]), plain,
                               atol=1e-5, rtol=1e-5)
    # 3 stages x (3 lanes without padding + the 2 lanes that had some: rows 1 and 3)
    assert len(model._devmap_steps["forward"].entries) == 3 * (3 + 2)
    release_graphs(model)
    assert not hasattr(model, "_devmap_steps")
    assert torch.equal(generate(model, ids, mask, keep_graphs=False, **kwargs), expected)
    forward(model, ids, mask, keep_graphs=False)
    assert not hasattr(model, "_devmap_steps")


def test_weight_pointers_see_moved_and_replaced_weights(tiny_llama):
    from devmap.generation.step_cache import weight_pointers

    torch.manual_seed(0)
    model = tiny_llama()
    first = weight_pointers(model)
    assert weight_pointers(model) == first
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # updated in place: graphs stay valid
    assert weight_pointers(model) == first
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # replaced
    assert weight_pointers(model) != first
    model.model.layers[0].mlp.up_proj.weight.data = model.model.layers[0].mlp.up_proj.weight.data.clone()  # moved
    assert weight_pointers(model)[:-1] != first[:-1]


def test_eight_stages_generate_and_forward_like_transformers(tiny_llama):
    """An 8-GPU layout, as 8 CPU stages of one decoder layer each."""
    torch.manual_seed(3)
    model = tiny_llama(num_hidden_layers=8)
    ids, mask = prompts(batch=9)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    split = list(range(1, 8))
    assert torch.equal(generate(model, ids, mask, max_new_tokens=6, lanes=8, split_layers=split, eos_token_id=[]),
                       expected)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(forward(model, ids, mask, split_layers=split), reference, atol=1e-5, rtol=1e-5)


def test_streamed_tokens_are_the_returned_ones_and_a_false_stops(model):
    ids, mask = prompts()
    got: dict[int, list[torch.Tensor]] = {}

    def on_tokens(rows, step, tokens):
        got.setdefault(step, [None] * ids.shape[0])
        for i, row in enumerate(range(rows.start, rows.stop)):
            got[step][row] = int(tokens[i])
        return True

    out = generate(model, ids, mask, max_new_tokens=6, lanes=2, split_layers=[2], eos_token_id=[],
                   on_tokens=on_tokens)
    assert sorted(got) == list(range(6))
    assert torch.equal(torch.tensor([got[s] for s in range(6)]).T, out[:, ids.shape[1]:])
    steps = []
    out = generate(model, ids, mask, max_new_tokens=12, lanes=2, split_layers=[2], eos_token_id=[],
                   on_tokens=lambda rows, step, tokens: steps.append(step) or step < 2)
    assert out.shape[1] - ids.shape[1] == 3 and max(steps) == 2  # stopped after the step that said so


def test_keep_shapes_replays_alternating_shapes(model, monkeypatch):
    from devmap import release_graphs
    from devmap.generation import lanes
    from devmap.generation.step_cache import keep_shapes

    monkeypatch.setattr(lanes, "graphs_possible", lambda devices: True)
    ids, mask = prompts()
    kwargs = dict(max_new_tokens=4, lanes=2, split_layers=[2], eos_token_id=[])
    keep_shapes(model, 2)
    try:
        first = generate(model, ids, mask, **kwargs)
        steps = model._devmap_steps["generate"].entries[0][1]
        second = generate(model, ids[:3], mask[:3], **kwargs)
        assert model._devmap_steps["generate"].shapes == 2
        assert torch.equal(generate(model, ids, mask, **kwargs), first)
        assert model._devmap_steps["generate"].entries[0][1] is steps  # the first shape's steps, kept
        assert torch.equal(generate(model, ids[:3], mask[:3], **kwargs), second)
        generate(model, ids[:2], mask[:2], **kwargs)  # a third shape pushes out the least recent (the first)
        generate(model, ids, mask, **kwargs)
        assert model._devmap_steps["generate"].entries[0][1] is not steps
        with pytest.raises(ValueError):
            keep_shapes(model, 0)
    finally:
        release_graphs(model)
        model.__dict__.pop("_devmap_keep_shapes", None)


def test_a_replayed_graphs_output_is_copied_before_it_leaves_its_stream():
    from devmap.generation.graphed_step import GraphedStep

    step = GraphedStep(lambda x: x + 1, torch.zeros(2, 3), graph=False)
    out = step()
    assert step.handed_on(out, crosses=True) is out  # an eager step's output is its own allocation
    step.graph = object()  # as after a capture: the output lives in the pool the device's graphs share
    moved = step.handed_on(out, crosses=True)
    assert moved is not out and moved.data_ptr() != out.data_ptr() and torch.equal(moved, out)
    assert step.handed_on(out, crosses=False) is out  # read on its own stream only: no copy


def test_no_step_captures_while_another_thread_pauses_captures(monkeypatch):
    """A compile beside serving pauses captures (its device syncs fail while any stream captures): a step due to
    capture then runs eagerly and captures at its first use after the pause."""
    import threading

    from devmap.generation.graphed_step import GraphedStep, captures_paused

    captured = []
    step = GraphedStep(lambda x: x + 1, torch.zeros(2), graph=False)
    step.use_graph = True  # as on a GPU
    monkeypatch.setattr(step, "_capture", lambda: captured.append(step.calls))
    entered, leave = threading.Event(), threading.Event()

    def compiling() -> None:
        with captures_paused():
            entered.set()
            assert leave.wait(10)

    other = threading.Thread(target=compiling)
    other.start()
    assert entered.wait(10)
    assert torch.equal(step(), torch.ones(2)) and torch.equal(step(), torch.ones(2))  # the second would capture
    assert captured == []
    leave.set()
    other.join()
    step()
    assert captured == [3]
