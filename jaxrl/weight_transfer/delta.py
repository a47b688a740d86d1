"""Deltas: which fixed-size blocks of a shard's bytes changed between two versions.

A version published as a delta names its base version (``Manifest.base_version``); a server
that holds exactly that base (same publisher lineage, same version) asks each endpoint for the
delta of every region it pulls: which of the region's ``block_bytes`` blocks changed (its
row-major bytes in the serving dtype, the last block possibly short: a packed bitmap or the
blocks' indices, whichever is shorter: ``Changed``) and their bytes, one after another
(``gather_blocks``), which it writes over a copy of its own base bytes (``scatter_blocks``). Equal bytes are equal bits, so the result is bitwise the new version
whatever changed (a NaN's payload included).

A bitmap is packed (``np.packbits``, little bit order: block ``i`` is bit ``i % 8`` of byte
``i // 8``), as it goes on the wire and as the publisher keeps it, and every pass here walks it a
window of ``WINDOW_BLOCKS`` blocks at a time. Why windows: a whole-shard pass makes temporaries
the size of the shard (a bool per block, an index per changed block), and fresh memory is what a
pass pays most for: the kernel zero-fills each new page on first touch (0.5-0.9 GB/s on this
VM, 2026-11-29, against ~13 GB/s into pages already mapped), so ``old != new`` over Qwen3-0.6B's
1.19 GB of bfloat16 took 1.49 s, 1.3 s of it the new 596 MB bool array. A window's temporaries
are a few MB, which the allocator hands back from its heap window after window.

Block size: one element of the serving dtype by default (``Publisher(block_bytes=None)``).
Measured (bench/weight_delivery.py ``changed_fraction`` lines, AdamW on a Qwen3-shaped model,
bfloat16 served, 2026-11-29): at an LLM RL learning rate (1e-6 .. 3e-6) a step changes 2.7-10% of
the bfloat16 elements, scattered, so 99.99% of 64 KiB blocks hold one; by element the delta is the
bitmap (1/16 of the bytes) plus the changed elements: ~9-16% of a full copy. At the main recipe's
lr 5e-4 ~96% of elements change and a delta saves nothing at any block size. Larger blocks
(``block_bytes``) only pay where whole rows stay untouched (embedding rows of unseen tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from jaxrl.weight_transfer.bits import as_bits

WINDOW_BLOCKS = 1 << 20
"""Blocks per window (a multiple of 8, so a window starts on a bitmap byte): a 1 MB bool and at
most 8 MB of indices at a time."""


def num_blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def packed_size(blocks: int) -> int:
    """Bytes of a packed bitmap of ``blocks`` blocks."""
    return -(-blocks // 8)


def changed_blocks(old: np.ndarray, new: np.ndarray, block_bytes: int) -> np.ndarray:
    """The packed bitmap of which ``block_bytes`` blocks of ``new``'s row-major bytes differ from
    ``old``'s (same shape and dtype; C-contiguous copies are made of strided views)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"changed_blocks: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")
    a, b = _flat_bytes(old), _flat_bytes(new)
    n = a.size
    blocks, full = num_blocks(n, block_bytes), n // block_bytes
    out = np.zeros(packed_size(blocks), np.uint8)
    if full:
        dt = _word(block_bytes)
        x, y = a[: full * block_bytes].view(dt), b[: full * block_bytes].view(dt)
        per = x.size // full  # words per block
        for lo, hi in _windows(full):
            if per == 1:  # one word per block (an element of the serving dtype): the compare is the bitmap
                bits = np.not_equal(x[lo:hi], y[lo:hi])
            else:
                bits = (x[lo * per : hi * per] != y[lo * per : hi * per]).reshape(hi - lo, per).any(axis=1)
            out[lo // 8 : packed_size(hi)] = np.packbits(bits, bitorder="little")
    if full < blocks and not np.array_equal(a[full * block_bytes :], b[full * block_bytes :]):
        out[full // 8] |= np.uint8(1 << (full % 8))
    return out


def diff(old: np.ndarray, new: np.ndarray, block_bytes: int) -> tuple[Changed, np.ndarray]:
    """A region's delta from ``old`` to ``new`` (same shape and dtype): which blocks changed and
    their bytes in ``new`` (``gather_blocks``'s payload), as a publisher serves it.

    Blocks of 1, 2 or 4 bytes (an element of the serving dtype) are found a word at a time
    (``_sparse_diff``) while few change; otherwise, and for larger blocks, a bitmap pass then a
    gather."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"diff: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")
    a, b = _flat_bytes(old), _flat_bytes(new)
    blocks = num_blocks(a.size, block_bytes)
    if block_bytes in (1, 2, 4) and a.size % block_bytes == 0 and (sparse := _sparse_diff(a, b, block_bytes)):
        return sparse
    changed = Changed.of(changed_blocks(old, new, block_bytes), blocks)
    return changed, gather_blocks(b, changed, block_bytes)


def _sparse_diff(a: np.ndarray, b: np.ndarray, block_bytes: int) -> tuple[Changed, np.ndarray] | None:
    """``diff`` of small blocks by their indices, or None as soon as more change than an index
    list describes in fewer bytes than a bitmap (1/32 of the blocks).

    Two levels, a window at a time: which 8-byte words differ (one compare and one nonzero pass
    over a quarter as many bools as elements, for bfloat16), then which blocks within those
    words. At an RL learning rate 3-10% of bfloat16 words hold a changed element, so the second
    level reads a tenth of the data; the values come from the words already gathered. Measured
    (300M bfloat16 elements, 2.8% changed, in 3M-element shards): 0.27 s for the bitmap pass +
    indices + gather, 0.18 s here."""
    unit = _word(block_bytes)
    lanes, blocks = 8 // block_bytes, a.size // block_bytes
    if blocks > np.iinfo(INDEX).max:
        return None

    def bitmap_shorter(count: int) -> bool:  # Changed.of's choice
        return count * INDEX.itemsize + _COUNT.itemsize >= packed_size(blocks)

    words = a.size // 8
    wa, wb = a[: words * 8].view(np.uint64), b[: words * 8].view(np.uint64)
    indices, values, count = [], [], 0
    step = WINDOW_BLOCKS // lanes
    for lo in range(0, words, step):
        hi = min(lo + step, words)
        hit = np.flatnonzero(wa[lo:hi] != wb[lo:hi])
        if not hit.size:
            continue
        fresh = wb[lo:hi].take(hit)
        # The changed blocks: nonzero lanes (as bools first: numpy's nonzero is ~4x faster over bools).
        lane = np.flatnonzero((fresh ^ wa[lo:hi].take(hit)).view(unit) != 0)
        count += lane.size
        if bitmap_shorter(count):
            return None
        indices.append(((hit[lane // lanes] + lo) * lanes + lane % lanes).astype(INDEX))
        values.append(fresh.view(unit)[lane])
    first = words * lanes  # blocks past the last whole word
    if first < blocks:
        tail = np.flatnonzero(a[words * 8 :].view(unit) != b[words * 8 :].view(unit))
        count += tail.size
        if bitmap_shorter(count):
            return None
        indices.append((tail + first).astype(INDEX))
        values.append(b[words * 8 :].view(unit)[tail])
    changed = Changed(blocks, indices=np.concatenate(indices) if indices else np.zeros(0, INDEX))
    payload = np.concatenate(values).view(np.uint8) if values else np.zeros(0, np.uint8)
    return changed, payload


def count_changed(packed: np.ndarray) -> int:
    """How many blocks a packed bitmap marks."""
    return int(np.bitwise_count(packed).sum(dtype=np.int64))


def all_changed(blocks: int) -> np.ndarray:
    """The packed bitmap marking every one of ``blocks`` blocks."""
    out = np.full(packed_size(blocks), 0xFF, np.uint8)
    if blocks % 8:
        out[-1] = (1 << (blocks % 8)) - 1
    return out


INDEX = np.dtype("<u4")
"""A changed block's index on the wire."""
_COUNT = np.dtype("<u8")
BITMAP, INDICES = 0, 1
"""How a delta names its changed blocks on the wire (``Changed.encode``)."""


@dataclass(frozen=True)
class Changed:
    """Which of a region's ``blocks`` blocks changed: a packed bitmap (1/8 byte a block) or their
    ascending indices (``INDEX``, 4 bytes a changed block), whichever is the shorter description,
    as a delta carries it. Indices win below 1/32 of the blocks changed: an int8 server's delta
    (0.14-0.29% of its values move a step at an RL learning rate, bench/weight_delivery.py
    ``int8_values``) is then ~1/30 of its bitmap's bytes, and the server scatters without first
    turning a bitmap into indices."""

    blocks: int
    packed: np.ndarray | None = None
    indices: np.ndarray | None = None

    @classmethod
    def of(cls, packed: np.ndarray, blocks: int) -> Changed:
        """From a packed bitmap of ``blocks`` blocks, kept in the shorter description."""
        count = count_changed(packed)
        if blocks <= np.iinfo(INDEX).max and count * INDEX.itemsize + _COUNT.itemsize < packed_size(blocks):
            parts = [rows.astype(INDEX) for rows in _bitmap_rows(packed, blocks)]
            return cls(blocks, indices=np.concatenate(parts) if parts else np.zeros(0, INDEX))
        return cls(blocks, packed=packed)

    @property
    def count(self) -> int:
        return count_changed(self.packed) if self.packed is not None else int(self.indices.size)  # type: ignore[union-attr]

    def marks(self, block: int) -> bool:
        """Whether ``block`` changed (used for the last, possibly short, block)."""
        if self.packed is not None:
            return bool(self.packed[block // 8] >> (block % 8) & 1)
        assert self.indices is not None
        i = int(np.searchsorted(self.indices, block))
        return i < self.indices.size and int(self.indices[i]) == block

    def windows(self) -> Iterator[np.ndarray]:
        """The changed blocks' indices, ascending, a window of at most ``WINDOW_BLOCKS`` at a time."""
        if self.packed is not None:
            yield from _bitmap_rows(self.packed, self.blocks)
            return
        assert self.indices is not None
        for lo in range(0, self.indices.size, WINDOW_BLOCKS):
            yield self.indices[lo : lo + WINDOW_BLOCKS]

    def encode(self) -> list[np.ndarray]:
        """The description as it goes on the wire (before the blocks' bytes): ``u8`` kind, then the
        packed bitmap (``BITMAP``), or ``u64`` count and the indices (``INDICES``)."""
        if self.packed is not None:
            return [np.array([BITMAP], np.uint8), self.packed]
        assert self.indices is not None
        return [np.array([INDICES], np.uint8), np.array([self.indices.size], _COUNT).view(np.uint8),
                self.indices.view(np.uint8)]  # fmt: skip

    @classmethod
    def decode(cls, read: Callable[[int], bytes], blocks: int) -> Changed:
        """``encode``'s description read back (``read(n)``: the next n bytes); raises
        ``ValueError`` for one that does not describe ``blocks`` blocks (an unknown kind, indices
        out of range or not ascending)."""
        kind = read(1)[0]
        if kind == BITMAP:
            return cls(blocks, packed=np.frombuffer(read(packed_size(blocks)), np.uint8))
        if kind != INDICES:
            raise ValueError(f"unknown delta kind {kind}")
        count = int(np.frombuffer(read(_COUNT.itemsize), _COUNT)[0])
        if count > blocks:
            raise ValueError(f"a delta of {count} changed blocks in a region of {blocks}")
        rows = np.frombuffer(read(count * INDEX.itemsize), INDEX) if count else np.zeros(0, INDEX)
        if rows.size and (int(rows[-1]) >= blocks or not np.all(rows[1:] > rows[:-1])):
            raise ValueError("a delta's block indices are out of range or not ascending")
        return cls(blocks, indices=rows)


def delta_payload_bytes(changed: Changed, nbytes: int, block_bytes: int) -> int:
    """Bytes of the changed blocks in a region of ``nbytes`` (the last block may be short): what
    follows their description in a delta."""
    full = nbytes // block_bytes
    if full < changed.blocks and changed.marks(full):
        return (changed.count - 1) * block_bytes + nbytes - full * block_bytes
    return changed.count * block_bytes


def gather_blocks(flat: np.ndarray, changed: Changed, block_bytes: int) -> np.ndarray:
    """The bytes of the changed blocks of ``flat`` (C-contiguous uint8), one after another in one
    buffer: a vectorised gather, so a delta of millions of scattered elements is one numpy pass
    and one send, not a send per run. By index (``take``), not by boolean mask: 3x faster for
    scattered elements (measured, 150M bf16 elements, 3% changed: 0.69 -> 0.18 s)."""
    full = flat.size // block_bytes
    out = np.empty(delta_payload_bytes(changed, flat.size, block_bytes), np.uint8)
    at = 0
    if full:
        blocks = _blocks(flat, full, block_bytes)
        for rows in changed.windows():
            part = blocks.take(rows[rows < full], axis=0).reshape(-1).view(np.uint8)
            out[at : at + part.size] = part
            at += part.size
    out[at:] = flat[full * block_bytes :][: out.size - at]
    return out


def scatter_blocks(dst: np.ndarray, changed: Changed, block_bytes: int, payload: np.ndarray) -> None:
    """Write ``gather_blocks``'s ``payload`` back over the changed blocks of ``dst``'s row-major
    bytes. ``dst`` may be a strided view (a trainer shard's region inside a server's buffer) when
    a block is one element: the changed elements are written through it by their memory offsets
    (``_runs``), so the region is never copied out and back (two strided copies of the
    whole region, most of a delta pull's time before: Qwen3-0.6B from two fsdp trainer processes)."""
    if dst.flags.c_contiguous:
        _scatter_flat(dst.reshape(-1).view(np.uint8), changed, block_bytes, payload)
        return
    if block_bytes != dst.itemsize:
        raise ValueError(f"scatter_blocks: a strided destination takes blocks of one element ({dst.itemsize} bytes), not {block_bytes}")
    bits, at = as_bits(dst), 0
    values = payload.view(bits.dtype)
    runs = _runs(bits)
    for rows in changed.windows():
        part = values[at : at + rows.size]
        if runs is not None:
            span, starts, inner = runs
            span[_offsets(rows, starts, inner)] = part
        else:
            bits[np.unravel_index(rows, bits.shape)] = part
        at += rows.size


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """A strided view as runs of contiguous memory (a trainer shard's region of a server buffer:
    e.g. stacked layers [L, rows, cols] split on rows make L runs of rows x cols): a 1-D view of
    the memory from its first element to its last, each run's start in it (elements) and the
    run length. Writing the changed elements through the span by offset is ~3x faster than
    ``np.unravel_index`` and N-d indexing. None unless the last axis is contiguous."""
    item = x.itemsize
    if x.ndim == 0 or x.size == 0 or x.strides[-1] != item or any(st % item or st < 0 for st in x.strides):
        return None
    shape, strides = list(x.shape), [st // item for st in x.strides]
    inner = shape.pop()
    strides.pop()
    while shape and strides[-1] == inner:  # the axis's steps are whole runs: merge it into the run
        inner *= shape.pop()
        strides.pop()
    starts = np.zeros(1, np.int64)
    for n, st in zip(shape, strides):  # row-major: the last outer axis varies fastest
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    length = int(starts[-1]) + inner
    return np.lib.stride_tricks.as_strided(x, shape=(length,), strides=(item,)), starts, inner


def _offsets(rows: np.ndarray, starts: np.ndarray, inner: int) -> np.ndarray:
    """Span offsets of the region's elements ``rows`` (ascending): each one's run start plus its
    place in the run. With fewer runs than elements, each run's shift is repeated over its
    elements (found by ``searchsorted``), two passes instead of a division and a remainder per
    element (Qwen3-0.6B's delta pull: the scatter 2x faster)."""
    if starts.size == 1:
        return rows + starts[0]
    if starts.size > rows.size:
        return starts.take(rows // inner) + rows % inner
    shift = starts - np.arange(starts.size, dtype=np.int64) * inner
    # Run boundaries in the rows' own dtype: an int64 needle made numpy convert all of ``rows``.
    bounds = np.searchsorted(rows, (np.arange(starts.size + 1, dtype=np.int64) * inner).astype(rows.dtype))
    return rows + np.repeat(shift, np.diff(bounds))


def _scatter_flat(flat: np.ndarray, changed: Changed, block_bytes: int, payload: np.ndarray) -> None:
    full = flat.size // block_bytes
    at = 0
    if full:
        blocks = _blocks(flat, full, block_bytes)
        for rows in changed.windows():
            rows = rows[rows < full]
            n = rows.size * block_bytes
            blocks[rows] = payload[at : at + n].view(blocks.dtype).reshape(rows.size, *blocks.shape[1:])
            at += n
    if full < changed.blocks and changed.marks(full):
        flat[full * block_bytes :] = payload[at:]


def _windows(blocks: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, blocks, WINDOW_BLOCKS):
        yield lo, min(lo + WINDOW_BLOCKS, blocks)


def _bitmap_rows(packed: np.ndarray, blocks: int) -> Iterator[np.ndarray]:
    """The indices of the blocks a packed bitmap marks, a window at a time."""
    for lo, hi in _windows(blocks):
        bits = np.unpackbits(packed[lo // 8 : packed_size(hi)], count=hi - lo, bitorder="little")
        rows = np.flatnonzero(bits.view(bool))  # as bool: 4x faster than over uint8 (0/1 bytes: no copy)
        if rows.size:
            yield rows + lo


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
