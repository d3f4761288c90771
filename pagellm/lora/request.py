"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields). Plain data."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``lora_int_id`` (>= 1) identifies the adapter in the engine: requests with the same id share
    its weights and their cached KV blocks; a different id never shares KV blocks with it. One
    id always names the same adapter (the engine refuses the same id with another name or path
    while it is registered).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: must be a non-empty "
                             "string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: must be an "
                             "integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} is invalid: must be a folder path")

    @property
    def cache_key(self) -> tuple:
        """The prefix-cache key of its KV blocks: KV computed under one adapter is never
        served to another (or to the base model)."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)
