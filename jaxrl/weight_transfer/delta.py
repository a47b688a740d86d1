"""Deltas: which fixed-size blocks of a shard's bytes changed between two versions.

A version published as a delta names its base version (``Manifest.base_version``); a server
that holds exactly that base (same publisher lineage, same version) asks each endpoint for the
delta of every region it pulls: a bitmap of the region's ``block_bytes`` blocks (its row-major
bytes in the serving dtype, the last block possibly short) and the bytes of the changed blocks
only, which it writes over a copy of its own base bytes. Equal bytes are equal bits, so the
result is bitwise the new version whatever changed (a NaN's payload included).

Block size, measured (bench/weight_delivery.py ``changed_fraction`` lines: AdamW at lr 5e-4 on
a Qwen3-shaped model, bfloat16 served): an optimizer step changes nearly every element of the
weights a batch touches and none of the embedding rows of tokens it never saw, so whole tensors
change every step while 64 KiB blocks (32 rows of a 1024-wide embedding) skip the untouched
rows; smaller blocks save little more and cost a bigger bitmap and more, shorter sends.
"""

from __future__ import annotations

import numpy as np

from jaxrl.weight_transfer.bits import as_bits, contiguous

BLOCK_BYTES = 64 << 10
"""The default block: 64 KiB of a region's row-major bytes."""


def num_blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def changed_blocks(old: np.ndarray, new: np.ndarray, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """bool[num_blocks]: whether each ``block_bytes`` block of ``new``'s row-major bytes differs
    from ``old``'s (same shape and dtype; C-contiguous copies are made of strided views)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"changed_blocks: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")
    a, b = _flat_bytes(old), _flat_bytes(new)
    n = a.size
    full = n // block_bytes
    out = np.empty(num_blocks(n, block_bytes), bool)
    if full:
        head = full * block_bytes
        word = 8 if block_bytes % 8 == 0 else 1
        dt = np.uint64 if word == 8 else np.uint8
        out[:full] = (a[:head].view(dt) != b[:head].view(dt)).reshape(full, -1).any(axis=1)
    if full < out.size:
        out[full] = not np.array_equal(a[full * block_bytes :], b[full * block_bytes :])
    return out


def block_runs(bitmap: np.ndarray) -> list[tuple[int, int]]:
    """``(first block, block count)`` of each run of consecutive changed blocks, in order."""
    if not bitmap.any():
        return []
    edges = np.diff(np.concatenate(([0], bitmap.view(np.int8), [0])))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(a), int(b - a)) for a, b in zip(starts, stops, strict=True)]


def _flat_bytes(x: np.ndarray) -> np.ndarray:
    return as_bits(contiguous(x)).reshape(-1).view(np.uint8)
