"""Copies of weight buffers as raw bits.

numpy copies an extension dtype (ml_dtypes' bfloat16 and float8 types, the serving dtypes here)
element by element through the dtype's own functions whenever a copy is not one plain
``memcpy``: ``np.array`` of a bfloat16 array, ``np.ascontiguousarray`` of a strided one, or a
strided assignment. Viewed as unsigned integers of the same size the same copies take numpy's
fast loops (measured, 2-core host, 2026-11-29, 168 MB of bfloat16: a strided assignment 0.28 ->
4.2 GB/s, ``np.array`` 0.51 -> 3.4 GB/s). A weight pull assembles trainer shards that are strided
in the server's buffers (an fsdp split along a weight's second axis), so these copies were most
of a direct pull's time (Qwen3-0.6B from two trainer processes: 8.7 of ~11 s in one assignment).
Equal bits are equal values, so copying bits is exact for every dtype, NaN payloads included.
"""

from __future__ import annotations

import numpy as np


def as_bits(x: np.ndarray) -> np.ndarray:
    """``x`` viewed as unsigned integers of its item size (same shape and strides, no copy)."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.itemsize in (1, 2, 4, 8) else x


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for two arrays of one dtype, by their bits."""
    if dst.dtype != src.dtype:
        raise ValueError(f"copy_into: {src.dtype} into {dst.dtype}")
    np.copyto(as_bits(dst), as_bits(src))


def contiguous(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``x`` (``x`` itself when it is one), by its bits."""
    return np.ascontiguousarray(as_bits(x)).view(x.dtype)
