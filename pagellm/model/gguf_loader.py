"""Load a llama.cpp GGUF file: its tensors dequantized into the model, its tokenizer.

The weights are dequantized on load, one tensor at a time, to the engine's dtype: the engine
then runs the same kernels as for a Hugging Face checkpoint, and the peak memory while loading
is the final weights plus one tensor in float32 (the file is memory-mapped, so
the quantized bytes are paged in as they are read, not held).

With ``quantization`` the projections are quantized from the float32 dequantization of the
file (model/quantize_on_load.py), not from its copy in the engine's dtype; Q4_0, Q4_1 and Q4_K
blocks are int4 groups of 32 as they are, so with ``quantization="int4"`` and groups of 32
their codes are taken over (``int4_codes``) and nothing is re-quantized. Every quantized type
is int8 groups as it is (32 columns, 16 for Q6_K, Q3_K and Q2_K; with a float32 zero per
group for the types with a min, Q4_1, Q4_K, Q5_1, Q5_K and Q2_K): a projection quantized to
int8 (and the vocabulary projection, always int8) takes their codes and float32 scales
(``int8_codes``) where the compiled group-wise int8 kernels run (quant_matmul.available()).
``quantization="gguf"`` takes every projection from its blocks, in the smallest of the two
formats that holds them exactly (``gguf_method``), and leaves the file's unquantized tensors
unquantized.

llama.cpp's converter reorders the rows of the Llama family's q and k projections (each head's
rotary pairs (i, i + d/2) become adjacent rows, the GPT-J layout its kernels rotate); loading
undoes that so that the rotary embedding here, which pairs i with i + d/2, sees transformers'
layout. Qwen2 and Qwen3 files are written without the reordering.
"""
from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagellm.model.decoder import CausalLM
from pagellm.model.gguf_config import field_value, load_gguf_config, open_reader
from pagellm.model.layers import quant_matmul
from pagellm.model.layers.quantized_linear import default_group_size
from pagellm.model.quantize_on_load import QuantizingLoad

# The tensor types whose dequantization (gguf.quants.dequantize) is supported and tested.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Tensors that carry no weight of the model: llama.cpp's baked rope scaling (read into the
# config instead, see gguf_config._rope_parameters).
_SKIPPED_TENSORS = ("rope_freqs.weight",)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises ValueError naming a tensor that no supported model has."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} matches no parameter of the supported "
                     "decoder models (llama, qwen2, qwen3)")


def dequantize(tensor: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One GGUF tensor (gguf_file.GGUFTensor) as a torch tensor of ``dtype``, shaped as
    transformers shapes it (GGUF lists dimensions innermost first: ``[in, out]`` is a
    ``[out, in]`` matrix). The quantized types are computed from their codes, scales and
    zeros (``int8_codes``) as gguf computes them, in float32: q * scale (+ zero), the same
    values bit for bit, a few times faster than gguf's per-block numpy loops; the others by
    gguf.

    Raises ValueError naming the tensor and its type when the type is not supported."""
    from gguf.quants import dequantize as gguf_dequantize

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {type_name}, which is not "
                         f"supported; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if type_name in INT8_BLOCK_TYPES and len(shape) == 2:
        codes, scale, *zero = int8_codes(tensor)
        groups = codes.float().view(*scale.shape, -1)  # [out, groups, group]
        groups.mul_(scale.unsqueeze(-1))
        if zero:
            groups.add_(zero[0].unsqueeze(-1))
        return groups.view(shape).to(dtype)
    values = gguf_dequantize(tensor.data, tensor.tensor_type)  # float32 (a view for F32)
    if values.shape != shape:
        values = values.reshape(shape)
    # The file's arrays are read-only views of the mapped file; torch wants writable memory.
    # Converting to ``dtype`` copies anyway, so the float32 view is only copied for float32.
    values = np.require(values, requirements=("C", "W"))
    return torch.from_numpy(values).to(dtype)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of a q or k projection (weight [heads * d, in] or bias
    [heads * d]): within each head its rows are stored as pairs (i, i + d/2) interleaved;
    transformers stores the first halves, then the second halves."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"a q/k projection of {rows} rows cannot be split into {num_heads} "
                         "heads of rotary pairs")
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


# GGUF 4-bit blocks that are int4 groups of 32 as they are (quantized_linear.py), by bytes
# per block: Q4_0 = fp16 d, 16 bytes of nibbles (d * (q - 8)); Q4_1 = fp16 d, fp16 m, nibbles
# (d * q + m); Q4_K = a super-block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
# mins of its 8 sub-blocks of 32, 128 bytes of nibbles (d * sc_j * q - dmin * m_j).
INT4_BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def int4_codes(tensor: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor's codes [out, in] (0..15), scales and zeros [out, in / 32]
    float32, in int4pack's convention (q - 8) * scale + zero: the file's values exactly."""
    block_bytes = INT4_BLOCK_TYPES[tensor.tensor_type.name]
    rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, block_bytes)
    if block_bytes == 144:
        codes, scale, zero = _q4_k_groups(rows)
    else:
        scale = _float16(rows, 0)  # [out, blocks]
        zero = np.zeros_like(scale) if block_bytes == 18 else _float16(rows, 2) + 8 * scale
        nibbles = rows[..., block_bytes - 16:]  # [out, blocks, 16]: j low, j + 16 high
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # [out, blocks, 32]
    return (torch.from_numpy(codes.reshape(rows.shape[0], -1).astype(np.uint8)),
            torch.from_numpy(scale.reshape(rows.shape[0], -1)),
            torch.from_numpy(zero.reshape(rows.shape[0], -1)))


