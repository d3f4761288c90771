"""The CPU decode plan (worker/cpu_decode.py): the layers' kernels called in a row give the
eager forward's results bit for bit, and every step it does not serve runs the forward.

The quantized layers are made to take the compiled matmuls, or torch's kernels, on every CPU
(each CPU's own choice is one of the two: torch's on AVX-512 CPUs); the plan needs the
compiled layer ops, which a CPU may have turned off (they must match torch bit for bit there):
then the tests check that the engine says so and runs eagerly.
"""
from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompts

from pagellm import LLM, SamplingParams
from pagellm.model.layers import quant_matmul
from pagellm.native import CallChain, PreparedCall
from pagellm.worker.cpu_decode import CpuDecodePlan


@pytest.fixture
def compiled_matmuls(monkeypatch):
    if not quant_matmul.available():
        pytest.skip("the compiled matmul kernels are off here")
    monkeypatch.setattr(quant_matmul, "preferred", quant_matmul.available)


@pytest.fixture
def torch_matmuls(monkeypatch):
    """The int4 and per-channel int8 layers on torch's weight-only kernels, as on AVX-512
    CPUs (group-wise int8 keeps the compiled kernel wherever it is built)."""
    monkeypatch.setattr(quant_matmul, "preferred", lambda: False)


def engine(llama_dir, **options) -> LLM:
    """No prefix caching: each run of the same prompts then computes them from scratch (a
    prefill of a cached prefix's tail rounds differently from the whole prompt's)."""
    return LLM(str(llama_dir), max_model_len=96, block_size=4, kv_cache_memory_bytes=1 << 20,
               max_num_seqs=12, enable_prefix_caching=False, **{"dtype": "bfloat16", **options})


def eager_twin(model_dir, **options) -> LLM:
    """The same engine without the plan. The tests run the same requests in the same order
    on both, so that both place the K/V in the same blocks: the attention sums a sequence's
    blocks in the order of their places, and a second run of one engine, whose blocks were
    freed in another order, may differ from its first in the last bits (float32 keeps them,
    bfloat16 mostly rounds them away)."""
    return engine(model_dir, enforce_eager=True, **options)


def plan_or_skip(llm: LLM) -> CpuDecodePlan:
    runner = llm.llm_engine.runner
    why_not = CpuDecodePlan.supports(runner.model, runner.cache_engine.kv_caches)
    if why_not is not None:
        assert runner.cpu_decode is None
        pytest.skip(f"no CPU decode plan here: {why_not}")
    assert runner.cpu_decode is not None
    return runner.cpu_decode


def plan_calls(plan: CpuDecodePlan, rows: int) -> list:
    """The plan's calls for ``rows`` sequences, those it chains (native.CallChain) one by
    one."""
    return [call for item in plan._plans[rows][0]
            for call in (item.calls if isinstance(item, CallChain) else [item])]


def generate(llm: LLM, prompts, plan: CpuDecodePlan | None, calls: list[int]):
    """Greedy tokens and their top-5 logprobs, with or without the plan; counts the steps
    the plan served into ``calls``."""
    runner = llm.llm_engine.runner
    if plan is not None:
        run = plan.run

        def counted(input_ids, metadata):
            hidden = run(input_ids, metadata)
            calls.append(hidden is not None)
            return hidden

        plan.run = counted
    runner.cpu_decode = plan
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        if plan is not None:
            del plan.run
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("options", [
    dict(quantization="int4", quantization_group_size=32),
    dict(quantization="int4", quantization_group_size=32, int8_activations=True),
    dict(quantization="int8"),
    pytest.param(dict(quantization="int8", int8_activations=True), marks=pytest.mark.skipif(
        not quant_matmul.has_vnni_loops(), reason="int8 layers take int8 activations only "
                                                   "with the AVX512-VNNI loops"))])
