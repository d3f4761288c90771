"""The layers that communicate under tensor parallelism (Megatron-LM's split, as in vLLM).

- ``RowParallelLinear`` (o_proj, down_proj): each rank holds the input columns that match its
  slice of the column-parallel layer before it (its heads, its part of the MLP), computes a
  partial product, and the ranks sum them (all-reduce); the bias is added once, after.
- ``VocabParallelEmbedding``: each rank holds a contiguous range of the vocabulary's rows;
  a token outside the range embeds as zeros, and the all-reduce leaves exactly the one
  rank's row (adding zeros is exact).
- ``ParallelLMHead``: the same vocabulary ranges as rows of the projection (so a tied head
  shares the embedding's shard); rank 0 gathers the logits of every range.

With one rank (``world_size == 1``) every layer is the plain one: same shapes, same calls.
The vocabulary is padded to a multiple of the ranks; the padding rows are zero and their
logits are cut off before anyone sees them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.parallel_state import current_group
from pagellm.model.layers.linear import Linear, default_weight_loader, narrow_loaded


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first token id, number of real rows, rows per rank incl. padding) of ``rank``."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


def _load_vocab_rows(param: nn.Parameter, loaded, world_size: int, start: int,
                     num_rows: int) -> None:
    if world_size == 1:
        default_weight_loader(param, loaded)
        return
    default_weight_loader(param.data.narrow(0, 0, num_rows),
                          narrow_loaded(loaded, 0, start, num_rows))
    param.data[num_rows:].zero_()


class RowParallelLinear(Linear):
    """y = all_reduce(x_rank @ W_rank^T) + b; W_rank: [out_features, in_features / ranks]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current_group()
        if in_features % self.tp.world_size:
            raise ValueError(f"tensor_parallel_size={self.tp.world_size} does not divide the "
                             f"{in_features} input features of a row-parallel projection")
        super().__init__(in_features // self.tp.world_size, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if self.tp.world_size > 1 and param is self.weight:
            loaded = narrow_loaded(loaded, 1, self.tp.rank * self.in_features,
                                   self.in_features)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        # x: [num_tokens, in_features / ranks] -> partial [num_tokens, out_features]
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows of this rank's vocabulary range ``[vocab_start, vocab_start + rows)``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = current_group()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_rows, per_rank = vocab_range(vocab_size, self.tp.rank,
                                                                self.tp.world_size)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.hidden_size = hidden_size
        # the tied head's int8 codes, read in place of the weight once share_codes found them
        # equal to it (the weight is then released)
        self.codes: nn.Module | None = None
        self.dtype = self.weight.dtype

    def share_codes(self, codes: nn.Module, chunk: int = 4096) -> bool:
        """Look rows up in ``codes`` (the tied vocabulary projection's Int8Weight, whose rows
        are this embedding's) and release the weight, if every row's dequantized codes equal
        the weight's row bit for bit: a GGUF file's Q8_0 embedding, which the weight holds
        dequantized, does; codes quantized from the weight (quantization="int8" or "int4" on
        a safetensors model) do not, and the weight stays. Returns whether it shared."""
        weight = self.weight.data
        if (codes.out_features, codes.in_features) != tuple(weight.shape):
            return False
        for start in range(0, weight.shape[0], chunk):
            index = torch.arange(start, min(start + chunk, weight.shape[0]))
            if not torch.equal(codes.rows(index, weight.dtype), weight[index]):
                return False
        object.__setattr__(self, "codes", codes)  # lm_head's submodule, not also this one's
        self.dtype = weight.dtype
        self.weight.data = torch.empty(0, dtype=weight.dtype)
        return True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.codes is None:
            return F.embedding(ids, self.weight)
        return self.codes.rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.hidden_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        _load_vocab_rows(param, loaded, self.tp.world_size, self.vocab_start, self.num_rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)  # [T, hidden_size]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        embedded = self._lookup(local.masked_fill(outside, 0))
        embedded.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(embedded)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, rows {self.vocab_start}.."
                f"{self.vocab_start + self.num_rows}, hidden={self.hidden_size}"
                + (", int8 codes of the tied head" if self.codes is not None else ""))


class ParallelLMHead(Linear):
    """logits = hidden @ W^T over this rank's vocabulary range; rank 0 gathers all ranges
    ([rows, vocab_size]), the other ranks return [rows, 0]."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp = current_group()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_rows, per_rank = vocab_range(vocab_size, self.tp.rank,
                                                                self.tp.world_size)
        super().__init__(hidden_size, per_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        _load_vocab_rows(param, loaded, self.tp.world_size, self.vocab_start, self.num_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)  # [rows, vocab rows of this rank]
        if self.tp.world_size == 1:
            return logits
        gathered = self.tp.gather_last_dim(logits)
        return gathered[:, :self.vocab_size]