# GGUF blocks as int8 groups (codes times one scale per group, plus a zero for the types
# with a min), by bytes per block. Groups of 32: Q8_0 = fp16 d, 32 int8 codes (d * q); Q5_0 =
# fp16 d, 4 bytes of high bits, 16 bytes of nibbles (d * (q5 - 16)); Q5_1 = fp16 d, fp16 m,
# the same high bits and nibbles (d * q5 + m); Q4_0 and Q4_1 (d * (q - 8), d * q + m); Q4_K
# and Q5_K = super-blocks of 256 with 8 sub-blocks of 32 (d * sc_j * q - dmin * m_j; Q5_K
# adds 32 bytes of fifth bits). Groups of 16: Q6_K = a super-block of 256: 128 bytes of low
# nibbles, 64 of high 2-bit pairs, 16 int8 scales of its sub-blocks of 16, fp16 d
# (d * sc_j * (q6 - 32)); Q3_K = a super-block of 256: 32 bytes of high bits, 64 of 2-bit
# pairs, 12 bytes of the 6-bit scales of its 16 sub-blocks of 16, fp16 d
# (d * (sc_j - 32) * (q3 - 4)); Q2_K = 16 bytes of 4-bit (scale, min) pairs of its 16
# sub-blocks, 64 of 2-bit codes, fp16 d, dmin (d * sc_j * q2 - dmin * m_j).
INT8_BLOCK_TYPES = {"Q8_0": 34, "Q5_0": 22, "Q6_K": 210, "Q3_K": 110, "Q4_0": 18,
                    "Q4_1": 20, "Q4_K": 144, "Q5_1": 24, "Q5_K": 176, "Q2_K": 84}


def int8_codes(tensor: Any) -> tuple[torch.Tensor, ...]:
    """A quantized tensor's codes [out, in] int8, scales [out, in / group] float32 (the file's
    fp16 values, times the K types' sub-block scales) and, for the types with a min (Q4_1,
    Q4_K, Q5_1, Q5_K, Q2_K), zeros [out, in / group] float32: W = q * scale (+ zero), the
    file's values exactly (gguf's own float32 arithmetic, d * q + m or d * q - dmin * m).
    Groups of 32, or 16 for Q6_K, Q3_K and Q2_K."""
    name = tensor.tensor_type.name
    rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, INT8_BLOCK_TYPES[name])
    zero = None
    if name == "Q8_0":
        codes, scale = rows[..., 2:].copy().view(np.int8), _float16(rows, 0)
    elif name in ("Q5_0", "Q5_1"):
        codes = _q5_codes(rows, 2 if name == "Q5_0" else 4)
        scale = _float16(rows, 0)
        if name == "Q5_0":
            codes = codes - 16
        else:
            zero = _float16(rows, 2)
    elif name == "Q6_K":
        codes, scale = _q6_k_groups(rows)
    elif name == "Q3_K":
        codes, scale = _q3_k_groups(rows)
    elif name == "Q2_K":
        codes, scale, zero = _q2_k_groups(rows)
    elif name in ("Q4_0", "Q4_1"):
        nibbles = rows[..., -16:]  # [out, blocks, 16]: j low, j + 16 high
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int16)
        scale = _float16(rows, 0)
        if name == "Q4_0":
            codes = codes - 8
        else:
            zero = _float16(rows, 2)
    else:  # Q4_K, Q5_K
        codes, scale, zero = _k_groups_with_min(rows, name == "Q5_K")
    parts = (codes.astype(np.int8), scale) + (() if zero is None else (zero,))
    return tuple(torch.from_numpy(np.ascontiguousarray(p).reshape(rows.shape[0], -1))
                 for p in parts)