def test_plan_gives_the_forward_s_tokens_and_logprobs_exactly(llama_dir, compiled_matmuls,
                                                               options):
    """1, 3 and 12 sequences decoding together (12: with int8 activations the products round
    the rows and run the float loops; prefill steps run the forward): the same tokens and the
    same logprobs, bit for bit, as the engine without the plan."""
    llm, eager = engine(llama_dir, **options), eager_twin(llama_dir, **options)
    plan = plan_or_skip(llm)
    assert plan.max_rows == 12
    prompts = [{"prompt_token_ids": p} for p in make_prompts(12, [5, 9, 3, 14], seed=3)]
    served: list[int] = []
    for count in (1, 3, 12):
        with_plan = generate(llm, prompts[:count], plan, served)
        assert with_plan == generate(eager, prompts[:count], None, [])
    assert sum(served) > 0 and not all(served)  # the prefill steps ran the forward
    # the compiled calls in a row are made by one C loop (native.chain_calls)
    assert any(isinstance(item, CallChain) for item in plan._plans[1][0])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_plan_on_an_8_bit_kv_cache(llama_dir, compiled_matmuls, kv_cache_dtype):
    """An 8-bit KV cache: the step's K/V quantized and stored by the layer's own store, then
    the compiled 8-bit decode kernel; the forward's tokens and logprobs bit for bit, with
    int4 weights and with the model dtype's."""
    for options in (dict(quantization="int4", quantization_group_size=32), dict()):
        options["kv_cache_dtype"] = kv_cache_dtype
        llm, eager = engine(llama_dir, **options), eager_twin(llama_dir, **options)
        plan = plan_or_skip(llm)
        prompts = [{"prompt_token_ids": p} for p in make_prompts(5, [5, 9, 3], seed=8)]
        served: list[int] = []
        for count in (1, 5):
            assert generate(llm, prompts[:count], plan, served) == generate(
                eager, prompts[:count], None, [])
        assert any(served)


@pytest.mark.parametrize("options", [dict(quantization="int4", quantization_group_size=32),
                                     dict(quantization="int8", kv_cache_dtype="int8"),
                                     dict()])
def test_steps_past_the_kernels_rows_take_the_gemm_inside_the_plan(llama_dir, compiled_matmuls,
                                                                    monkeypatch, options):
    """From GEMM_ROWS sequences on (4 here; 32 as shipped) the products are the forward's
    float32 GEMMs, run inside the plan beside its prepared norms, rotary and attention: the
    plan serves those steps too, with the forward's tokens and logprobs bit for bit."""
    monkeypatch.setattr(quant_matmul, "GEMM_ROWS", 4)
    llm, eager = engine(llama_dir, **options), eager_twin(llama_dir, **options)
    plan = plan_or_skip(llm)
    assert plan.max_rows == 12
    prompts = [{"prompt_token_ids": p} for p in make_prompts(12, [5, 9, 3, 14], seed=9)]
    served: list[int] = []
    for count in (3, 12):
        assert generate(llm, prompts[:count], plan, served) == generate(
            eager, prompts[:count], None, [])
    assert 12 in plan._plans and 3 in plan._plans  # both sides of GEMM_ROWS were served


def with_zeros_in_groups_of_16(llm: LLM) -> CpuDecodePlan:
    """Every int8 layer of the engine's model as int8 codes with a scale and a zero per
    group of 16 (the form of GGUF's Q2_K blocks: the most group sums per row, the widest
    workspace), w = q * scale - 3 * scale; the plan built again on the new layers."""
    from pagellm.model.layers.quantized_linear import Int8Weight

    runner = llm.llm_engine.runner
    for module in runner.model.modules():
        layer = getattr(module, "quantized", None)
        if isinstance(layer, Int8Weight):
            scale = layer.scale.float()[:, None].repeat(1, layer.q.shape[1] // 16)
            module.quantized = Int8Weight(layer.q, scale.contiguous(), 16, -3 * scale)
    return CpuDecodePlan(runner.model, runner.cache_engine.kv_caches, 12)


def test_plan_on_int8_with_zeros(llama_dir, compiled_matmuls):
    """int8 layers with zeros (GGUF's blocks with a min) run their compiled kernel in the
    plan: the forward's tokens and logprobs bit for bit."""
    llm, eager = engine(llama_dir, quantization="int8"), eager_twin(llama_dir,
                                                                    quantization="int8")
    plan_or_skip(llm)
    plan = with_zeros_in_groups_of_16(llm)
    with_zeros_in_groups_of_16(eager)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(5, [5, 9, 3], seed=7)]
    served: list[int] = []
    for count in (1, 5):
        assert generate(llm, prompts[:count], plan, served) == generate(eager, prompts[:count],
                                                                        None, [])
    assert any(served)


