"""Weight-only int8 / int4 linear layers (model/layers/quantized_linear.py) against a float64
matmul of their dequantized weights; quantize-on-load of a safetensors model; GGUF Q4_0 /
Q4_1 blocks mapped into int4 with the file's values exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.model.layers import quant_matmul
from pagellm.model.layers.quantized_linear import Int4Weight, Int8Weight
from pagellm.model.quantized_model import check_supported
from pagellm.model.loader import load_model


def weight_and_input(out_features, in_features, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.3).to(dtype)
    x = torch.randn(5, in_features, generator=gen).to(dtype)
    return weight, x


def tolerance(dtype, expected):
    scale = expected.abs().max().item()
    return 1e-5 * scale if dtype == torch.float32 else 1e-2 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, group_size", [("int8", None), ("int4", 32), ("int4", 128)])
def test_quantized_matmul_matches_dequantized_reference(kind, group_size, dtype):
    weight, x = weight_and_input(96, 256, dtype)
    layer = Int8Weight.quantize(weight) if kind == "int8" else Int4Weight.quantize(weight,
                                                                                   group_size)
    deq = layer.dequantized().double()
    out = layer(x)
    expected = x.double() @ deq.T
    assert out.dtype == dtype and out.shape == (5, 96)
    assert (out.double() - expected).abs().max().item() <= tolerance(dtype, expected)
    # the quantization itself: within half a step of each weight
    steps = (deq - weight.double()).abs()
    if kind == "int8":
        assert (steps <= layer.scale.double()[:, None] * 0.5 + 1e-6).all()
    else:
        scale = layer.scale_and_zero.double()[..., 0].repeat_interleave(group_size, 1)
        assert (steps <= scale * 0.5 + 1e-2 * scale + 1e-6).all()
    assert layer.nbytes < weight.nbytes


def test_bad_group_size_and_device_name_the_supported():
    weight, _ = weight_and_input(8, 96, torch.float32)
    with pytest.raises(ValueError, match="group_size=64 .* in_features=96"):
        Int4Weight.quantize(weight, 64)
    with pytest.raises(ValueError, match="CPU only"):
        check_supported("int4", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="'int2' is not supported; supported: int8, int4"):
        check_supported("int2", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        check_supported("int8", torch.device("cpu"), torch.float16)


def test_unset_group_size_takes_the_largest_that_divides_every_input_width(model_zoo):
    """quantization_group_size unset: 128, else 64 or 32, whichever divides every projection's
    input width (the tiny Llama's 64 and 128: 64); 32 for a GGUF file; a width no group
    divides is refused, and so is a given group that does not divide a width, naming the
    ones that would."""
    from pagellm.model.layers.linear import Linear
    from pagellm.model.quantized_model import default_group_size

    llama_dir, _ = model_zoo("llama")
    model, _ = load_model(llama_dir, dtype=torch.float32, quantization="int4")
    int4 = [m.quantized for m in model.modules()
            if isinstance(m, Linear) and isinstance(m.quantized, Int4Weight)]
    assert int4 and {layer.group_size for layer in int4} == {64}
    with pytest.raises(ValueError, match=r"group_size=128 .* in_features=64; 32, 64 would"):
        load_model(llama_dir, dtype=torch.float32, quantization="int4",
                   quantization_group_size=128)

    def layers(*widths: int) -> torch.nn.Module:
        return torch.nn.ModuleList(Linear(width, 8) for width in widths)

    assert default_group_size(layers(768, 2048), from_gguf=False) == 128
    assert default_group_size(layers(576, 1536), from_gguf=False) == 64  # SmolLM2-135M
    assert default_group_size(layers(96), from_gguf=False) == 32
    assert default_group_size(layers(576), from_gguf=True) == 32
    with pytest.raises(ValueError, match=r"multiples of 32; this model's are \[80, 256\]"):
        default_group_size(layers(256, 80), from_gguf=False)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_on_load_of_a_safetensors_model(model_zoo, method):
    """Every projection quantized, the model's logits those of the plain model whose
    projections compute with the dequantized weights."""
    llama_dir, _ = model_zoo("llama")
    plain, _ = load_model(llama_dir, dtype=torch.float32, pack_weights=False)
    quantized, config = load_model(llama_dir, dtype=torch.float32, quantization=method,
                                   quantization_group_size=32)
    from pagellm.model.layers.linear import Linear
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, Linear)}
    assert layers and all(m.quantized is not None for m in layers.values())
    expected_kind = {"int8": Int8Weight, "int4": Int4Weight}[method]
    assert isinstance(layers["model.layers.0.mlp.down_proj"].quantized, expected_kind)
    assert isinstance(layers["lm_head"].quantized, Int8Weight)  # logits stay at 8 bits
    plain_layers = dict(plain.named_modules())
    for name, module in layers.items():
        plain_layers[name].weight.data = module.quantized.dequantized().to(torch.float32)
    hidden = torch.randn(4, config.hidden_size, generator=torch.Generator().manual_seed(3))
    for name in ("model.layers.1.self_attn.qkv_proj", "lm_head"):
        torch.testing.assert_close(layers[name](hidden), plain_layers[name](hidden),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_int4_blocks_map_exactly(type_name):
    """Q4_0 / Q4_1 blocks read as int4 codes, scales and zeros give the gguf package's own
    dequantization exactly."""
    gguf = pytest.importorskip("gguf")
    from pagellm.model.gguf_codes import int4_codes

    rng = np.random.default_rng(0)
    rows, cols = 16, 64
    block_bytes = {"Q4_0": 18, "Q4_1": 20}[type_name]
    blocks = rng.integers(0, 256, (rows * cols // 32, block_bytes), dtype=np.uint8)
    blocks[:, 0:2] = (rng.random(len(blocks)) * 0.1).astype(np.float16).view(np.uint8
                                                                            ).reshape(-1, 2)
    if type_name == "Q4_1":
        blocks[:, 2:4] = (rng.random(len(blocks)) - 0.5).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    data = blocks.reshape(rows, -1)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    expected = gguf.quants.dequantize(data, qtype).reshape(rows, cols)

    class Tensor:  # the two fields of a gguf reader tensor that int4_codes reads
        tensor_type = qtype
        shape = np.array([cols, rows])

    Tensor.data = data
    codes, scale, zero = int4_codes(Tensor)
    layer = Int4Weight(codes, scale, zero, 32, torch.float32)
    np.testing.assert_array_equal(layer.dequantized().numpy(), expected)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_int8_activations_engine_matches_its_definition(model_zoo, method):
    """int8_activations: the greedy tokens of an engine whose int4 projections (with
    quantization="int4") or int8 ones (with "int8"; and with AVX512-VNNI, the int8
    vocabulary projection of either) multiply their dequantized weight by the activations as
    quantize_activations rounds them (float32), over prompts whose prefill takes both the
    compiled small-row products and the GEMM path (32 rows), and a decode batch of 3.
    quantization="int8" without the VNNI loops, where no layer takes them, is refused, as is
    the switch without quantization."""
    import torch.nn.functional as F

    from pagellm import LLM, SamplingParams
    from pagellm.model.layers.quant_matmul import GEMM_ROWS, quantize_activations

    llama_dir, _ = model_zoo("llama")
    common = dict(dtype="float32", quantization=method, max_model_len=96,
                  kv_cache_memory_bytes=1 << 20)
    if method == "int4":
        common["quantization_group_size"] = 32
    vnni = quant_matmul.has_vnni_loops()
    if method == "int8" and not vnni:
        with pytest.raises(ValueError, match="no layer of this model takes int8 activations "
                                             "here: int4 layers take them on every build"):
            LLM(str(llama_dir), int8_activations=True, **common)
        return
    fast = LLM(str(llama_dir), int8_activations=True, **common)
    reference = LLM(str(llama_dir), enforce_eager=True, **common)  # runs the forward below
    from pagellm.worker.execution_paths import describe_paths

    def rounding(llm):  # the int4 layers, and the int8 ones (per row) where VNNI
        return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Int4Weight)
                or (vnni and isinstance(m, Int8Weight) and m.takes_int8_activations)]

    layers = rounding(fast)
    assert any(isinstance(m, Int8Weight) for m in layers) == vnni
    assert any(isinstance(m, Int4Weight) for m in layers) == (method == "int4")
    assert layers and all(m.int8_activations for m in layers)
    assert (f"(int8 activations for {len(layers)} of them)"
            in describe_paths(fast.llm_engine.runner.model)["matmul"])
    layers = rounding(reference)
    assert layers and not any(m.int8_activations for m in layers)
    for layer in layers:
        layer.forward = (lambda x, w=layer.dequantized():
                         F.linear(quantize_activations(x), w).to(x.dtype))
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()}
               for n in (5, GEMM_ROWS + 8, 11)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy,
                                                                  use_tqdm=False)]
              for llm in (fast, reference)]
    assert tokens[0] == tokens[1]
    with pytest.raises(ValueError, match="int8_activations=True is invalid: needs "
                                         "quantization='int4', 'int8' or 'gguf' "
                                         "\\(got None\\)"):
        LLM(str(llama_dir), int8_activations=True)


@pytest.mark.parametrize("vnni", [False, True])
def test_use_int8_activations_refuses_a_model_none_of_whose_layers_take_them(vnni,
                                                                            monkeypatch):
    """Per-row int8 layers (quantization="int8") take int8 activations where the build has
    the VNNI loops; elsewhere a model of only those is refused, naming the build, and
    nothing changes. A zero-point int8 layer never takes them."""
    from pagellm.model.quantized_model import use_int8_activations

    if not quant_matmul.available() or (vnni and not quant_matmul.has_vnni_loops()):
        pytest.skip(f"no such loops here ({quant_matmul.describe()})")
    monkeypatch.setattr(quant_matmul, "has_vnni_loops", lambda: vnni)
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*(Int8Weight.quantize(torch.randn(48, 64, generator=gen))
                                  for _ in range(2)))
    model.append(Int8Weight(torch.ones(48, 64, dtype=torch.int8), torch.ones(48, 2), 32,
                            torch.zeros(48, 2)))
    if not vnni:
        with pytest.raises(ValueError, match=r"symmetric int8 layers \(2 in this model\) "
                                             r"only where the build has the AVX512-VNNI"):
            use_int8_activations(model)
        assert not any(m.int8_activations for m in model)
        return
    assert use_int8_activations(model) == 2
    assert [m.int8_activations for m in model] == [True, True, False]


@pytest.mark.parametrize("zeros", [False, True])
def test_tied_embedding_reads_the_head_s_codes_only_where_they_are_its_weight(zeros):
    """share_codes: an embedding whose weight is its tied head's int8 codes dequantized (as a
    GGUF file's Q8_0 embedding loads) looks its rows up in the codes, bit for bit, and drops
    the weight; codes quantized from the weight (not equal to it) leave it as it was."""
    from pagellm.model.layers.parallel import VocabParallelEmbedding

    gen = torch.Generator().manual_seed(3)
    vocab, hidden = 70, 64
    q = torch.randint(-127, 128, (vocab, hidden), generator=gen, dtype=torch.int8)
    scale = torch.rand(vocab, hidden // 32, generator=gen) / 50
    zero = torch.randn(vocab, hidden // 32, generator=gen) / 10 if zeros else None
    codes = Int8Weight(q, scale, 32, zero)
    ids = torch.tensor([[0, 5, 69], [33, 33, 1]])
    for dtype in (torch.float32, torch.bfloat16):
        embedding = VocabParallelEmbedding(vocab, hidden)
        embedding.weight.data = codes.dequantized().to(dtype)
        expected = F.embedding(ids, embedding.weight.data)
        assert embedding.share_codes(codes, chunk=16)
        assert embedding.codes is codes and embedding.weight.numel() == 0
        out = embedding(ids)
        assert out.dtype == dtype and torch.equal(out, expected)
    embedding = VocabParallelEmbedding(vocab, hidden)
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    embedding.weight.data = weight.clone()
    assert not embedding.share_codes(Int8Weight.quantize(weight.float(), torch.bfloat16))
    assert embedding.codes is None and torch.equal(embedding.weight, weight)
    assert torch.equal(embedding(ids), F.embedding(ids, weight))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [1, 3])
def test_compiled_panel_lookup_is_the_torch_ops_bit_for_bit(monkeypatch, scale_dtype, groups):
    """Int8Weight.rows of codes in panels (a tied embedding's lookups) by the compiled
    int8_panel_dequantize_rows: the torch ops' rows bit for bit, in bfloat16 and float32,
    per-channel and group-wise scales, the last panel partly filled, an id repeated; an id
    outside the vocabulary raises instead of reading past the codes."""
    from pagellm.model.layers import quant_library, quant_panels

    if not quant_matmul.available():
        pytest.skip("the compiled quantized matmul kernels are not built here")
    gen = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (37, 96), generator=gen, dtype=torch.int8)
    scale = (torch.rand(37, groups, generator=gen) / 50).to(scale_dtype)
    layer = Int8Weight(q, scale.squeeze(1) if groups == 1 else scale, 96 // groups)
    layer._use_panels(True)  # as int8 activations do on AVX512-VNNI builds
    ids = torch.tensor([0, 15, 16, 36, 3, 16])
    compiled = {dtype: layer.rows(ids, dtype) for dtype in (torch.bfloat16, torch.float32)}
    monkeypatch.setattr(quant_matmul, "dequantized_panel_rows", lambda *args: None)  # the torch ops
    for dtype, rows in compiled.items():
        assert rows.dtype == dtype and torch.equal(rows, layer.rows(ids, dtype)), dtype
    library = quant_matmul._LIBRARY.load()
    for bad in (37, -1):
        with pytest.raises(IndexError, match=r"1 ids outside \[0, 37\)"):
            quant_library.dequantized_panel_rows(library, layer.panel_codes, layer.scale,
                                          layer.group_size, torch.tensor([2, bad]),
                                          torch.bfloat16)
    assert torch.equal(quant_panels.unpack_int8_panels(layer.panel_codes, 37), q)


def test_int8_codes_move_into_the_panels_and_back():
    """On AVX512-VNNI builds, int8 activations put a symmetric int8 layer's codes in the
    panel layout, with no second copy in rows: its products are the panel kernel's (bit for
    bit those of the row-layout codes' panel copy), and codes(), rows() and dequantized() are
    unchanged; switched off, the codes are back in rows as they were."""
    if not quant_matmul.available() or not quant_matmul.has_vnni_loops():
        pytest.skip("the panel kernels need the compiled AVX512-VNNI loops")
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (37, 96), generator=gen, dtype=torch.int8)
    scale = (torch.rand(37, 3, generator=gen) / 50).to(torch.float16)
    layer = Int8Weight(q.clone(), scale, 32)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    row_panels = quant_matmul.QuantizedMatmul("int8", q, layer.params, 32)
    row_panels.int8_activations = True
    expected = row_panels(x)
    weight = layer.dequantized()
    ids = torch.tensor([0, 15, 16, 36, 3])
    rows = layer.rows(ids, torch.bfloat16)
    layer.int8_activations = True
    assert layer.panels and layer.q.numel() == 0 and layer.int8_activations
    assert layer.kernel.kind == "int8_panels"
    assert layer.nbytes == layer.panel_codes.nbytes + layer.panel_scales.nbytes + layer.params.nbytes
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer.codes(), q) and torch.equal(layer.dequantized(), weight)
    assert torch.equal(layer.rows(ids, torch.bfloat16), rows)
    layer.int8_activations = False
    assert not layer.panels and not layer.int8_activations and torch.equal(layer.q, q)
    assert torch.equal(layer.rows(ids, torch.bfloat16), rows)
