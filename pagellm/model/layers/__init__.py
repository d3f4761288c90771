"""Building blocks shared by the model families."""
from pagellm.model.layers.linear import (Linear, MergedLinear, QKVLinear, default_weight_loader,
                                        pack_linear_weights)
from pagellm.model.layers.norm import RMSNorm
from pagellm.model.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from pagellm.model.layers.rotary import RotaryEmbedding, rope_parameters

__all__ = ["Linear", "MergedLinear", "QKVLinear", "default_weight_loader", "pack_linear_weights",
           "ParallelLMHead", "RowParallelLinear", "VocabParallelEmbedding",
           "RMSNorm", "RotaryEmbedding", "rope_parameters"]
