"""Projections packed for oneDNN on the CPU (Linear.pack) against plain F.linear, and how
load_model uses them (plain weights released, a tied lm_head kept for the embedding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tiny_model

from pagellm.model import load_model
from pagellm.model.layers import Linear, MergedLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN")


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs this dtype here: bfloat16 needs its bfloat16 path (AVX-512BW/VL/DQ
    or AVX-NE-CONVERT); on an AVX2-only CPU those layers stay on F.linear."""
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


# the model dtype of the loading tests: bfloat16 where it packs, else float32
PACKED_DTYPE = torch.bfloat16 if packs(torch.bfloat16) else torch.float32


def linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool) -> Linear:
    gen = torch.Generator().manual_seed(in_features * out_features)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer.to(dtype)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (768, 1280), (2048, 768), (40, 17)])
def test_packed_linear_matches_f_linear(dtype, bias, shape):
    layer = linear(*shape, dtype, bias)
    weight = layer.weight.detach().clone()
    assert layer.pack() == packs(dtype)
    if packs(dtype):
        assert layer.weight.numel() == 0  # the plain copy is released
    else:  # the probe failed: F.linear on the plain weight, which is kept
        assert layer.packed_weight is None and layer.pack_failure
        torch.testing.assert_close(layer.weight, weight, atol=0, rtol=0)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 64, 129):
        x = torch.randn(rows, shape[0], generator=gen).to(dtype)
        expected = F.linear(x, weight, layer.bias)
        got = layer(x)
        assert got.shape == expected.shape and got.dtype == dtype
        if dtype == torch.bfloat16:  # same oneDNN kernel as torch's bfloat16 matmul here
            torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
        else:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    strided = torch.randn(5, shape[0] + 7, generator=gen).to(dtype)[:, :shape[0]]
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, layer.bias),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_without_onednn_bfloat16_runs_in_float32(monkeypatch, caplog, bias, kernel):
    """Where oneDNN has no bfloat16 path (AVX2-only CPUs; forced here), a bfloat16 layer stays
    unpacked. Below quant_matmul.GEMM_ROWS rows it runs the compiled bfloat16 kernel (the
    weight widened in registers), from there in float32 with the weight converted a chunk of
    rows at a time (here 128 rows: 3 chunks); both round float32 sums (bias included) once:
    the float32 matmul of the bfloat16 values up to the order of the float32 sums. Without the
    compiled kernels, fewer than 4 rows stay on the bfloat16 F.linear."""
    from pagellm.model.layers import linear as linear_module
    from pagellm.model.layers import quant_matmul

    monkeypatch.setattr(linear_module, "onednn_has_bfloat16", lambda: False)
    if not kernel:
        monkeypatch.setattr(quant_matmul, "available", lambda: False)
    elif not quant_matmul.available():
        pytest.skip(f"the compiled kernels are off here ({quant_matmul.describe()})")
    layer = linear(2048, 300, torch.bfloat16, bias)
    assert not layer.pack() and layer.upcast and "bfloat16" in layer.pack_failure
    assert (layer.bf16_kernel is not None) == kernel
    weight = layer.weight
    bias_f = None if layer.bias is None else layer.bias.float()
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 4, 9, quant_matmul.GEMM_ROWS + 1):
        if rows < 4 and not kernel:
            continue
        x = torch.randn(rows, 2048, generator=gen).bfloat16()
        exact = F.linear(x.double(), weight.double(),
                         None if bias_f is None else bias_f.double())
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
        # one rounding to bfloat16 of a float32 sum: within a bfloat16 step of the exact value
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=1e-4)
        torch.testing.assert_close(got, F.linear(x.float(), weight.float(), bias_f).bfloat16(),
                                   rtol=2 ** -7, atol=1e-4)
    if kernel:  # a bias other than the layer's (a tensor-parallel shard adds its own later)
        x = torch.randn(2, 2048, generator=gen).bfloat16()
        torch.testing.assert_close(layer.matmul(x, None).double(),
                                   F.linear(x.double(), weight.double()), rtol=2 ** -7,
                                   atol=1e-4)
    else:
        few = torch.randn(3, 2048, generator=gen).bfloat16()
        assert torch.equal(layer(few), F.linear(few, weight, layer.bias))
    # at load: said once at INFO (expected on such CPUs), no warning
    with caplog.at_level("INFO", logger="pagellm"):
        linear_module.pack_linear_weights(torch.nn.Sequential(linear(64, 32, torch.bfloat16,
                                                                     bias)))
    assert caplog.text.count("stay unpacked") == 1
    assert all(record.levelname == "INFO" for record in caplog.records)


