"""Model families, their layers and weight loading (safetensors, local folder or hub id)."""
from pagellm.model.decoder import CausalLM, DecoderSpec
from pagellm.model.loader import (
    ModelNotFoundError,
    get_tokenizer,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from pagellm.model.registry import MODEL_REGISTRY, get_model_class, supported_architectures

__all__ = ["CausalLM", "DecoderSpec", "ModelNotFoundError", "get_tokenizer", "load_model",
           "resolve_dtype", "resolve_model_path", "MODEL_REGISTRY", "get_model_class",
           "supported_architectures"]
