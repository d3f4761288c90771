"""The model's own generation settings (``generation_config.json``), as vLLM reads them.

Model authors ship recommended sampling values (Qwen3: temperature 0.6, top_p 0.95, top_k 20)
and sometimes extra end-of-sequence tokens (Llama 3 Instruct ends a turn with ``<|eot_id|>``,
which is not the tokenizer's EOS). With ``generation_config="auto"`` (the default, as in vLLM)
the sampling values become the defaults of requests that do not set those fields;
``generation_config="vllm"`` keeps the engine's own defaults; a folder path reads that folder's
``generation_config.json`` instead of the model's. The extra EOS tokens end generation whichever
the setting, as in vLLM, because without them an instruct model talks past the end of its turn.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagellm")

# generation_config.json field -> SamplingParams field (vLLM's list, without max_new_tokens:
# a length default would cut answers the user expected to run to the context length).
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(slots=True, frozen=True)
class GenerationDefaults:
    """What a model's generation_config.json contributes to every request."""

    sampling: dict[str, Any]  # SamplingParams field -> default value
    eos_token_ids: frozenset[int]


def load_generation_defaults(model_path: str | Path, setting: str = "auto"
                             ) -> GenerationDefaults:
    """Read the generation config that ``setting`` names (see the module docstring).

    A GGUF file has no generation_config.json: it contributes nothing."""
    model_dir = Path(model_path)
    model_values = _read(model_dir) if model_dir.is_dir() else {}
    if setting == "auto":
        values = model_values
    elif setting == "vllm":
        values = {}
    else:
        folder = Path(setting).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config={setting!r} is invalid: must be 'auto', "
                             "'vllm' or a folder holding generation_config.json")
        values = model_values = _read(folder)
    sampling = {ours: values[theirs] for theirs, ours in SAMPLING_FIELDS.items()
                if values.get(theirs) is not None}
    if sampling:
        logger.info("default sampling parameters from generation_config.json: %s "
                    "(generation_config='vllm' turns them off)", sampling)
    return GenerationDefaults(sampling, _eos_ids(model_values.get("eos_token_id")))


def _read(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return {}


def _eos_ids(value: Any) -> frozenset[int]:
    if isinstance(value, int):
        return frozenset([value])
    if isinstance(value, (list, tuple)):
        return frozenset(int(t) for t in value)
    return frozenset()