@pytest.mark.parametrize("options", [dict(quantization="int4", quantization_group_size=32),
                                     dict(quantization="int8")])
def test_plan_on_torch_s_kernels(llama_dir, torch_matmuls, options):
    """Projections on torch's int4/int8 kernels are those kernels' calls with their
    arguments bound (torch_product) inside the plan, the rest of the step prepared: still the
    forward's tokens and logprobs bit for bit. (With int8 activations the int4 layers take
    the compiled kernels wherever they are built.)"""
    llm, eager = engine(llama_dir, **options), eager_twin(llama_dir, **options)
    plan = plan_or_skip(llm)
    model = llm.llm_engine.runner.model
    assert not any(getattr(m, "compiled", True) for m in model.modules()
                   if type(m).__name__ in ("Int4Weight", "Int8Weight"))
    layers = [m for m in model.model.modules() if type(m).__name__ in ("Int4Weight",
                                                                       "Int8Weight")]
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert layers and all(layer.torch_product(x) is not None for layer in layers)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(5, [5, 9, 3], seed=5)]
    served: list[int] = []
    for count in (1, 5):
        assert generate(llm, prompts[:count], plan, served) == generate(eager, prompts[:count],
                                                                        None, [])
    assert any(served)


@pytest.mark.parametrize("options", [dict(quantization="int4", quantization_group_size=32),
                                     dict(quantization="int8")])
@pytest.mark.parametrize("matmuls", ["torch_matmuls", "compiled_matmuls"])
def test_plan_runs_the_dot_products_in_its_workspace(llama_dir, request, monkeypatch,
                                                      matmuls, options):
    """Where the AVX512-BF16 products take a step's rows (from 4 here, 1-16 as shipped),
    on torch's kernels' layers as on the compiled ones, every projection of the step is
    their prepared call in the plan's workspace, grown for max_rows: the forward's tokens and
    logprobs bit for bit; below that the calls of before."""
    if not quant_matmul.has_dot_products():
        pytest.skip("the AVX512-BF16 products are built for CPUs with AVX512-BF16 only")
    request.getfixturevalue(matmuls)
    for name in ("DOT_ROWS", "FEW_DOT_ROWS", "FEW_LOOP_DOT_ROWS"):  # 12 rows: the few-rows
        monkeypatch.setattr(quant_matmul, name, 4)                   # kernel, 3: none
    llm, eager = engine(llama_dir, **options), eager_twin(llama_dir, **options)
    plan = plan_or_skip(llm)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(12, [5, 9, 3, 14], seed=4)]
    served: list[int] = []
    for count in (3, 12):
        assert generate(llm, prompts[:count], plan, served) == generate(
            eager, prompts[:count], None, [])
    assert any(served)

    def dot_calls(rows):
        return [c for c in plan_calls(plan, rows) if isinstance(c, PreparedCall)
                and c.function.__name__.endswith("_dot_gemm")]

    layers = llm.llm_engine.runner.model.model.layers
    assert len(dot_calls(12)) == 4 * len(layers) and not dot_calls(3)
    assert all(c.args.workspace == plan.workspace.data_ptr() for c in dot_calls(12))
    assert plan.workspace.numel() >= plan._dot_workspace_floats() > 0


