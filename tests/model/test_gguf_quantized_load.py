"""Quantized loading of GGUF files (and safetensors) without a bfloat16 round trip.

Q4_K super-blocks (like Q4_0 / Q4_1 blocks) are int4 groups of 32 as they are: their codes,
scales and zeros give the gguf package's own dequantization, and a model loaded in int4 from
them computes what the unquantized float32 model computes. Every quantized type is int8
groups as it is (32 columns; 16 for Q6_K, Q3_K and Q2_K), with zeros for the types with a min
(Q4_1, Q4_K, Q5_1, Q5_K, Q2_K), and a model loaded in int8 from them computes what the
unquantized float32 model computes. Every other tensor type, group size or method is
re-quantized from the file's float32 values, not from the copy rounded to the model dtype:
checked against the quantizer applied to gguf's float32 dequantization, with
``dtype=bfloat16``, where quantizing the rounded copy gives other codes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_models import smollm2_gguf, write_tiny_gguf  # noqa: E402
from paged_greedy import PagedGreedy  # noqa: E402

from pagellm.model.gguf_config import open_reader  # noqa: E402
from pagellm.model.gguf_codes import INT8_BLOCK_TYPES, int4_codes, int8_codes  # noqa: E402
from pagellm.model.gguf_loader import unpermute_qk  # noqa: E402
from pagellm.model.layers import quant_matmul  # noqa: E402
from pagellm.model.layers.linear import Linear  # noqa: E402
from pagellm.model.layers.quantized_linear import Int4Weight, Int8Weight  # noqa: E402
from pagellm.model.loader import load_model  # noqa: E402

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def projections(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def file_weight(expected: dict[str, np.ndarray], name: str) -> torch.Tensor:
    """A projection's float32 weight from the file (write_tiny_gguf's expected values), the
    fused ones stacked as the engine stacks them."""
    prefix, _, leaf = name.rpartition(".")
    parts = [f"{prefix}.{p}" for p in FUSED.get(leaf, (leaf,))] if prefix else [name]
    return torch.from_numpy(np.concatenate([expected[f"{p}.weight"] for p in parts]))


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """A tiny Llama file of random valid Q4_K tensors (fp16 d and dmin in [0.002, 0.02],
    random 6-bit scale and min bytes, random nibbles)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("q4k"), "Q4_K")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_k_blocks_are_int4_groups_of_32(q4_k_file, dtype):
    """Every Q4_K tensor of the file: codes and scales give gguf's dequantization exactly in
    float32; in bfloat16 the only rounding is that of the scales and zeros."""
    path, _ = q4_k_file
    tensors = [t for t in open_reader(path).tensors if t.tensor_type.name == "Q4_K"]
    assert len(tensors) == 2 + 7 * 2
    for tensor in tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        codes, scale, zero = int4_codes(tensor)
        assert codes.shape == expected.shape and scale.shape == (codes.shape[0],
                                                                 codes.shape[1] // 32)
        layer = Int4Weight(codes, scale, zero, 32, dtype)
        if dtype == torch.float32:
            np.testing.assert_array_equal(layer.dequantized().numpy(), expected)
        else:
            rounded = ((codes.float() - 8).view(codes.shape[0], -1, 32)
                       * scale.to(dtype).float()[..., None] + zero.to(dtype).float()[..., None])
            assert torch.equal(layer.dequantized(), rounded.view(codes.shape))
            # bfloat16 keeps 8 significant bits of the scale and of the zero
            bound = ((8 * scale.abs() + zero.abs()) * 2 ** -8).repeat_interleave(32, 1)
            assert ((layer.dequantized() - torch.from_numpy(expected)).abs() <= bound).all()


def test_int4_model_from_q4_k_computes_the_float32_model(q4_k_file):
    """Loaded in int4 groups of 32, every projection holds the file's values exactly (q and k
    rows un-reordered, shards stacked), and the logits are those of the unquantized float32
    model with the same int8 vocabulary projection (llama.cpp's 8-bit output matrix)."""
    check_model_holds_the_file(q4_k_file, "int4", Int4Weight)


@pytest.mark.parametrize("type_name", ["Q5_K", "Q2_K", "Q5_1"])
def test_int8_model_from_blocks_with_a_min_computes_the_float32_model(tmp_path, type_name):
    """Loaded in int8 from Q5_K / Q2_K / Q5_1 tensors (codes, scales and zeros as they are):
    the same, through the compiled int8-with-zeros kernels (prompt rows in tiles of 8, 4 and
    fewer; decode rows)."""
    if not quant_matmul.available():
        pytest.skip("group-wise int8 runs in the compiled kernels, which are off here "
                    f"({quant_matmul.describe()})")
    check_model_holds_the_file(write_tiny_gguf(tmp_path, type_name), "int8", Int8Weight)


def test_gguf_method_takes_each_projection_as_its_blocks(tmp_path):
    """quantization="gguf" on a file mixing Q4_K, Q6_K (attn_v) and F16 (ffn_down), as
    llama.cpp's Q4_K_M files mix their types: all-Q4_K projections are int4 groups of 32, a
    fused projection with a Q6_K shard int8 (groups of 16, the Q4_K shards with zeros), the
    F16 ones stay plain; every weight is the file's, and the logits are the float32 model's."""
    path, expected = write_tiny_gguf(tmp_path, "Q4_K",
                                     other_types={"attn_v": "Q6_K", "ffn_down": "F16"})
    model, config = load_model(path, dtype=torch.float32, quantization="gguf")
    plain, _ = load_model(path, dtype=torch.float32, pack_weights=False)
    layers = projections(model)
    for name, module in layers.items():
        layer, values = module.quantized, file_weight(expected, name)
        if name.endswith("qkv_proj") or name == "lm_head":
            assert isinstance(layer, Int8Weight), name
            assert layer.group_size == (16 if name.endswith("qkv_proj") else 32), name
            assert layer.zero is not None, name
        elif name.endswith("down_proj"):
            assert layer is None, name
            torch.testing.assert_close(plain.get_submodule(name).weight, values, rtol=0, atol=0)
            continue
        else:
            assert isinstance(layer, Int4Weight) and layer.group_size == 32, name
        assert torch.equal(layer.dequantized(), values), name
    check_same_logits(model, plain, config)


def test_gguf_method_needs_a_gguf_file_and_its_own_groups(model_zoo):
    from pagellm import EngineArgs

    llama_dir, _ = model_zoo("llama")
    with pytest.raises(ValueError, match=r"quantization='gguf' takes a GGUF file's own"):
        load_model(llama_dir, quantization="gguf")
    with pytest.raises(ValueError, match=r"quantization_group_size.*does not apply to "
                                         r"quantization='gguf'"):
        EngineArgs(model="m.gguf", quantization="gguf", quantization_group_size=32).validate()
    for method in (None, "int8"):  # int4's groups alone: refused, not ignored
        with pytest.raises(ValueError, match=r"quantization_group_size=64 is invalid: applies "
                                             rf"to quantization='int4' only \(got {method!r}"):
            EngineArgs(model="m.gguf", quantization=method, quantization_group_size=64).validate()
    EngineArgs(model="m.gguf", quantization="int4", quantization_group_size=64).validate()
    EngineArgs(model="m.gguf", quantization="gguf", int8_activations=True).validate()


def check_model_holds_the_file(file, method, layer_type) -> None:
    path, expected = file
    quantized, config = load_model(path, dtype=torch.float32, quantization=method,
                                   quantization_group_size=32)
    plain, _ = load_model(path, dtype=torch.float32, pack_weights=False)
    layers = projections(quantized)
    for name, module in layers.items():
        if name == "lm_head":
            assert isinstance(module.quantized, Int8Weight)
            continue
        assert isinstance(module.quantized, layer_type), name
        assert torch.equal(module.quantized.dequantized(), file_weight(expected, name)), name
        assert module.weight.numel() == 0  # the plain weight is released
    check_same_logits(quantized, plain, config)


def check_same_logits(quantized, plain, config) -> None:
    """The quantized model's greedy tokens and logits (prompts and decode steps) are the plain
    float32 model's, given the same (dequantized) vocabulary projection, within 1e-4 of the
    logits' range: the float32 sums in another order."""
    plain.lm_head.weight.data = quantized.lm_head.quantized.dequantized()
    prompts = [[0, 5, 77, 300, 12, 9, 41, 3], [0, 400, 3] * 6]
    results = [PagedGreedy(None, loaded=(m, config), num_blocks=64).generate(
        prompts, 6, record_prompt_logits=True) for m in (quantized, plain)]
    assert results[0].tokens == results[1].tokens
    for ours, reference in zip(results[0].prompt_logits + results[0].logits,
                               results[1].prompt_logits + results[1].logits):
        scale = reference.abs().max().item()
        torch.testing.assert_close(ours, reference, atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("type_name, method, group_size", [
    ("Q8_0", "int4", 128), ("Q4_K", "int4", 128), ("Q6_K", "int4", 32), ("Q5_0", "int4", 64),
    ("Q5_K", "int4", 32), ("F16", "int8", 128)])
def test_other_layouts_are_quantized_from_the_float32_values(tmp_path, type_name, method,
                                                             group_size):
    """dtype=bfloat16: each projection equals the quantizer applied to gguf's float32
    dequantization of the file (scales rounded to bfloat16, codes computed with them), which
    is not what quantizing the bfloat16-rounded weights gives."""
    path, expected = write_tiny_gguf(tmp_path, type_name)
    model, _ = load_model(path, dtype=torch.bfloat16, quantization=method,
                          quantization_group_size=group_size)
    differs = 0
    for name, module in projections(model).items():
        values = file_weight(expected, name)
        kind = "int8" if name == "lm_head" else method
        if kind == "int8" and type_name in INT8_BLOCK_TYPES and quant_matmul.available():
            continue  # int8 as they are (test_q8_0_blocks_..., test_quantized_types_are_...)
        if kind == "int8":
            reference = Int8Weight.quantize(values, torch.bfloat16)
            rounded = Int8Weight.quantize(values.to(torch.bfloat16))
            assert torch.equal(module.quantized.q, reference.q), name
            assert torch.equal(module.quantized.scale, reference.scale), name
            differs += not torch.equal(rounded.q, reference.q)
        else:
            reference = Int4Weight.quantize(values, group_size, torch.bfloat16)
            rounded = Int4Weight.quantize(values.to(torch.bfloat16), group_size)
            assert torch.equal(module.quantized.packed, reference.packed), name
            assert torch.equal(module.quantized.scale_and_zero, reference.scale_and_zero), name
            differs += not torch.equal(rounded.packed, reference.packed)
        stored = module.quantized.scale if kind == "int8" else module.quantized.scale_and_zero
        assert stored.dtype == torch.bfloat16
    assert differs > 0  # the bfloat16 round trip would have changed codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_blocks_are_int8_groups_of_32(tmp_path, dtype):
    """int8 from a Q8_0 file whose attn_v tensors are Q4_0 (a mixed file): every projection
    and the vocabulary projection are int8 groups of 32 with the file's float16 scales as
    they are, dequantizing to the file's values exactly, in either dtype (the Q4_0 v rows as
    codes q - 8)."""
    if not quant_matmul.available():
        pytest.skip("group-wise int8 runs in the compiled kernels, which are off here "
                    f"({quant_matmul.describe()})")
    path, expected = write_tiny_gguf(tmp_path, "Q8_0", other_types={"attn_v": "Q4_0"})
    model, _ = load_model(path, dtype=dtype, quantization="int8")
    for name, module in projections(model).items():
        layer = module.quantized
        assert isinstance(layer, Int8Weight) and layer.group_size == 32, name
        assert layer.scale.dtype == torch.float16 and layer.zero is None, name
        np.testing.assert_array_equal(layer.dequantized().numpy(),
                                      file_weight(expected, name).numpy(), err_msg=name)
    tensors = {t.name: t for t in open_reader(path).tensors}
    q, scale = int8_codes(tensors["output.weight"])
    assert torch.equal(model.lm_head.quantized.q, q)
    assert torch.equal(model.lm_head.quantized.scale.float(), scale)


@pytest.mark.parametrize("type_name, group", [
    ("Q6_K", 16), ("Q3_K", 16), ("Q5_0", 32), ("Q4_0", 32), ("Q4_1", 32), ("Q4_K", 32),
    ("Q5_1", 32), ("Q5_K", 32), ("Q2_K", 16)])
def test_quantized_types_are_int8_groups(tmp_path, type_name, group):
    """int8 from a Q6_K (Q3_K, ...) file whose attn_v tensors are Q8_0: every projection and
    the vocabulary projection are int8 groups of 16 or 32 with the file's codes, scales and,
    for the types with a min, zeros, dequantizing to gguf's values exactly: float16 for the
    types whose scales and mins are the file's float16 values (Q4_0, Q4_1, Q5_0, Q5_1),
    float32 for the K types' products; in qkv_proj the Q8_0 v rows' scales of 32 are
    repeated into groups of 16, and take zeros of 0 beside shards with zeros."""
    if not quant_matmul.available():
        pytest.skip("group-wise int8 runs in the compiled kernels, which are off here "
                    f"({quant_matmul.describe()})")
    path, expected = write_tiny_gguf(tmp_path, type_name, other_types={"attn_v": "Q8_0"})
    model, _ = load_model(path, dtype=torch.float32, quantization="int8")
    with_min = type_name in ("Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K")
    params_dtype = torch.float32 if type_name.endswith("_K") else torch.float16
    for name, module in projections(model).items():
        layer = module.quantized
        assert isinstance(layer, Int8Weight) and layer.group_size == group, name
        assert layer.params.dtype == params_dtype, name
        assert (layer.zero is not None) == with_min, name
        np.testing.assert_array_equal(layer.dequantized().numpy(),
                                      file_weight(expected, name).numpy(), err_msg=name)
    tensors = {t.name: t for t in open_reader(path).tensors}
    assert tensors["output.weight"].tensor_type.name == type_name
    parts = int8_codes(tensors["output.weight"])
    assert len(parts) == 2 + with_min
    assert torch.equal(model.lm_head.quantized.q, parts[0])
    assert torch.equal(model.lm_head.quantized.scale.float(), parts[1])
    if with_min:
        assert torch.equal(model.lm_head.quantized.zero.float(), parts[2])


def test_safetensors_float32_checkpoint_is_quantized_from_its_values(model_zoo):
    """A float32 checkpoint loaded in bfloat16 with int8: the codes of its float32 tensors."""
    from safetensors.torch import load_file

    llama_dir, _ = model_zoo("llama")
    stored = {}
    for file in sorted(llama_dir.glob("*.safetensors")):
        stored.update(load_file(file))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    model, _ = load_model(llama_dir, dtype=torch.bfloat16, quantization="int8")
    for name, module in projections(model).items():
        if name == "lm_head" and model.tie_word_embeddings:
            values = stored["model.embed_tokens.weight"]
        else:
            values = file_weight({k: v.numpy() for k, v in stored.items()}, name)
        reference = Int8Weight.quantize(values, torch.bfloat16)
        assert torch.equal(module.quantized.q, reference.q), name
        assert torch.equal(module.quantized.scale, reference.scale), name


@pytest.mark.parametrize("method,group_size", [("int4", 32), ("int4", None), ("gguf", None)])
def test_smollm2_int4_takes_every_projection_from_the_file(method, group_size):
    """The real SmolLM2 file (Q4_1 projections, a Q8_0 embedding tied to the output) in int4
    groups of 32 (given, or unset: a GGUF file's default), or as its blocks are (the same),
    bfloat16: every projection holds the file's own codes, scales and zeros; the tied
    vocabulary projection is int8 from the embedding's float32 values, which the embedding
    then reads in place of its own copy (the file's Q8_0 codes where the head holds them as
    they are). (With groups of 128, the default before, SmolLM2's 576-wide inputs fit no
    group and the load failed.)"""
    path = smollm2_gguf()
    model, config = load_model(path, dtype=torch.bfloat16, quantization=method,
                               quantization_group_size=group_size)
    tensors = {t.name: t for t in open_reader(path).tensors}

    def codes(gguf_name: str, heads: int | None = None) -> tuple[torch.Tensor, ...]:
        parts = int4_codes(tensors[gguf_name])
        return tuple(unpermute_qk(p, heads) for p in parts) if heads else parts

    sources = {"self_attn.qkv_proj": [("attn_q", config.num_attention_heads),
                                      ("attn_k", config.num_key_value_heads), ("attn_v", None)],
               "self_attn.o_proj": [("attn_output", None)],
               "mlp.gate_up_proj": [("ffn_gate", None), ("ffn_up", None)],
               "mlp.down_proj": [("ffn_down", None)]}
    layers = projections(model)
    assert len(layers) == 4 * config.num_hidden_layers + 1
    for i in range(config.num_hidden_layers):
        for leaf, parts in sources.items():
            module = layers[f"model.layers.{i}.{leaf}"]
            assert tensors[f"blk.{i}.{parts[0][0]}.weight"].tensor_type.name == "Q4_1"
            q, scale, zero = (torch.cat(p) for p in
                              zip(*(codes(f"blk.{i}.{n}.weight", h) for n, h in parts)))
            direct = Int4Weight(q, scale, zero, 32, torch.bfloat16)
            assert torch.equal(module.quantized.codes(), q), (i, leaf)
            assert torch.equal(module.quantized.scale_and_zero, direct.scale_and_zero), (i, leaf)
    assert config.tie_word_embeddings and tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    embedding = gguf.quants.dequantize(tensors["token_embd.weight"].data,
                                       tensors["token_embd.weight"].tensor_type)
    lm_head = layers["lm_head"].quantized
    if quant_matmul.available() or method == "gguf":  # the Q8_0 blocks as they are
        q, scale = int8_codes(tensors["token_embd.weight"])
        assert torch.equal(lm_head.q, q) and torch.equal(lm_head.scale, scale)
        np.testing.assert_array_equal(lm_head.dequantized().numpy(), embedding)
    else:  # per channel, from the embedding's float32 values
        reference = Int8Weight.quantize(torch.from_numpy(np.ascontiguousarray(embedding)),
                                        torch.bfloat16)
        assert torch.equal(lm_head.q, reference.q)
        assert torch.equal(lm_head.scale, reference.scale)
    # the embedding reads the Q8_0 codes where the head holds them as they are (its bfloat16
    # copy released), else keeps its weight; either way its rows are the file's, rounded once
    embed = model.model.embed_tokens
    as_they_are = quant_matmul.available() or method == "gguf"
    assert (embed.codes is lm_head) == as_they_are
    assert embed.weight.shape == ((0,) if as_they_are else (config.vocab_size, config.hidden_size))
    ids = torch.tensor([0, 1, 2, 17, 4095, 4096, config.vocab_size - 1])
    expected = torch.from_numpy(np.ascontiguousarray(embedding))[ids].to(torch.bfloat16)
    assert torch.equal(embed(ids), expected)
