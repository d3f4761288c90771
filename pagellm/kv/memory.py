"""KV memory model and capacity planning: how many bytes one token of KV cache costs, and how
many blocks, tokens and concurrent sequences a memory budget holds.

Bytes per token = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype_bytes, plus, for the
8-bit caches (``int8``, ``fp8``), one 2-byte scale per (token, layer, K/V, KV head) stored beside
each row (attention/kv_quant.py: 2 x layers x KV heads x (head_dim + 2) bytes). The number of
KV heads is ``num_key_value_heads`` from the HuggingFace config (grouped-query attention shares one
KV head between several query heads), not the number of query heads: counting the query heads, as
for multi-head attention, overstates Llama-2-70B's KV cache eightfold.

Pure Python (json only), so the calculator runs without torch; only a GGUF file's metadata is
read through the model loader's GGUF code (which imports torch).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.kv.block_table import cdiv

# Bytes per element of the KV cache dtype. Names follow torch's, with the usual aliases.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}
# Bytes of the scale stored with each (token, KV head) row of an 8-bit cache (a bfloat16).
KV_ROW_SCALE_BYTES = 2

# Canonical spelling of each alias, so that outputs name one dtype one way.
_CANONICAL_DTYPE = {
    "float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
    "bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

# The fields of the public HuggingFace config.json of each model that matter for the KV cache
# (plus the context length and the dtype the weights are published in).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "model_type": "llama",
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 4096, "torch_dtype": "float16",
    },
    "llama-2-70b": {
        "_name_or_path": "meta-llama/Llama-2-70b-hf", "model_type": "llama",
        "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 4096, "torch_dtype": "float16",
    },
    "llama-3-8b": {
        "_name_or_path": "meta-llama/Meta-Llama-3-8B", "model_type": "llama",
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    },
    "mistral-7b": {
        "_name_or_path": "mistralai/Mistral-7B-v0.1", "model_type": "mistral",
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    },
    "qwen2-7b": {
        "_name_or_path": "Qwen/Qwen2-7B", "model_type": "qwen2",
        "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    },
}

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a memory size: ``40GiB``, ``1.5 GiB``, ``512MB``, ``40G`` or a plain byte count.

    Binary units (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024; KB, MB, GB and
    TB are powers of 1000, as their SI names say.
    """
    if isinstance(text, int):
        value, unit = text, ""
    else:
        match = _SIZE_RE.match(text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot parse memory size {text!r}: expected a number and a unit such as "
                "'40GiB', '512MiB', '1.5GB' or a plain number of bytes")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


def format_bytes(num_bytes: float, unit: str | None = None) -> str:
    """``2.5 MiB``, ``160 GiB``: in ``unit`` (bytes, KiB, MiB, GiB, TiB) if given, else in the
    largest binary unit that keeps the value >= 1; at most four decimals, no trailing zeros."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    if unit is None:
        exponent = 0
        while exponent < len(units) - 1 and num_bytes >= 1024 ** (exponent + 1):
            exponent += 1
    elif unit in units:
        exponent = units.index(unit)
    else:
        raise ValueError(f"unknown unit {unit!r}; known: {', '.join(units)}")
    text = f"{num_bytes / 1024 ** exponent:,.4f}".rstrip("0").rstrip(".")
    return f"{text} {units[exponent]}"


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV cache dtype (``float16``, ``bf16``, ``fp8`` ...)."""
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unknown KV cache dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def canonical_dtype(dtype: str) -> str:
    name = dtype.lower().removeprefix("torch.")
    dtype_bytes(name)
    return _CANONICAL_DTYPE.get(name, name)


@dataclass(slots=True, frozen=True)
class KVCapacity:
    """What a memory budget holds, in whole blocks (a partial block holds nothing)."""

    memory_bytes: int
    block_size: int
    bytes_per_block: int
    num_blocks: int
    num_tokens: int
    seq_len: int
    blocks_per_seq: int
    max_concurrency: int  # sequences of seq_len tokens that fit at once


