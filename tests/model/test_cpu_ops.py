"""The compiled layer ops (cpu_ops.c) against the torch ops transformers runs, every output bit:
RMSNorm with and without the fused residual add, rotary embedding in place, and bfloat16
SiLU-and-multiply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.model.layers import RMSNorm, RotaryEmbedding, cpu_ops
from pagellm.model.layers.cpu_ops import _LIBRARY

needs_kernel = pytest.mark.skipif(_LIBRARY.load() is None,
                                  reason="layer ops off here (see the report header)")


def require(op: str, dtype: torch.dtype) -> None:
    """Skip, saying so, where the load-time check found ``op`` not bit-identical to torch on
    this CPU: the layers then run the torch op (test_an_op_that_differs_is_not_used)."""
    if not cpu_ops.available(torch.empty(1, dtype=dtype), op):
        pytest.skip(f"compiled {op} for {dtype} is not bit-identical to torch on this CPU")


def norm_layer(n: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    layer = RMSNorm(n, eps=1e-5)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(n, generator=gen) * 0.4 + 0.8)
    return layer.to(dtype)


def activations(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different scales, as hidden states are (a few huge outlier channels)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * 2)
    x[:, :: max(1, n // 7)] *= 30
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [17, 64, 128, 768, 896, 1000, 2048, 4096, 5120])
def test_norm_is_bit_identical_to_the_torch_ops(dtype, n):
    require("rms_norm", dtype)
    layer = norm_layer(n, dtype, seed=n)
    for rows in (1, 3, 64):
        x = activations(rows, n, dtype, seed=rows + n)
        assert torch.equal(layer(x), layer._norm(x))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [64, 768, 4096])
def test_fused_residual_add_is_bit_identical(dtype, n):
    require("rms_norm", dtype)
    layer = norm_layer(n, dtype, seed=1)
    x = activations(9, n, dtype, seed=2)
    residual = activations(9, n, dtype, seed=3)
    expected_hidden = residual + x
    expected = layer._norm(expected_hidden)
    stream = residual.clone()
    out, hidden = layer(x, stream)
    assert hidden is stream  # updated in place, as the next layer reads it
    assert torch.equal(hidden, expected_hidden) and torch.equal(out, expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_in_place_is_bit_identical(dtype, head_dim):
    require("rotary", dtype)
    config = type("Config", (), {"max_position_embeddings": 4096, "rope_theta": 10000.0})()
    rope = RotaryEmbedding(head_dim, config)
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 37, 6, 2
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = rope(positions, dtype)  # [T, 1, D]
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, -1, head_dim)  # strided view
    expected = RotaryEmbedding.apply(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert RotaryEmbedding.rotates_in_place(qk)
    RotaryEmbedding.apply_(qk, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@needs_kernel
def test_silu_and_mul_is_bit_identical_for_every_bfloat16_gate():
    require("silu_and_mul", torch.bfloat16)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = every[torch.isfinite(every.float())]  # 65,280 values
    gen = torch.Generator().manual_seed(9)
    rows, n = 255, 256  # gate values spread over the rows; a [rows, 2 n] projection output
    gate_up = torch.empty(rows, 2 * n, dtype=torch.bfloat16)
    gate_up[:, :n] = gate.view(rows, n)
    gate_up[:, n:] = (torch.randn(rows, n, generator=gen) * 4).to(torch.bfloat16)
    g, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(cpu_ops.silu_and_mul(gate_up), F.silu(g) * up)
    few = gate_up[:3, :]  # a few rows, as in a small decode batch
    assert torch.equal(cpu_ops.silu_and_mul(few), F.silu(few[:, :n]) * few[:, n:])


def test_views_and_other_dtypes_take_the_torch_ops():
    layer = norm_layer(32, torch.bfloat16, seed=4)
    qkv = activations(6, 96, torch.bfloat16, seed=5)
    q = qkv[:, :64].view(6, 2, 32)  # per-head norm on a strided view (Qwen3's q_norm)
    assert torch.equal(layer(q), layer._norm(q))
    half = norm_layer(32, torch.float16, seed=6)
    x, residual = activations(4, 32, torch.float16, 7), activations(4, 32, torch.float16, 8)
    out, hidden = half(x, residual.clone())
    assert torch.equal(hidden, residual + x) and torch.equal(out, half._norm(residual + x))
    assert layer(torch.empty(0, 32, dtype=torch.bfloat16)).shape == (0, 32)
    assert not RotaryEmbedding.rotates_in_place(torch.empty(3, 2, 32, dtype=torch.float16))
    assert not RotaryEmbedding.rotates_in_place(q.transpose(1, 2))  # head_dim not contiguous


@needs_kernel
def test_an_op_that_differs_is_not_used(monkeypatch, caplog):
    """The load-time check disables, one by one, ops that do not reproduce torch's bits (as
    on a CPU whose torch SiLU or sum rounds otherwise), and the layers fall back."""
    monkeypatch.setattr(cpu_ops, "_silu_matches", lambda: False)
    fresh = cpu_ops._Library()
    monkeypatch.setattr(cpu_ops, "_LIBRARY", fresh)
    with caplog.at_level("INFO", logger="pagellm"):
        assert fresh.load() is not None
    assert ("silu_and_mul", torch.bfloat16) not in fresh.enabled
    assert ("rms_norm", torch.bfloat16) in fresh.enabled or fresh.lanes == 0
    assert "compiled silu_and_mul for torch.bfloat16 differs" in caplog.text
    gate_up = activations(4, 64, torch.bfloat16, seed=1)
    assert not cpu_ops.available(gate_up, "silu_and_mul")
    mlp_input = torch.randn(4, 64).bfloat16()
    from pagellm.model.decoder import DecoderMLP
    config = type("Config", (), {"hidden_act": "silu", "intermediate_size": 32,
                                 "hidden_size": 64})()
    spec = type("Spec", (), {"mlp_bias": False})()
    mlp = DecoderMLP(config, spec)
    for param in mlp.parameters():
        param.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    mlp = mlp.to(torch.bfloat16)
    gate, up = mlp.gate_up_proj(mlp_input).chunk(2, dim=-1)
    assert torch.equal(mlp(mlp_input), mlp.down_proj(F.silu(gate) * up))
