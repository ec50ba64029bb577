"""Each touchpoint of devmap.compat against the installed releases (CI runs this at both ends of the range)."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap import compat
from devmap.generation.lane_cache import LaneCache

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def test_the_cache_reaches_attention_by_the_layer_s_keyword(llama):
    # transformers renamed the decoder layer's `past_key_values` to `cache`: a cache passed under the wrong name
    # vanished into **kwargs, and generation read keys it had never written
    layer = llama.model.layers[0]
    keyword = compat.cache_keyword(layer)
    assert keyword in ("cache", "past_key_values")
    cache = LaneCache(rows=1, max_len=8, device=torch.device("cpu"))
    hidden = torch.randn(1, 3, CONFIG["hidden_size"])
    positions = torch.arange(3)[None]
    context = {"attention_mask": None, "position_ids": positions,
               "position_embeddings": llama.model.rotary_emb(hidden, positions)}
    with torch.no_grad():
        out = compat.call_decoder_layer(layer, hidden, cache, context, keyword)
    assert out.shape == hidden.shape
    assert cache.keys[layer.self_attn.layer_idx][:, :, :3].abs().sum() > 0  # the prompt's keys were written


def test_transformers_mask_is_built_for_a_prompt(llama):
    like = torch.empty(2, 5, 0)
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (padding.cumsum(-1) - 1).clamp(min=0)
    mask = compat.transformers_causal_mask(llama.config, like, padding, positions)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool


def test_a_model_built_with_weights_left_uninitialized_runs_no_init_and_keeps_its_buffers(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    calls = []
    original = LlamaPreTrainedModel._init_weights
    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", lambda self, module: calls.append(module) or
                        original(self, module))
    torch.manual_seed(0)
    with compat.weights_left_uninitialized():
        built = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    assert calls == []
    initialized = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    assert calls  # outside the context the constructors initialize again (torch's init functions are back)
    assert torch.equal(built.model.rotary_emb.inv_freq, initialized.model.rotary_emb.inv_freq)
    assert torch.nn.init.normal_ is not None and torch.nn.init.normal_.__name__ == "normal_"


def test_attention_implementation_is_read_from_the_config(llama):
    assert compat.attention_implementation(llama.config) == "sdpa"
    seen = []
    step = compat.with_decode_attention(llama.config, lambda: seen.append(
        (llama.config._attn_implementation, compat.attention_implementation(llama.config))), compat.sdpa_attention)
    step()  # inside a decode step (another thread's, to anyone else) the model is still an sdpa model
    assert seen == [(compat.DECODE_ATTENTION, "sdpa")] and llama.config._attn_implementation == "sdpa"


def test_accelerate_hooks_are_bypassed_and_put_back(llama):
    from accelerate import dispatch_model

    model = dispatch_model(llama, device_map={"": "cpu"}, force_hooks=True)
    hooked = [m for m in model.modules() if "forward" in m.__dict__ and hasattr(m, "_old_forward")]
    assert hooked, "accelerate put no hook on the model"
    assert compat.hook_execution_device(hooked[0]) == torch.device("cpu")
    assert compat.own_forward(hooked[0]) == hooked[0]._old_forward
    before = {id(m): m.__dict__["forward"] for m in hooked}
    with compat.device_hooks_bypassed(model):
        assert all(m.__dict__["forward"] == m._old_forward for m in hooked if m is not model)
    assert all(m.__dict__["forward"] is before[id(m)] for m in hooked)
    # overlapping calls (a batch, and a compile in another thread): the hooks come back when the last one ends
    first, second = compat.device_hooks_bypassed(model), compat.device_hooks_bypassed(model)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert all(m.__dict__["forward"] == m._old_forward for m in hooked if m is not model)
    second.__exit__(None, None, None)
    assert all(m.__dict__["forward"] is before[id(m)] for m in hooked)
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)


def test_a_swapped_module_keeps_a_hook_that_moves_arguments_and_refuses_one_that_offloads():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    old, new = nn.Linear(4, 4), nn.Linear(4, 4)
    assert compat.device_hook_moved(old, new) and not hasattr(new, "_hf_hook")  # no hook, nothing to move
    add_hook_to_module(old, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    assert compat.device_hook_moved(old, new)
    x = torch.ones(1, 4)
    assert new._hf_hook is old._hf_hook and torch.equal(new(x), compat.own_forward(new)(x))
    offloaded, other = nn.Linear(4, 4), nn.Linear(4, 4)
    add_hook_to_module(offloaded, AlignDevicesHook(execution_device="cpu", offload=True,
                                                   weights_map={"weight": offloaded.weight.data,
                                                                "bias": offloaded.bias.data}))
    assert not compat.device_hook_moved(offloaded, other) and not hasattr(other, "_hf_hook")


def test_recompile_limit_and_the_stance_that_refuses_to_compile():
    compat.raise_recompile_limit(64)
    assert torch._dynamo.config.recompile_limit >= 64
    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    double(torch.ones(3))
    with compat.fail_on_recompile():
        double(torch.ones(3))  # compiled already: runs
        with pytest.raises(RuntimeError, match="recompile"):
            double(torch.ones(4, 4))  # a new shape would compile: refused


def test_compile_backend_is_the_backend_its_name_compiles_with():
    from torch._inductor.compile_fx import compile_fx

    assert compat.compile_backend("aot_eager") is torch._dynamo.lookup_backend("aot_eager")
    seen = []

    def wrapped(graph, example_inputs):  # a backend of one's own that calls the named one
        seen.append(len(example_inputs))
        return compat.compile_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    add = torch.compile(lambda x: x + 1, backend=wrapped, dynamic=False)
    assert add(torch.ones(2)).tolist() == [2.0, 2.0] and seen == [1]
    torch._dynamo.reset()
    inductor = compat.compile_backend("inductor")  # what torch.compile(backend="inductor") calls: compile_fx
    assert "compile_fx" in inductor.__code__.co_names and callable(compile_fx)


def test_compile_totals_count_a_compile_s_seconds_and_graphs():
    before = compat.compile_totals()
    triple = torch.compile(lambda x: x * 3 + 1, backend="aot_eager", dynamic=False)
    triple(torch.ones(5))
    after = compat.compile_totals()
    assert after.graphs == before.graphs + 1 and after.seconds > before.seconds
    assert after.from_cache == before.from_cache  # aot_eager reads no inductor cache (hits: test_compile_cache)
    triple(torch.ones(5))  # compiled already: nothing more
    assert compat.compile_totals() == after


def test_distinct_sizes_gives_equal_dimensions_their_own_symbols():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    weight = torch.ones(4, 4)
    step = torch.compile(lambda x: x @ weight, backend="eager", dynamic=True)
    with compat.distinct_sizes():
        step(torch.ones(4, 4))  # 4 rows beside a weight of 4: duck shaping would tie the rows to it
        step(torch.ones(7, 4))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_dynamic_dims_marks_as_dynamo_does_and_one_compile_serves_every_size():
    from torch._dynamo.utils import counters

    plain = torch.ones(3, 5)
    compat.dynamic_dims(plain, (0,))
    compat.dynamic_dims(plain, (1,))
    reference = torch.ones(3, 5)
    torch._dynamo.maybe_mark_dynamic(reference, [0, 1])
    assert plain._dynamo_weak_dynamic_indices == reference._dynamo_weak_dynamic_indices == {0, 1}
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda x: x.sum(0) * 2, backend="eager", dynamic=None)
    for rows in (3, 6, 9):  # fresh tensors, marked at each call as a compiled region's inputs are
        x = torch.ones(rows, 4)
        compat.dynamic_dims(x, (0,))
        assert step(x).tolist() == [2.0 * rows] * 4
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_an_entry_compiled_ahead_of_time_saves_with_its_guards_where_this_torch_keeps_the_backend():
    if not compat.ahead_of_time_possible():
        pytest.skip(f"torch {torch.__version__} has no aot_compile")
    if not compat.ahead_of_time_keeps("aot_eager"):  # torch 2.11: inductor's entries only
        assert torch.__version__ < "2.14"
        with pytest.raises(Exception, match="OutputCode"):
            compat.entry_bytes(compat.ahead_of_time(_doubled, "aot_eager", (torch.ones(3),)))
        return
    entry = compat.ahead_of_time(_doubled, "aot_eager", (torch.ones(3),))
    assert entry(torch.ones(3)).tolist() == [2.0] * 3
    loaded = compat.entry_from_bytes(compat.entry_bytes(entry), _doubled)
    assert compat.entry_accepts(loaded, (torch.ones(3),))
    assert not compat.entry_accepts(loaded, (torch.ones(3, dtype=torch.float64),))  # a dtype its guards did not see
    assert loaded(torch.full((3,), 2.0)).tolist() == [4.0] * 3
    torch._dynamo.reset()


def test_foreach_helpers():
    a, b = [torch.ones(3), torch.ones(2)], [torch.full((3,), 2.0), torch.full((2,), 3.0)]
    compat.foreach_add_(a, b)
    assert a[0].tolist() == [3.0] * 3 and a[1].tolist() == [4.0] * 2
    copies = compat.foreach_copies(a)
    compat.foreach_zero_(a)
    assert copies[0].tolist() == [3.0] * 3 and a[0].sum() == 0


def test_plain_parameters_store_themselves():
    weight = nn.Parameter(torch.randn(4, 4))
    assert [t.data_ptr() for t in compat.stored_tensors(weight)] == [weight.data_ptr()]


def test_int8_by_weight_shape_equals_torchao_s_quantize():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    layers = [nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(3)]
    theirs = [nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(3)]
    for mine, other in zip(layers, theirs):
        other.weight.data.copy_(mine.weight.data)
    compat.torchao_int8_rows(layers, Int8WeightOnlyConfig())
    for layer in theirs:
        quantize_(layer, Int8WeightOnlyConfig())
    for mine, other in zip(layers, theirs):
        for a, b in zip(compat.stored_tensors(mine.weight), compat.stored_tensors(other.weight), strict=True):
            assert torch.equal(a, b)
    flat, metadata = compat.torchao_flat_state_dict({"layer.weight": layers[0].weight})
    assert flat and metadata
    qdata, scale, zero = compat.torchao_int8_parts(layers[0].weight)
    assert qdata.dtype == torch.int8 and qdata.shape == (32, 64) and scale.shape == (32, 1)
    rebuilt = compat.torchao_int8_weight(qdata, scale, zero, layers[0].weight)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(nn.functional.linear(x, rebuilt), layers[0](x))
    assert compat.torchao_int8_parts(nn.Linear(4, 4).weight) is None  # plain weights: no torchao import


def test_torchao_fp8_weights_come_apart_and_back_together(monkeypatch):
    pytest.importorskip("torchao")
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import quantize_

    from devmap.loading.quantize import torchao_config
    from devmap.planning.quantization import parse_quantization

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)  # its product runs on CPUs
    linear = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    quantize_(linear, torchao_config(parse_quantization("fp8")))
    qdata, scale = compat.torchao_fp8_parts(linear.weight)
    assert qdata.dtype == torch.float8_e4m3fn and qdata.shape == (32, 64) and scale.shape == (32, 1)
    rebuilt = compat.torchao_fp8_weight(qdata, scale, linear.weight)
    assert rebuilt.qdata is qdata and rebuilt.scale is scale and rebuilt.dtype == linear.weight.dtype
    assert rebuilt.act_quant_kwargs == linear.weight.act_quant_kwargs
    assert compat.torchao_fp8_parts(nn.Linear(4, 4).weight) is None  # plain weights: no torchao import
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    x[1] = 0  # a row of zeros: torchao's scale 0, as its own
    from torchao.quantization.quantize_.common.quantize_tensor_kwargs import _choose_quant_func_and_quantize_tensor

    tokens, scales = compat.torchao_fp8_tokens(x, linear.weight)
    own = _choose_quant_func_and_quantize_tensor(x, linear.weight.act_quant_kwargs)
    assert torch.equal(tokens.view(torch.uint8), own.qdata.view(torch.uint8)) and torch.equal(scales, own.scale)
    assert scales.shape == (5, 1) and scales.dtype == torch.float32
    assert compat.torchao_fp8_fast_accumulation(linear.weight) is linear.weight.mm_config.use_fast_accum
    x[1] = 1
    try:
        expected = linear(x)
    except RuntimeError as exc:  # torch 2.11's CPU float8 product takes one scale per tensor
        assert "per-tensor scaling" in str(exc)
        return
    assert torch.equal(nn.functional.linear(x, rebuilt), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 CUDA GPU")
def test_torchao_int4_comes_apart_into_codes_scales_and_zeros():
    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    from devmap.loading.quantize import torchao_config
    from devmap.planning.quantization import parse_quantization

    linear = nn.Linear(13824, 256, bias=False, device="cuda", dtype=torch.bfloat16)  # 13,824 is padded to 14,336
    quantize_(linear, torchao_config(parse_quantization("int4")))
    q, scale, zero = compat.torchao_int4_codes(linear.weight)
    assert q.shape == (256, 13824) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (256, 13824 // 128)
    values = ((q.float() - 8).reshape(256, -1, 128) * scale.float()[..., None] + zero.float()[..., None])
    eye = torch.eye(13824, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(values.reshape(256, -1).to(torch.bfloat16), linear(eye).t(), atol=1e-6, rtol=1e-2)
    assert compat.torchao_int4_codes(torch.ones(2, 2, device="cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 CUDA GPU")
@pytest.mark.parametrize("nested", [False, True])
def test_bitsandbytes_four_bit_comes_apart_into_codes_absmax_and_its_table(nested):
    bnb = pytest.importorskip("bitsandbytes")

    torch.manual_seed(0)
    weight = torch.randn(96, 512, device="cuda", dtype=torch.bfloat16)
    params = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4", blocksize=64,
                               compress_statistics=nested).cuda()
    q, absmax, code, dtype = compat.bitsandbytes_four_bit_codes(params)
    assert q.shape == (96, 512) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert absmax.shape == (96, 8) and len(code) == 16 and dtype == torch.bfloat16
    values = torch.tensor(code, device="cuda")[q.long()].reshape(96, 8, 64) * absmax[..., None]
    want = bnb.functional.dequantize_4bit(params.data, params.quant_state).float()
    torch.testing.assert_close(values.reshape(96, 512), want, atol=1e-6, rtol=1e-2)
    assert compat.bitsandbytes_four_bit_codes(torch.ones(2, 2, device="cuda")) is None


def test_dropping_blas_workspaces_needs_no_gpu():
    with compat.own_blas_workspace():  # torch's private binding exists, and does nothing harmful without CUDA
        assert torch.ones(2, 3) @ torch.ones(3, 2) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 CUDA GPU")
def test_a_captured_product_keeps_its_workspace_from_its_capture_streams_next_uses():
    # cuBLAS keeps one workspace per stream and a graph the one of the stream it was captured on. Without
    # own_blas_workspace, destroying another graph captured on that stream frees it, and the stream's next eager
    # products (torch's stream pool hands streams out again) write it while the graph replays on another stream.
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(0)
    a, b = torch.randn(16, 1 << 16, device="cuda"), torch.randn(1 << 16, 16, device="cuda")  # split-K: a workspace
    x, y = torch.randn_like(a), torch.randn_like(b)
    expected = a @ b
    capture, replay = torch.cuda.Stream(), torch.cuda.Stream()

    def captured(product):
        graph = torch.cuda.CUDAGraph()
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            product()  # eager first: the stream's own workspace exists before the capture
            with compat.own_blas_workspace():
                compat.begin_capture(graph, compat.graph_pool())
                out = product()
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(capture)
        return graph, out

    other, _ = captured(lambda: x @ y)
    graph, out = captured(lambda: a @ b)
    del other
    results = []
    replay.wait_stream(torch.cuda.current_stream())
    for _ in range(200):
        with torch.cuda.stream(replay):
            graph.replay()
            results.append(out.clone())
        with torch.cuda.stream(capture):  # the capture stream in its next role, at the same time
            for _ in range(4):
                x @ y
    torch.cuda.synchronize()
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 CUDA GPU")
def test_graph_pool_capture_and_sleep_on_a_gpu():
    x = torch.ones(4, device="cuda")
    pool = compat.graph_pool()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compat.begin_capture(graph, pool)
        y = x * 3
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    x.fill_(2)
    compat.gpu_sleep(1000)
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [6.0] * 4


def test_pipeline_stages_of_one_rank_train_without_talking_to_themselves(tmp_path):
    """A V schedule on one rank: both stages live here, so the start-up handshake must not send to itself (gloo
    has no connection to its own rank), and shape inference must leave BatchNorm statistics alone."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        first, second = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Linear(8, 2)
        before = first[1].running_mean.clone(), int(first[1].num_batches_tracked)
        stages = [compat.pipeline_stage_fixed(PipelineStage(m, i, 2, torch.device("cpu")))
                  for i, m in enumerate((first, second))]
        schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=nn.MSELoss())
        x, target = torch.randn(4, 4), torch.randn(4, 2)
        reference = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        reference.load_state_dict({**{f"0.{k}": v for k, v in first[0].state_dict().items()},
                                   **{f"1.{k}": v for k, v in first[1].state_dict().items()},
                                   **{f"2.{k}": v for k, v in second.state_dict().items()}})
        losses: list[torch.Tensor] = []
        schedule.step(x, target=target, losses=losses)
        expected = torch.stack([nn.functional.mse_loss(reference(xs), ts)
                                for xs, ts in zip(x.chunk(2), target.chunk(2))]).mean()
        torch.testing.assert_close(torch.stack(losses).mean(), expected.detach())
        # two micro-batches counted, none from shape inference
        assert int(first[1].num_batches_tracked) == before[1] + 2
    finally:
        dist.destroy_process_group()


