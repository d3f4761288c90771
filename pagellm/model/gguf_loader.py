"""Load a llama.cpp GGUF file: its tensors dequantized into the model, its tokenizer.

The weights are dequantized on load, one tensor at a time, to the engine's dtype: the engine
then runs the same kernels as for a Hugging Face checkpoint, and the peak memory while loading
is the final weights plus one tensor in float32 (the file is memory-mapped, so
the quantized bytes are paged in as they are read, not held).

With ``quantization`` the projections are quantized from the float32 dequantization of the
file (model/quantize_on_load.py), not from its copy in the engine's dtype; Q4_0, Q4_1 and Q4_K
blocks are int4 groups of 32 as they are, so with ``quantization="int4"`` (groups of 32, its
default for a GGUF file) their codes are taken over (``gguf_codes.int4_codes``) and nothing is
re-quantized. Every quantized type is int8 groups as it is (32 columns, 16 for Q6_K, Q3_K and
Q2_K; with a float32 zero per group for the types with a min, Q4_1, Q4_K, Q5_1, Q5_K and
Q2_K): a projection quantized to int8 (and the vocabulary projection, always int8) takes their
codes and float32 scales (``gguf_codes.int8_codes``) where the compiled group-wise int8
kernels run (quant_matmul.available()). ``quantization="gguf"`` takes every projection from
its blocks, in the smallest of the two formats that holds them exactly (``gguf_method``), and
leaves the file's unquantized tensors unquantized.

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
from pagellm.model.gguf_codes import INT4_BLOCK_TYPES, INT8_BLOCK_TYPES, int4_codes, int8_codes
from pagellm.model.gguf_config import field_value, load_gguf_config, open_reader
from pagellm.model.layers import quant_matmul
from pagellm.model.quantized_model import default_group_size
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