@dataclass(slots=True, frozen=True)
class KVMemoryModel:
    """The shape of one model's KV cache and the dtype it is stored in.

    Invariants: every count is positive; ``num_attention_heads`` is a multiple of
    ``num_kv_heads`` (each KV head serves a whole group of query heads).
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for attr in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"{attr} must be positive, got {getattr(self, attr)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], dtype: str = "auto",
                       name: str | None = None) -> KVMemoryModel:
        """Read a HuggingFace ``config.json`` dict. ``dtype="auto"`` takes the config's
        ``torch_dtype`` (or ``dtype``), else float16."""
        if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
            config = {**config["text_config"], **{k: v for k, v in config.items()
                                                  if k in ("torch_dtype", "dtype")}}
        for key in ("num_hidden_layers", "num_attention_heads"):
            if key not in config:
                raise ValueError(f"model config has no {key!r}: not a decoder config this "
                                 "calculator understands")
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        head_dim = config.get("head_dim")
        if head_dim is None:
            if "hidden_size" not in config:
                raise ValueError("model config has neither 'head_dim' nor 'hidden_size'")
            head_dim = int(config["hidden_size"]) // num_heads
        if dtype == "auto":
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
        return cls(
            name=name or str(config.get("_name_or_path") or config.get("model_type") or "model"),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            dtype=dtype,
            max_model_len=config.get("max_position_embeddings"),
        )

    @classmethod
    def from_config_file(cls, path: str | Path, dtype: str = "auto") -> KVMemoryModel:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config {str(path)!r} does not exist")
        with path.open() as f:
            config = json.load(f)
        name = config.get("_name_or_path") or path.parent.name
        return cls.from_hf_config(config, dtype, name=name)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str = "auto") -> KVMemoryModel:
        """A model folder holding config.json, or a GGUF file (as ``LLM(model=...)`` takes)."""
        # gguf_config.is_gguf_file's test, not the function: importing pagellm.model imports torch
        if Path(model_dir).suffix.lower() == ".gguf" and Path(model_dir).is_file():
            return cls.from_gguf_file(model_dir, dtype)
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
        return cls.from_config_file(path, dtype)

    @classmethod
    def from_gguf_file(cls, path: str | Path, dtype: str = "auto") -> KVMemoryModel:
        """A GGUF file's metadata, read as the engine reads it (pagellm.model.gguf_config:
        this one imports torch and transformers). ``dtype="auto"`` is the dtype the file's
        weights load in (bfloat16 for the quantized types)."""
        from pagellm.model.gguf_config import load_gguf_config

        config = load_gguf_config(path).to_dict()
        return cls.from_hf_config(config, dtype, name=Path(path).name)

    @classmethod
    def from_preset(cls, preset: str, dtype: str = "auto") -> KVMemoryModel:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        return cls.from_hf_config(PRESETS[preset], dtype, name=preset)

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per (token, KV head) row: 8-bit caches store one, others none."""
        return KV_ROW_SCALE_BYTES if self.dtype_bytes == 1 else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one KV head of one layer, scale included."""
        return self.head_dim * self.dtype_bytes + self.scale_bytes

    @property
    def is_grouped_query(self) -> bool:
        return self.num_kv_heads < self.num_attention_heads

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def bytes_per_token_if_mha(self) -> int:
        """What a token would cost if every query head had its own K and V."""
        return 2 * self.num_layers * self.num_attention_heads * self.row_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def bytes_for(self, num_seqs: int, seq_len: int) -> int:
        """Exact KV bytes of num_seqs sequences of seq_len tokens (no block rounding)."""
        return num_seqs * seq_len * self.bytes_per_token

    def capacity(self, memory_bytes: int, block_size: int = 16,
                 seq_len: int | None = None) -> KVCapacity:
        """Blocks, tokens and concurrent sequences of ``seq_len`` tokens in ``memory_bytes``."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        seq_len = seq_len or self.max_model_len or 2048
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        per_block = self.bytes_per_block(block_size)
        num_blocks = memory_bytes // per_block
        blocks_per_seq = cdiv(seq_len, block_size)
        return KVCapacity(
            memory_bytes=memory_bytes, block_size=block_size, bytes_per_block=per_block,
            num_blocks=num_blocks, num_tokens=num_blocks * block_size, seq_len=seq_len,
            blocks_per_seq=blocks_per_seq, max_concurrency=num_blocks // blocks_per_seq,
        )