def test_with_decode_attention_swaps_sdpa_for_the_step_only():
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from devmap.compat import DECODE_ATTENTION, attention_function, sdpa_attention, with_decode_attention

    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    attention = object()
    seen = []
    step = with_decode_attention(config, lambda: seen.append((config._attn_implementation,
                                                              attention_function(config))), attention)
    step()
    assert seen == [(DECODE_ATTENTION, attention)] and config._attn_implementation == "sdpa"  # only in the step
    assert attention_function(config) is sdpa_attention_forward
    assert ALL_ATTENTION_FUNCTIONS[DECODE_ATTENTION] is attention
    eager = LlamaConfig(hidden_size=64, num_attention_heads=8, num_hidden_layers=1)
    eager._attn_implementation = "eager"
    plain = object()
    assert with_decode_attention(eager, plain, attention) is plain  # eager attention adds float masks: kept
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    query, key, value = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.rand(3, 1, 1, 40) > 0.3
    mask[:, :, :, 0] = True
    torch.testing.assert_close(sdpa_attention(module, query, key, value, mask, scaling=0.25)[0],
                               sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)[0])


def test_decode_attention_held_by_overlapping_threads_stays_until_the_last_lets_go():
    """A service's step and its model's compile in another thread overlap: the first to end must not put sdpa back
    under the other (whose trace would then be compiled for sdpa); a served model's pin keeps the choice while its
    config lives, and nothing is held once it is freed."""
    import gc
    import threading

    from transformers import LlamaConfig

    from devmap.compat import DECODE_ATTENTION, _ATTENTION_HOLDS, pin_decode_attention, with_decode_attention

    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    inside, ended, seen = threading.Event(), threading.Event(), []

    def long_step() -> None:
        inside.set()
        assert ended.wait(10)
        seen.append(config._attn_implementation)  # read after the other thread's step ended

    other = threading.Thread(target=with_decode_attention(config, long_step, object()))
    other.start()
    assert inside.wait(10)
    with_decode_attention(config, lambda: seen.append(config._attn_implementation), object())()
    ended.set()
    other.join()
    assert seen == [DECODE_ATTENTION, DECODE_ATTENTION] and config._attn_implementation == "sdpa"
    assert id(config) not in _ATTENTION_HOLDS

    def pinned() -> int:
        served = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)
        served._attn_implementation = "sdpa"
        pin_decode_attention(served, object())
        with_decode_attention(served, lambda: None, object())()
        assert served._attn_implementation == DECODE_ATTENTION  # pinned: a step's end leaves it
        assert _ATTENTION_HOLDS[id(served)] == 1
        return id(served)

    key = pinned()
    gc.collect()
    assert key not in _ATTENTION_HOLDS


