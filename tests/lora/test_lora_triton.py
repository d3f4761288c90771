"""The Triton LoRA kernels (lora/triton_ops.py) against the torch path (lora/ops.py), run on
CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are
defined), with tiles smaller than the shapes so that every loop and mask is crossed."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops defines its kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import assert_compiles  # noqa: E402

pytest.importorskip("triton")

from pagellm.lora.ops import LoRABatch, lora_reference, lora_torch  # noqa: E402
from pagellm.lora import triton_ops  # noqa: E402
from pagellm.lora.triton_ops import lora_triton  # noqa: E402

if not triton_ops.INTERPRETED:
    pytest.skip("triton_ops was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens, rows, in_features, out_features",
                         [(5, 24, 40, 72), (1, 8, 16, 16), (9, 48, 100, 30)])
def test_triton_matches_torch(dtype, tol, num_tokens, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows + num_tokens)
    a = torch.randn(3, rows, in_features, generator=gen).to(dtype)
    b = torch.randn(3, rows, out_features, generator=gen).to(dtype)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    slots = torch.randint(-1, 3, (num_tokens,), generator=gen)
    slots[0] = 2
    expected = lora_torch(y.clone(), x, a, b, LoRABatch.build(slots.tolist(), 'cpu'))
    got = lora_triton(y.clone(), x, a, b, slots, block_r=8, block_k=16, block_n=16)
    exact = lora_reference(y, x, a, b, slots)
    scale = exact.abs().max().item()
    # both within the dtype's rounding of the float64 definition
    assert (got.double() - exact).abs().max().item() <= tol * scale
    assert (expected.double() - exact).abs().max().item() <= tol * scale
    untouched = slots < 0
    assert torch.equal(got[untouched], y[untouched])


def test_engine_with_triton_lora_layers_matches_peft(lora_zoo, greedy_reference):
    """The whole model with its LoRA layers on the kernels (as on a GPU): a mixed batch gives
    transformers + peft's greedy tokens."""
    from pagellm import LLM, LoRARequest, SamplingParams
    from helpers import random_prompts
    from lora_adapters import ADAPTERS, MAX_LORA_RANK

    base, adapters = lora_zoo
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=MAX_LORA_RANK, num_gpu_blocks_override=32, max_model_len=128,
              swap_space=0.01)
    llm.llm_engine.worker.lora_manager.state.use_triton = True
    prompts = random_prompts([6, 11, 4], seed=8)
    names = ["all-r4", None, "mlp-r16-patterns"]
    requests = [None if n is None else LoRARequest(n, ADAPTERS[n][0], str(adapters[n]))
                for n in names]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           lora_request=requests, use_tqdm=False)
    for prompt, name, output in zip(prompts, names, outputs):
        assert list(output.outputs[0].token_ids) == greedy_reference(name, prompt, 6), name


# Compiles both kernels for an H100/H200 (sm_90) as a launch would, without a GPU: Triton's
# frontend and ptxas check what the interpreter lets through. Runs where TRITON_INTERPRET is
# unset.
COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from pagellm.lora import triton_ops

try:
    get_ptxas(90).path
except Exception as error:
    raise SystemExit(f"SKIP: no ptxas ({error})")

def compile_kernel(fn, pointers, constexprs):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    triton.compile(ASTSource(fn, signature, constexprs, attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

for dtype in ("bf16", "fp16", "fp32"):
    compile_kernel(triton_ops._shrink_kernel, dict(x_ptr="*" + dtype, a_ptr="*" + dtype,
                   out_ptr="*fp32", slots_ptr="*i32"), dict(BLOCK_R=16, BLOCK_K=64))
    compile_kernel(triton_ops._expand_kernel, dict(shrunk_ptr="*fp32", b_ptr="*" + dtype,
                   y_ptr="*" + dtype, slots_ptr="*i32"), dict(BLOCK_R=16, BLOCK_N=64))
print("compiled")
"""


def test_kernels_compile_for_sm90():
    assert_compiles(COMPILE_FOR_SM90)