def _q5_codes(rows: np.ndarray, offset: int) -> np.ndarray:
    """rows [out, blocks, bytes] of Q5_0 (offset 2) or Q5_1 (offset 4) -> codes q5 [out,
    blocks, 32] in [0, 31] int16: weight j < 16 is the low nibble of byte j of the quants
    (high nibble: j + 16), with bit j of the 32-bit little-endian high-bit word at ``offset``
    as its fifth bit."""
    high = rows[..., offset:offset + 4].copy().view("<u4")  # [out, blocks, 1]
    quants = rows[..., offset + 4:offset + 20]
    low = np.concatenate([quants & 15, quants >> 4], axis=-1).astype(np.int16)
    fifth = (high >> np.arange(32, dtype=np.uint32)) & 1  # [out, blocks, 32]
    return low | (fifth.astype(np.int16) << 4)


def _k_groups_with_min(rows: np.ndarray, five_bits: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 144 or 176] of Q4_K or Q5_K -> codes [out, sb, 8, 32] (0-15
    or 0-31), scale d * sc_j and zero -dmin * m_j [out, sb, 8] float32. Sub-blocks 2i and
    2i + 1 are the low and the high nibbles of the i-th 32 bytes of quants; Q5_K's fifth bit
    of weight l of sub-block j is bit j of high-bit byte l (bytes 16-47, quants from 48)."""
    sc, m = _k_scales_mins(rows[..., 4:16])
    scale = _float16(rows, 0)[..., None] * sc.astype(np.float32)
    zero = -(_float16(rows, 2)[..., None] * m.astype(np.float32))
    start = 48 if five_bits else 16
    quants = rows[..., start:start + 128].reshape(*rows.shape[:2], 4, 1, 32)
    codes = ((quants >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15).astype(np.int16)
    codes = codes.reshape(*rows.shape[:2], 8, 32)
    if five_bits:
        high = rows[..., 16:48].reshape(*rows.shape[:2], 1, 32)
        codes |= ((high >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int16) << 4
    return codes, scale, zero


def _q2_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 84] of Q2_K -> codes q2 [out, sb, 16, 16] in [0, 3], scale
    d * sc_j and zero -dmin * m_j [out, sb, 16] float32. Sub-block j's byte j of the first 16
    holds sc_j (low nibble) and m_j; weight l of sub-block 8 n + 2 s + h has bits 2s, 2s + 1
    of quant byte 32 n + 16 h + l."""
    packed = rows[..., 0:16]
    quants = rows[..., 16:80].reshape(*rows.shape[:2], 2, 1, 2, 16)  # [.., n, s, h, l]
    shift = (2 * np.arange(4, dtype=np.uint8))[:, None, None]
    codes = ((quants >> shift) & 3).astype(np.int16).reshape(*rows.shape[:2], 16, 16)
    scale = _float16(rows, 80)[..., None] * (packed & 15).astype(np.float32)
    zero = -(_float16(rows, 82)[..., None] * (packed >> 4).astype(np.float32))
    return codes, scale, zero