@pytest.mark.parametrize("values", ["int4", "table"])
def test_gluon_names_build_hoppers_four_bit_kernel_for_sm90(values):
    """Gluon's names (`compat.gluon`: TMA loads, barriers, warpgroup MMA) compile the 4-bit kernel for sm_90 here,
    without a GPU, into asynchronous warpgroup products."""
    pytest.importorskip("triton.experimental.gluon")
    from devmap.kernels.four_bit_products_kernel import INT4_DECODE_PTX, table_ptx
    from devmap.kernels.four_bit_products_wgmma import WgmmaShape, compile_sm90

    ptx = INT4_DECODE_PTX[torch.bfloat16] if values == "int4" else table_ptx(torch.bfloat16, tuple(range(-8, 8)))
    for shape, span, paired in ((WgmmaShape(64, 64, 4, 1), 128, False), (WgmmaShape(256, 128, 2, 2), 128, True),
                                (WgmmaShape(160, 128, 3, 1, 32), 128, False), (WgmmaShape(64, 64, 3, 1), 64, True)):
        kernel = compile_sm90(shape, span, torch.bfloat16, ptx, paired, zero=values == "int4")
        assert "wgmma.mma_async" in kernel.asm["ptx"] and "cp.async.bulk.tensor" in kernel.asm["ptx"]


def test_scipy_and_sklearn_are_hidden_from_transformers_modeling_code_imported_after():
    """In a fresh process (the engine core's order): hidden before transformers' modeling code is imported, neither
    scipy.optimize nor sklearn is imported by it, whether or not they are installed; once that code is imported,
    hiding changes nothing."""
    import subprocess
    import sys

    script = """
import sys
from devmap import compat
assert compat.hide_scipy_and_sklearn()
import transformers.modeling_utils, transformers.models.llama.modeling_llama
import transformers.loss.loss_for_object_detection as detection
import transformers.utils
assert not transformers.utils.is_scipy_available() and not transformers.utils.is_sklearn_available()
assert "scipy.optimize" not in sys.modules and "sklearn" not in sys.modules, sorted(sys.modules)
assert not hasattr(detection, "linear_sum_assignment")
assert not compat.hide_scipy_and_sklearn()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
