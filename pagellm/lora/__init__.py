"""LoRA adapters served beside one base model: many adapters in one batch.

``request.py`` (``LoRARequest``) is plain data and imports no torch, so that the engine core
can carry it; the loader, the slot cache and the layers (``adapter.py``, ``manager.py``,
``layers.py``, ``ops.py``) are the worker's.
"""
from pagellm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