@pytest.mark.parametrize("options", [dict(), dict(quantization="int4",
                                                  quantization_group_size=32)])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen2_biases_and_qwen3_head_norms(model_factory, compiled_matmuls, arch, options):
    """Qwen2's q/k/v biases: added after a quantized product (as the layer adds them), or
    summed by the bfloat16 layer's own kernel through its forward. Qwen3's q/k RMSNorm over
    each head (head_dim 24 here) before rotary, through the norm modules as in the forward."""
    llm = engine(model_factory(arch), **options)
    eager = eager_twin(model_factory(arch), **options)
    plan = plan_or_skip(llm)
    attn = llm.llm_engine.runner.model.model.layers[0].self_attn
    assert attn.qk_norm if arch == "Qwen3ForCausalLM" else attn.qkv_proj.bias is not None
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, [7, 4], seed=6)]
    served: list[int] = []
    assert generate(llm, prompts, plan, served) == generate(eager, prompts, None, [])
    assert any(served)


def test_qwen2_biases_after_torch_s_kernels(model_factory, torch_matmuls):
    """Qwen2's q/k/v biases added in place after torch's int4 kernel's bound call, as the
    layer adds them after its product: the forward's tokens and logprobs bit for bit."""
    llm = engine(model_factory("Qwen2ForCausalLM"), quantization="int4",
                 quantization_group_size=32)
    eager = eager_twin(model_factory("Qwen2ForCausalLM"), quantization="int4",
                       quantization_group_size=32)
    plan = plan_or_skip(llm)
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    x = torch.zeros(1, qkv.in_features, dtype=torch.bfloat16)
    assert qkv.bias is not None and qkv.quantized.torch_product(x) is not None
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, [7, 4], seed=6)]
    served: list[int] = []
    assert generate(llm, prompts, plan, served) == generate(eager, prompts, None, [])
    assert any(served)


def test_bfloat16_weights_and_thread_counts(llama_dir):
    """Unquantized bfloat16 projections (the compiled bfloat16 kernel on CPUs without
    oneDNN's bfloat16 path, oneDNN's packed weights elsewhere), with one and two torch
    threads: a changed thread count rebuilds the calls (their thread counts and scratch)."""
    llm, eager = engine(llama_dir), eager_twin(llama_dir)
    plan = plan_or_skip(llm)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, [6, 11], seed=4)]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            served: list[int] = []
            assert generate(llm, prompts, plan, served) == generate(eager, prompts, None, [])
            assert any(served) and plan.threads == count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("options", [dict(), dict(quantization="int4",
                                                  quantization_group_size=32)])
def test_float32_models(llama_dir, compiled_matmuls, options):
    """float32: oneDNN's packed projections (or int4 products on float32 activations),
    the compiled float32 norms, rotary and attention, torch's SiLU-and-multiply."""
    options = {**options, "dtype": "float32"}
    llm = engine(llama_dir, **options)
    plan = plan_or_skip(llm)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, [6, 10], seed=7)]
    served: list[int] = []
    eager = eager_twin(llama_dir, **options)
    assert generate(llm, prompts, plan, served) == generate(eager, prompts, None, [])
    assert any(served)


def test_plan_off_where_it_does_not_apply(llama_dir, compiled_matmuls):
    """enforce_eager, float16 models and a float16 KV cache beside a bfloat16 model run
    every step through the forward, and the reason is known."""
    assert engine(llama_dir, quantization="int4", quantization_group_size=32,
                  enforce_eager=True).llm_engine.runner.cpu_decode is None
    llm = LLM(str(llama_dir), max_model_len=64, kv_cache_memory_bytes=1 << 20,
              dtype="float16")
    runner = llm.llm_engine.runner
    assert runner.cpu_decode is None
    assert "bfloat16 and float32 models" in CpuDecodePlan.supports(
        runner.model, runner.cache_engine.kv_caches)
    bfloat16 = engine(llama_dir).llm_engine.runner
    caches = [(k.half(), v.half()) for k, v in bfloat16.cache_engine.kv_caches]
    assert "KV cache of the model dtype, or an 8-bit one" in CpuDecodePlan.supports(
        bfloat16.model, caches)
