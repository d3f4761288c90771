"""Lazy GGUF tensors for tensor parallelism: a rank dequantizes only its rows or columns.

A GGUF matrix is stored row after row (a torch row: GGUF's outer dimension), each row a run
of quantization blocks (``block_size`` values in ``type_size`` bytes; one value per element
for F32 and F16). So a range of rows is a slice of the reader's array, and a range of columns
is a slice of every row's bytes when it starts and ends on a block boundary (it does for the
usual models: the row-parallel layers split 4,096 or 14,336 columns in multiples of 256); a
range that does not is read as whole rows, then narrowed.

llama.cpp reorders the rows of Llama's q and k projections within each head
(gguf_loader.unpermute_qk); a rank's rows are whole heads, so the slice is un-reordered head
by head, which gives the rows of the un-reordered tensor.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class GGUFTensorSlice:
    """One GGUF tensor, read on indexing: ``[a:b]`` (rows), ``[:, a:b]`` (columns) or ``[:]``.

    ``num_heads``: the q/k projection's head count when llama.cpp reordered its rows."""

    def __init__(self, tensor: Any, dtype: torch.dtype, num_heads: int | None = None) -> None:
        self.tensor, self.dtype, self.num_heads = tensor, dtype, num_heads
        self.shape = [int(d) for d in reversed(tensor.shape.tolist())]  # torch's order

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        from pagellm.model.gguf_loader import dequantize, unpermute_qk

        index = index if isinstance(index, tuple) else (index,)
        rows = range(self.shape[0])[index[0]]
        columns = (range(self.shape[1])[index[1]] if len(index) > 1
                   else range(self.shape[1]) if len(self.shape) > 1 else None)
        whole_heads = self.num_heads is None or (
            rows.start % (self.shape[0] // self.num_heads) == 0
            and len(rows) % (self.shape[0] // self.num_heads) == 0)
        if rows.step != 1 or (columns is not None and columns.step != 1) or not whole_heads:
            return _whole(self, dequantize, unpermute_qk)[index]
        data = self.tensor.data[rows.start:rows.stop]
        narrow_after = None
        if columns is not None and len(columns) != self.shape[1]:
            data, narrow_after = _columns(data, self.tensor.tensor_type, columns)
        values = _dequantize_rows(self.tensor, data, len(rows), self.dtype, dequantize)
        if narrow_after is not None:
            values = values[:, narrow_after.start:narrow_after.stop]
        if self.num_heads is not None:
            values = unpermute_qk(values, len(rows) * self.num_heads // self.shape[0])
        return values.contiguous()


def _whole(lazy: GGUFTensorSlice, dequantize, unpermute_qk) -> torch.Tensor:
    values = dequantize(lazy.tensor, lazy.dtype)
    return unpermute_qk(values, lazy.num_heads) if lazy.num_heads else values


def _columns(data: np.ndarray, tensor_type: Any, columns: range) -> tuple[np.ndarray, range | None]:
    """The stored bytes (or elements) of ``columns`` of every row, when they fall on
    quantization blocks; else all of them, with the columns to keep afterwards."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    if data.dtype != np.uint8:  # F32 / F16: one element per value
        return data[:, columns.start:columns.stop], None
    if columns.start % block_size or len(columns) % block_size:
        return data, columns
    first, last = columns.start // block_size, columns.stop // block_size
    return data[:, first * type_size:last * type_size], None


def _dequantize_rows(tensor: Any, data: np.ndarray, num_rows: int, dtype: torch.dtype,
                     dequantize) -> torch.Tensor:
    """``dequantize`` (gguf_loader's, with its type check) on a part of the tensor's rows."""
    part = _TensorPart(tensor, data, num_rows)
    return dequantize(part, dtype)


class _TensorPart:
    """A reader tensor's stand-in holding some of its rows (and columns): what
    ``gguf_loader.dequantize`` reads (name, type, data, shape innermost first)."""

    def __init__(self, tensor: Any, data: np.ndarray, num_rows: int) -> None:
        import gguf

        self.name, self.tensor_type, self.data = tensor.name, tensor.tensor_type, data
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if data.ndim == 1:
            self.shape = np.array([num_rows])
        else:
            per_row = data.shape[1] if data.dtype != np.uint8 else (
                data.shape[1] // type_size * block_size)
            self.shape = np.array([per_row, num_rows])