def _q6_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 210] of Q6_K -> codes q6 - 32 [out, sb, 256] int8 and scales
    [out, sb, 16] float32 (d * sc_j). ggml's layout: each half of 128 weights takes 64 bytes
    of low nibbles (ql) and 32 of high bit pairs (qh); weight l + 32 i (l < 32, i < 4) of a
    half has ql[l + 32 (i % 2)]'s low (i < 2) or high (i >= 2) nibble and bits 2i, 2i + 1
    of qh[l]; sub-block j covers weights 16 j .. 16 j + 15."""
    ql = rows[..., 0:128].reshape(*rows.shape[:2], 2, 2, 32)  # [out, sb, half, i % 2, l]
    qh = rows[..., 128:192].reshape(*rows.shape[:2], 2, 1, 32)  # [out, sb, half, 1, l]
    low = np.stack([ql & 15, ql >> 4], axis=3)  # [out, sb, half, i // 2, i % 2, l]
    low = low.reshape(*rows.shape[:2], 2, 4, 32)  # i = 2 (i // 2) + i % 2
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [out, sb, half, i, l]
    codes = (low | (high << 4)).astype(np.int16) - 32
    sc = rows[..., 192:208].copy().view(np.int8).astype(np.float32)  # [out, sb, 16]
    return codes.astype(np.int8), _float16(rows, 208)[..., None] * sc


def _q4_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 144] of Q4_K -> codes [out, sb, 8, 32] uint8, scale and zero
    [out, sb, 8] float32 in int4's convention: (q - 8) * scale + zero = d sc q - dmin m."""
    codes, scale, negative_min = _k_groups_with_min(rows, five_bits=False)
    return codes.astype(np.uint8), scale, 8 * scale + negative_min


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins [out, sb, 8] of Q4_K / Q5_K's 12 packed bytes [out, sb, 12]
    (ggml's get_scale_min_k4): bytes 0-3 hold the low 6 bits of the scales of sub-blocks 0-3,
    bytes 4-7 those of their mins; sub-block j >= 4 takes its scale's low 4 bits from byte
    j + 4's low nibble (its min's from the high nibble) and the top 2 bits from the top bits
    of byte j - 4 (its min's: byte j)."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, m


def _q3_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 110] of Q3_K -> codes q3 - 4 [out, sb, 256] int8 and scales
    [out, sb, 16] float32 (d * (sc_j - 32)). ggml's layout: weight 16 h + l (h < 2, l < 16) of
    the 32 that shift j (< 4) of half n (< 2) covers, sub-block 8 n + 2 j + h, has bits 2j, 2j
    + 1 of quant byte 32 n + 16 h + l and, as its third bit, bit 4 n + j of high-bit byte
    16 h + l. Scale j takes its low 4 bits from byte j % 8's low (j < 8) or high nibble and
    its top 2 bits from bits 2 (j // 4) and 2 (j // 4) + 1 of byte 8 + j % 4."""
    hmask = rows[..., 0:32].reshape(*rows.shape[:2], 1, 1, 2, 16)  # [.., n, j, h, l]
    quants = rows[..., 32:96].reshape(*rows.shape[:2], 2, 1, 2, 16)
    packed = rows[..., 96:108]
    j = np.arange(4, dtype=np.uint8)[:, None, None]
    n = np.arange(2, dtype=np.uint8)[:, None, None, None]
    low = (quants >> (2 * j)) & 3  # [out, sb, n, j, h, l]
    high = (hmask >> (4 * n + j)) & 1
    codes = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
    k = np.arange(16)
    nibble = np.where(k < 8, packed[..., k % 8] & 15, packed[..., k % 8] >> 4)
    top = (packed[..., 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    sc = (nibble | (top << 4)).astype(np.float32) - 32  # [out, sb, 16]
    return codes.astype(np.int8), _float16(rows, 108)[..., None] * sc


def _float16(rows: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte ``offset`` of every block, as float32 [out, blocks]."""
    return rows[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def gguf_method(tensor_types: dict[str, str], names: list[str], lm_head: bool) -> str | None:
    """A projection's format under quantization="gguf", from the GGUF types of its
    checkpoint tensors (``names``, its shards): "int4" (groups of 32) where every shard is
    Q4_0, Q4_1 or Q4_K, and it is not the vocabulary projection (int8, as under every
    method); else "int8" where any shard is quantized (a plain shard beside it is quantized
    per output channel, the only rounding added); else None (the file holds it unquantized,
    and so does the model)."""
    types = [tensor_types.get(n) for n in names]
    if not lm_head and all(t in INT4_BLOCK_TYPES for t in types):
        return "int4"
    if any(t in INT8_BLOCK_TYPES for t in types):
        return "int8"
    return None


def iterate_gguf_weights(reader: Any, hf_config: Any, dtype: torch.dtype, lazy: bool = False,
                         quantizing: QuantizingLoad | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor in ``dtype``) for every tensor of the file, one at a time.
    ``lazy``: a GGUFTensorSlice instead, which dequantizes only the rows or columns a weight
    loader reads (a tensor-parallel rank's shard). ``quantizing``: the codes of Q4_0 / Q4_1 /
    Q4_K projections (int4 with groups of 32) and of every quantized type (int8) are handed to
    it as they are."""
    from pagellm.model.gguf_slices import GGUFTensorSlice

    permute = field_value(reader, "general.architecture") == "llama"
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    gguf = quantizing is not None and quantizing.method == "gguf"
    direct = gguf or (quantizing is not None and quantizing.method == "int4"
                      and quantizing.group_size == 32)
    # without the compiled kernels the int8 groups run as the dequantized weight's matmul:
    # int8 re-quantizes per channel instead (torch's kernel), "gguf" keeps the blocks
    direct_int8 = gguf or (quantizing is not None and quant_matmul.available())
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name)
        module = name.rsplit(".", 2)[-2]  # "q_proj" of "model.layers.0.self_attn.q_proj.weight"
        reorder = heads[module] if permute and module in heads else None
        if lazy:
            yield name, GGUFTensorSlice(tensor, dtype, reorder)
            continue
        value = dequantize(tensor, dtype)
        if reorder:
            value = unpermute_qk(value, reorder)
        if (direct and tensor.tensor_type.name in INT4_BLOCK_TYPES
                and quantizing.method_of(name) == "int4"):
            parts = int4_codes(tensor)
            if reorder:  # rows move; groups run along the input
                parts = tuple(unpermute_qk(p, reorder) for p in parts)
            quantizing.add(name, parts)
        elif (direct_int8 and tensor.tensor_type.name in INT8_BLOCK_TYPES
              and quantizing.method_of(name) == "int8"):
            parts = int8_codes(tensor)
            quantizing.add(name, tuple(unpermute_qk(p, reorder) for p in parts) if reorder
                           else parts)
        yield name, value


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu",
                    pack_weights: bool = True, tp: Any = None, quantization: str | None = None,
                    quantization_group_size: int | None = None) -> tuple[CausalLM, Any]:
    """Build the model of a GGUF file and load its dequantized weights: (model, hf_config).
    Under tensor parallelism (``tp``) each rank dequantizes only its rows or columns of each
    tensor (model/gguf_slices.py). With ``quantization`` the tensors are read in float32 and
    the projections quantized from those values (model/quantize_on_load.py), or taken as
    they are where the blocks are the format (int4 groups of 32 from Q4_0 / Q4_1 / Q4_K;
    int8 groups from every quantized type; "gguf": every projection as ``gguf_method``
    chooses). ``quantization_group_size`` None: 32, the Q4 blocks' groups."""
    from pagellm.model.loader import build_model, finish_weights, load_weights

    hf_config = load_gguf_config(path)
    model = build_model(hf_config, dtype, device, tp)
    if quantization is not None and quantization_group_size is None:
        quantization_group_size = default_group_size(model, from_gguf=True)
    lazy = tp is not None and tp.world_size > 1
    reader = open_reader(path)
    quantizing = None
    if quantization is not None and not lazy:
        choose = None
        if quantization == "gguf":
            types = {hf_tensor_name(t.name): t.tensor_type.name for t in reader.tensors
                     if t.name not in _SKIPPED_TENSORS}
            choose = functools.partial(gguf_method, types)
        quantizing = QuantizingLoad(model, quantization, quantization_group_size, choose)
    weights = iterate_gguf_weights(reader, hf_config,
                                   torch.float32 if quantizing else dtype, lazy, quantizing)
    load_weights(model, quantizing.stream(weights) if quantizing else weights)
    finish_weights(model, device, pack_weights, quantization, quantization_group_size)
    return model.eval(), hf_config


def get_gguf_tokenizer(path: str | Path, **kwargs: Any) -> Any:
    """The tokenizer and chat template stored in the file, converted by transformers: the
    class ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` picks, built as it builds
    it (``tokenizer_class_for``).

    Building the vocabulary takes about a second for SmolLM2, so it runs once per file
    version and keyword set; each caller gets its own copy (tokenizers are mutable: special
    tokens can be added)."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = tuple(sorted(kwargs.items()))
    try:
        hash(key)
    except TypeError:  # unhashable options: convert afresh
        return _convert_tokenizer(str(path), stat.st_mtime_ns, stat.st_size, key)
    return copy.deepcopy(_cached_tokenizer(str(path), stat.st_mtime_ns, stat.st_size, key))


def tokenizer_class_for(path: Path) -> Any:
    """The tokenizer class AutoTokenizer takes for a GGUF file: with a tokenizer_config.json
    beside it, AutoTokenizer itself (which reads it); else the class registered for the
    file's config class, TokenizersBackend where none is (llama). AutoTokenizer would find
    the same by parsing the file's metadata once more for the config (~7 s for SmolLM2's,
    its llama fallback), which the config already loaded here makes unnecessary."""
    from transformers import AutoTokenizer

    if (path.parent / "tokenizer_config.json").is_file():
        return AutoTokenizer
    try:  # transformers 5's names
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    except ImportError:
        return AutoTokenizer
    return TOKENIZER_MAPPING.get(type(load_gguf_config(path)), None) or TokenizersBackend


def _convert_tokenizer(path: str, mtime_ns: int, size: int,
                       options: tuple[tuple[str, Any], ...]) -> Any:
    file = Path(path)
    return tokenizer_class_for(file).from_pretrained(file.parent, gguf_file=file.name,
                                                     **dict(options))


_cached_tokenizer = functools.lru_cache(maxsize=2)(_convert_tokenizer)
