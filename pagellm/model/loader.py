"""Find a model (local folder, GGUF file or Hugging Face Hub id), read its config, build it,
load weights.

Weights load by name through each parameter's ``weight_loader`` (see model/layers/linear.py):
the loader itself knows nothing about any family beyond ``packed_modules_mapping``. Only
safetensors are read unless pickled ``.bin`` files are explicitly allowed, because unpickling
a checkpoint can run arbitrary code.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagellm.distributed.parallel_state import (TensorParallelGroup, building,
                                                single_device_group)
from pagellm.model.decoder import CausalLM
from pagellm.model.gguf_config import is_gguf_file, load_gguf_config
from pagellm.model.layers import default_weight_loader
from pagellm.model.quantized_model import (check_supported, default_group_size, quantize_linear,
                                            quantize_linear_weights)
from pagellm.model.quantize_on_load import QuantizingLoad
from pagellm.model.registry import get_model_class

# What a hub download fetches: weights as safetensors, configs, tokenizer files.
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken",
                      "*.txt", "*.jinja"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


class ModelNotFoundError(FileNotFoundError):
    """A model folder, hub id or weight file could not be found or fetched."""


def resolve_model_path(model: str | Path, allow_download: bool = True) -> Path:
    """A local folder holding config.json (``model`` itself, or a hub snapshot of it), or a
    GGUF file.

    ``model`` is a folder or ``*.gguf`` file when it exists on disk, or looks like a path
    (absolute, ``./``, ``~``); otherwise it is taken as a hub id ("org/name") and fetched
    (safetensors, json and tokenizer files only) into the Hugging Face cache, which also serves
    it offline once cached.
    """
    path = Path(model).expanduser()
    if is_gguf_file(path):
        return path
    if path.is_file():
        raise ModelNotFoundError(f"model {str(path)!r} is a file but not a GGUF file (*.gguf); "
                                 "pass a model folder holding config.json or a .gguf file")
    if path.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
        return path
    text = str(model)
    if path.exists() or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ModelNotFoundError(f"model folder {text!r} does not exist")
    if not allow_download:
        raise ModelNotFoundError(f"model {text!r} is not a local folder and downloads are off; "
                                 "pass the path of a folder holding config.json and weights")
    return _download(text)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as exc:  # network down, offline mode, unknown or gated repo, bad id
        raise ModelNotFoundError(
            f"could not fetch model {repo_id!r} from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Without "
            f"network access, download it on another machine (hf download "
            f"{repo_id}) and pass the local folder instead, e.g. model='/path/to/folder'"
        ) from exc


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any,
                  device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" -> the checkpoint's dtype (float16 becomes bfloat16 on the CPU, where float16
    matmuls are slow and bfloat16 ones are fast; no dtype in the config means float32);
    "float32" / "bfloat16" / "float16" (or a torch.dtype) as given."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {list(DTYPES)}")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of "
                             f"{list(DTYPES)}")
        return DTYPES[dtype]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = DTYPES.get(config_dtype, None)
    if config_dtype not in DTYPES.values():
        return torch.float32
    if torch.device(device).type == "cpu" and config_dtype == torch.float16:
        return torch.bfloat16
    return config_dtype


def load_config(path: str | Path) -> Any:
    """The transformers config of a model folder (config.json) or of a GGUF file."""
    from transformers import AutoConfig

    if is_gguf_file(path):
        return load_gguf_config(path)
    return AutoConfig.from_pretrained(path)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu",
               allow_pickle: bool = False, pack_weights: bool = True,
               tp: TensorParallelGroup | None = None, quantization: str | None = None,
               quantization_group_size: int | None = None) -> tuple[CausalLM, Any]:
    """Build the model of the folder's config.json (or of a GGUF file) and load its weights:
    (model, hf_config). With a tensor-parallel group ``tp``: this rank's shard, reading only
    its rows and columns of each safetensors tensor.

    On the CPU the projections are then packed for oneDNN (CausalLM.pack_weights) unless
    ``pack_weights`` is False; with ``quantization`` ("int8", "int4") they are quantized
    instead, from the checkpoint's values as they stream in (model/quantize_on_load.py,
    model/layers/quantized_linear.py; one rank only); "gguf" (GGUF files only) takes the
    file's blocks as they are (gguf_loader.gguf_method). ``quantization_group_size`` None:
    quantized_model.default_group_size."""
    tp = tp or single_device_group()
    check_supported(quantization, torch.device(device), dtype)
    if quantization is not None and tp.world_size > 1:
        raise ValueError(f"quantization={quantization!r} is not supported with "
                         f"{tp.world_size} tensor-parallel ranks")
    if is_gguf_file(path):
        from pagellm.model.gguf_loader import load_gguf_model

        return load_gguf_model(path, dtype, device, pack_weights, tp, quantization,
                               quantization_group_size)
    path = Path(path)
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' takes a GGUF file's own quantized blocks; "
                         f"{str(path)!r} is not a .gguf file: use quantization='int8' or "
                         "'int4' to quantize its weights")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
    hf_config = load_config(path)
    files = weight_files(path, allow_pickle)
    model = build_model(hf_config, dtype, device, tp)
    weights = iterate_weights(files, lazy=tp.world_size > 1)
    if quantization is not None and quantization_group_size is None:
        quantization_group_size = default_group_size(model, from_gguf=False)
    if quantization is not None:  # from the stored values, not the copy in ``dtype``
        weights = QuantizingLoad(model, quantization, quantization_group_size).stream(weights)
    load_weights(model, weights)
    finish_weights(model, device, pack_weights, quantization, quantization_group_size)
    return model.eval(), hf_config


def finish_weights(model: CausalLM, device: torch.device | str, pack_weights: bool,
                   quantization: str | None, group_size: int) -> None:
    """After loading: quantize the projections not quantized while loading (from their
    loaded weight), or pack them for oneDNN on the CPU. With "gguf" the projections the file
    holds unquantized stay so (packed). A tied embedding then reads the head's int8 codes
    where they are its weight exactly (share_embedding_codes)."""
    if quantization is None:
        if pack_weights and torch.device(device).type == "cpu":
            model.pack_weights()
        return
    if quantization == "gguf":
        if pack_weights and torch.device(device).type == "cpu":
            model.pack_weights()
    else:
        shared = {id(model.lm_head.weight)} if model.tie_word_embeddings else set()
        if model.lm_head.quantized is None:  # the logits' matrix stays at 8 bits, as in llama.cpp
            model.lm_head.quantized = quantize_linear(model.lm_head, "int8", group_size)
            if not shared:
                model.lm_head.weight.data = torch.empty(0, dtype=model.lm_head.weight.dtype)
        quantize_linear_weights(model, quantization, group_size, shared)
    share_embedding_codes(model)


def share_embedding_codes(model: CausalLM) -> bool:
    """A tied embedding reads its rows from the vocabulary projection's int8 codes where
    they are its weight exactly (a GGUF file's Q8_0 token embedding), and its bfloat16 /
    float32 copy is released (54 MB of SmolLM2-135M's in bfloat16)."""
    from pagellm.model.layers.quantized_linear import Int8Weight

    embedding = getattr(model.model, "embed_tokens", None)
    codes = model.lm_head.quantized
    if not model.tie_word_embeddings or embedding is None or not isinstance(codes, Int8Weight):
        return False
    return embedding.share_codes(codes)


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                tp: TensorParallelGroup | None = None) -> CausalLM:
    """The model of ``hf_config``'s architecture (``tp``'s rank's shard of it), its parameters
    created in ``dtype`` on ``device`` (and left unset: a weight loader fills them)."""
    model_class = get_model_class(hf_config)
    with _default_dtype(dtype), torch.device(device), building(tp or single_device_group()):
        return model_class(hf_config)


def weight_files(path: Path, allow_pickle: bool = False) -> list[Path]:
    """The checkpoint's weight files: the shards of the safetensors index, or every
    ``*.safetensors``; ``*.bin`` only when ``allow_pickle``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} lists shards that are missing: {missing}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(path.glob("*.bin"))
    if pickled and not allow_pickle:
        raise ValueError(
            f"{str(path)!r} holds only pickled weights ({', '.join(p.name for p in pickled)}); "
            "unpickling can run arbitrary code, so they are refused. Convert them to "
            "safetensors, or pass allow_pickle=True (--allow-pickle-weights) if you trust them")
    if pickled:
        return pickled
    raise ModelNotFoundError(f"no weights (*.safetensors) in model folder {str(path)!r}")


def iterate_weights(files: Iterable[Path], lazy: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the files, one file open at a time. ``lazy``: a
    safetensors slice instead of the tensor, read by the weight loader (a tensor-parallel
    rank reads only its shard)."""
    from safetensors import safe_open

    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model by name; fused projections through their shard
    loaders. Raises ValueError on an unknown name and on any parameter (or shard) left unset,
    since a missing tensor would otherwise leave uninitialised memory in the model."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[str | int | None]] = {}
    for name, tensor in weights:
        if name.endswith(_IGNORED_WEIGHTS) or (name == "lm_head.weight"
                                               and model.tie_word_embeddings):
            continue
        target, shard_id = _target_of(name, model.packed_modules_mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                             f"{type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if shard_id is not None:
                loader(param, tensor, shard_id)
            elif loader is not None:
                loader(param, tensor)
            else:
                default_weight_loader(param, tensor)
        loaded.setdefault(target, set()).add(shard_id)
    _check_all_loaded(model, params, loaded)


def _target_of(name: str, mapping: dict[str, tuple[str, str | int]]
               ) -> tuple[str, str | int | None]:
    for checkpoint_name, (fused_name, shard_id) in mapping.items():
        if f".{checkpoint_name}." in name:
            return name.replace(f".{checkpoint_name}.", f".{fused_name}."), shard_id
    return name, None


def _check_all_loaded(model: nn.Module, params: dict[str, nn.Parameter],
                      loaded: dict[str, set[str | int | None]]) -> None:
    missing = []
    for name in params:
        shards = loaded.get(name)
        expected = getattr(model.get_submodule(name.rpartition(".")[0]), "shard_ids", None)
        if not shards or (None not in shards and expected and set(expected) - shards):
            missing.append(name)
    if missing:
        raise ValueError(f"the checkpoint lacks tensors for {len(missing)} parameter(s): "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` (no float32 copy of a bfloat16 model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_tokenizer(path: str | Path, **kwargs: Any) -> Any:
    """The model's tokenizer (with its chat template) through transformers.AutoTokenizer;
    a GGUF file's own tokenizer when ``path`` is one."""
    from transformers import AutoTokenizer

    if is_gguf_file(path):
        from pagellm.model.gguf_loader import get_gguf_tokenizer

        return get_gguf_tokenizer(path, **kwargs)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        folder = resolve_model_path(str(path))
    return AutoTokenizer.from_pretrained(folder, **kwargs)