def test_layers_that_cannot_be_packed_stay_plain():
    half = linear(32, 16, torch.float16, bias=False)
    packed = half.pack()  # float16 is packed nowhere: torch's CPU matmul handles it
    assert not packed and half.packed_weight is None and half.weight.shape == (16, 32)
    x = torch.randn(2, 32).half()
    torch.testing.assert_close(half(x), F.linear(x, half.weight))
    meta = Linear(8, 8).to("meta")
    assert not meta.pack() and meta.weight.shape == (8, 8)


@needs_onednn
def test_merged_layer_packs_after_its_shards_load():
    layer = MergedLinear(16, [8, 8]).to(PACKED_DTYPE)
    gate, up = torch.randn(8, 16).to(PACKED_DTYPE), torch.randn(8, 16).to(PACKED_DTYPE)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    assert layer.pack(keep_weight=True)
    assert layer.weight.shape == (16, 16)  # kept
    x = torch.randn(4, 16).to(PACKED_DTYPE)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([gate, up])), atol=1e-2,
                               rtol=1e-2)


@needs_onednn
@pytest.mark.parametrize("architecture, tied", [("LlamaForCausalLM", False),
                                                ("Qwen2ForCausalLM", True)])
def test_load_model_packs_on_the_cpu(tmp_path, architecture, tied):
    path = make_tiny_model(tmp_path, architecture, seed=3, tie_word_embeddings=tied)
    model, _ = load_model(path, dtype=PACKED_DTYPE)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert model.tie_word_embeddings == tied
    for m in linears:
        kept = m is model.lm_head and tied  # the embedding reads the tied weight
        assert (m.weight.numel() > 0) == kept
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    plain, _ = load_model(path, dtype=PACKED_DTYPE, pack_weights=False)
    assert all(m.packed_weight is None for m in plain.modules() if isinstance(m, Linear))
    tokens = torch.tensor([1, 5, 9])
    hidden = model.model.embed_tokens(tokens)
    # bit-identical on the AVX-512 CPUs measured; oneDNN may sum in another order elsewhere
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden),
                               atol=2e-2, rtol=2e-2)


@needs_onednn
@pytest.mark.parametrize("failure", ["reorder", "call", "wrong_result"])
def test_a_failing_private_op_leaves_the_model_on_f_linear(tmp_path, monkeypatch, caplog,
                                                           failure):
    """Packing rests on torch's private mkldnn ops: if one is missing, raises, or computes
    something else (another torch build), load_model keeps F.linear, says so once, and the
    model's outputs are those of the unpacked model."""
    from pagellm.model.layers import linear as linear_module

    def broken(*args):
        raise RuntimeError("no such op in this torch build")

    if failure == "reorder":
        monkeypatch.setattr(linear_module, "_reorder_weight", broken)
    elif failure == "call":
        monkeypatch.setattr(linear_module, "_packed_linear", broken)
    else:
        real = linear_module._packed_linear
        monkeypatch.setattr(linear_module, "_packed_linear",
                            lambda x, packed, bias: real(x, packed, bias) * 1.5)
    path = make_tiny_model(tmp_path, "LlamaForCausalLM", seed=4)
    with caplog.at_level("WARNING", logger="pagellm"):
        model, _ = load_model(path, dtype=torch.float32)
    assert all(m.packed_weight is None and m.weight.numel() > 0
               for m in model.modules() if isinstance(m, Linear))
    assert caplog.text.count("linear layers stay unpacked (F.linear runs)") == 1
    plain, _ = load_model(path, dtype=torch.float32, pack_weights=False)
    hidden = model.model.embed_tokens(torch.tensor([1, 5, 9]))
    assert torch.equal(model.compute_logits(hidden), plain.compute_logits(hidden))
