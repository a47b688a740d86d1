"""Deltas: which fixed-size blocks of a shard's bytes changed between two versions.

A version published as a delta names its base version (``Manifest.base_version``); a server
that holds exactly that base (same publisher lineage, same version) asks each endpoint for the
delta of every region it pulls: a bitmap of the region's ``block_bytes`` blocks (its row-major
bytes in the serving dtype, the last block possibly short) and the bytes of the changed blocks,
packed one after another (``gather_blocks``), which it writes over a copy of its own base bytes
(``scatter_blocks``). Equal bytes are equal bits, so the result is bitwise the new version
whatever changed (a NaN's payload included).

Block size: one element of the serving dtype by default (``Publisher(block_bytes=None)``).
Measured (bench/weight_delivery.py ``changed_fraction`` lines, AdamW on a Qwen3-shaped model,
bfloat16 served, 2026-11-29): at an LLM RL learning rate (1e-6 .. 3e-6) a step changes 2.7-10% of
the bfloat16 elements, scattered, so 99.99% of 64 KiB blocks hold one; by element the delta is the
bitmap (1/16 of the bytes) plus the changed elements: ~9-16% of a full copy. At the main recipe's
lr 5e-4 ~96% of elements change and a delta saves nothing at any block size. Larger blocks
(``block_bytes``) only pay where whole rows stay untouched (embedding rows of unseen tokens).
"""

from __future__ import annotations

import numpy as np

from jaxrl.weight_transfer.bits import as_bits


def num_blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def changed_blocks(old: np.ndarray, new: np.ndarray, block_bytes: int) -> np.ndarray:
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
        dt = _word(block_bytes)
        x, y = a[:head].view(dt), b[:head].view(dt)
        if x.size == full:  # one word per block (an element of the serving dtype): the compare is the bitmap
            np.not_equal(x, y, out=out[:full])
        else:
            out[:full] = (x != y).reshape(full, -1).any(axis=1)
    if full < out.size:
        out[full] = not np.array_equal(a[full * block_bytes :], b[full * block_bytes :])
    return out


def delta_payload_bytes(bits: np.ndarray, nbytes: int, block_bytes: int) -> int:
    """Bytes of the changed blocks that ``bits`` marks in a region of ``nbytes`` (the last block
    may be short): what follows the packed bitmap in a delta reply."""
    full = nbytes // block_bytes
    return int(bits[:full].sum()) * block_bytes + (
        nbytes - full * block_bytes if full < bits.size and bits[full] else 0
    )


def gather_blocks(flat: np.ndarray, bits: np.ndarray, block_bytes: int) -> np.ndarray:
    """The bytes of the blocks ``bits`` marks in ``flat`` (C-contiguous uint8), one after
    another in one buffer: a vectorised gather, so a delta of millions of scattered elements is
    one numpy pass and one send, not a send per run. By index (``flatnonzero``, then ``take``),
    not by boolean mask: 3x faster for scattered elements (measured, 150M bf16 elements, 3%
    changed: 0.69 -> 0.18 s)."""
    full = flat.size // block_bytes
    parts = []
    if full:
        rows = np.flatnonzero(bits[:full])
        parts.append(_blocks(flat, full, block_bytes).take(rows, axis=0).reshape(-1).view(np.uint8))
    if full < bits.size and bits[full]:
        parts.append(flat[full * block_bytes :])
    if not parts:
        return np.zeros(0, np.uint8)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def scatter_blocks(flat: np.ndarray, bits: np.ndarray, block_bytes: int, payload: np.ndarray) -> None:
    """Write ``gather_blocks``'s ``payload`` back over the blocks ``bits`` marks in ``flat``."""
    full = flat.size // block_bytes
    rows = np.flatnonzero(bits[:full])
    head = rows.size * block_bytes
    if rows.size:
        blocks = _blocks(flat, full, block_bytes)
        blocks[rows] = payload[:head].view(blocks.dtype).reshape(rows.size, *blocks.shape[1:])
    if full < bits.size and bits[full]:
        flat[full * block_bytes :] = payload[head:]


def _blocks(flat: np.ndarray, full: int, block_bytes: int) -> np.ndarray:
    """``flat``'s ``full`` whole blocks as words: 1-D when a block is one word (an element), else
    one row of words per block."""
    words = flat[: full * block_bytes].view(_word(block_bytes))
    return words if words.size == full else words.reshape(full, -1)


def _word(block_bytes: int) -> type[np.unsignedinteger]:
    """The widest unsigned integer whose size divides ``block_bytes``: blocks compared and copied
    as whole words, not byte by byte."""
    return next(
        w for w in (np.uint64, np.uint32, np.uint16, np.uint8) if block_bytes % np.dtype(w).itemsize == 0
    )


def _flat_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(as_bits(x)).reshape(-1).view(np.uint8)
