"""Deltas: which fixed-size blocks of a shard's bytes changed between two versions.

A version published as a delta names its base version (``Manifest.base_version``); a server
that holds exactly that base (same publisher lineage, same version) asks each endpoint for the
delta of every region it pulls: which of the region's ``block_bytes`` blocks changed (its
row-major bytes in the serving dtype, the last block possibly short: a packed bitmap or the
blocks' indices as varint gaps, whichever is shorter: ``Changed``) and their bytes, one after
another (``gather_blocks``), which it writes over its own base bytes (``scatter_blocks``: in a
buffer that holds them, or copied in from the base in the same pass, ``Patch``). Equal bytes
are equal bits, so the result is bitwise the new version whatever changed (a NaN's payload
included). The per-element loops are compiled (``delta_loops``, which says why).

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
the bfloat16 elements, scattered, so 99.99% of 64 KiB blocks hold one; by element the delta is
the changed elements and ~1 byte of gap each: ~4-15% of a full copy. At the main recipe's
lr 5e-4 ~96% of elements change and a delta saves nothing at any block size. Larger blocks
(``block_bytes``) only pay where whole rows stay untouched (embedding rows of unseen tokens).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from jaxrl.weight_transfer.bits import as_bits, copy_into
from jaxrl.weight_transfer.manifest import Box

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
    """``diff`` of small blocks by their indices, or None as soon as more change than the bitmap
    has bytes (1/8 of the blocks: their gaps are then no shorter a description, ``Changed``).

    One compiled pass over the shard's 8-byte words (``delta_loops.changed_lanes``: which words
    differ, then which blocks within them), writing the indices and values of what changed and
    nothing else. Measured (2-core host, 2026-11-30, 300M bfloat16 elements, 2.8% changed): the
    numpy version of the same two levels (``!=``, ``flatnonzero``, ``take``s per window) took
    0.2 s, this one 0.10 s."""
    unit = _word(block_bytes)
    blocks = a.size // block_bytes
    if blocks > np.iinfo(INDEX).max:
        return None
    limit = packed_size(blocks) - 1  # Changed.of's choice
    words = a.size // 8
    # Room for what a round of the loop may write past ``limit``; pages never written cost nothing.
    room = limit + 8 // block_bytes * _loops().CHUNK_WORDS
    rows, values = np.empty(room, INDEX), np.empty(room, unit)
    count = _loops().changed_lanes(
        a[: words * 8].view(np.uint64), b[: words * 8].view(np.uint64), 8 * block_bytes, limit, rows, values
    )
    if count < 0:
        return None
    first = words * (8 // block_bytes)  # blocks past the last whole word
    if first < blocks:
        tail = np.flatnonzero(a[words * 8 :].view(unit) != b[words * 8 :].view(unit))
        if count + tail.size > limit:
            return None
        rows[count : count + tail.size] = tail + first
        values[count : count + tail.size] = b[words * 8 :].view(unit)[tail]
        count += tail.size
    return Changed(blocks, indices=rows[:count]), values[:count].view(np.uint8)


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
"""A changed block's index as a delta keeps it."""
_COUNT = np.dtype("<u8")
BITMAP, GAPS = 0, 2
"""How a delta names its changed blocks on the wire (``Changed.encode``)."""


@dataclass(frozen=True)
class Changed:
    """Which of a region's ``blocks`` blocks changed: a packed bitmap (1/8 byte a block) or their
    ascending indices, as a delta carries it. On the wire the indices go as varint gaps
    (``delta_loops.encode_gaps``, ~1 byte a changed block at an RL learning rate's 3%), or as the
    bitmap when that is shorter (above ~1/8 of the blocks changed): ``encode``. Indices are what
    a sparse delta is kept as: an int8 server's delta (0.14-0.29% of its values move a step,
    bench/weight_delivery.py ``int8_values``) is then ~1/40 of its bitmap's bytes, and the server
    scatters without first turning a bitmap into indices."""

    blocks: int
    packed: np.ndarray | None = None
    indices: np.ndarray | None = None

    @classmethod
    def of(cls, packed: np.ndarray, blocks: int) -> Changed:
        """From a packed bitmap of ``blocks`` blocks: as indices when few changed (fewer than
        the bitmap's bytes: their gaps may then be the shorter description)."""
        count = count_changed(packed)
        if blocks <= np.iinfo(INDEX).max and count < packed_size(blocks):
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

    def spans(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(begin, end, rows)``: consecutive ranges of blocks covering all ``blocks``, each with
        the changed blocks in it (ascending): the index list as one range, a bitmap a window at a
        time (``patch_runs`` copies every block of a range, changed or not)."""
        if self.indices is not None:
            yield 0, self.blocks, self.indices
            return
        assert self.packed is not None
        yield from _bitmap_spans(self.packed, self.blocks)

    def encode(self) -> list[np.ndarray]:
        """The description as it goes on the wire (before the blocks' bytes): ``u8`` kind, then the
        packed bitmap (``BITMAP``), or ``u64`` count, ``u64`` length and the indices' varint gaps
        (``GAPS``), whichever is shorter."""
        if self.indices is not None:
            gaps = np.empty(5 * self.indices.size, np.uint8)  # pages never written cost nothing
            n = _loops().encode_gaps(self.indices, gaps)
            if n + 2 * _COUNT.itemsize < packed_size(self.blocks):
                head = np.array([self.indices.size, n], _COUNT).view(np.uint8)
                return [np.array([GAPS], np.uint8), head, gaps[:n]]
        return [np.array([BITMAP], np.uint8), self.bitmap()]

    def bitmap(self) -> np.ndarray:
        """The packed bitmap of the changed blocks."""
        if self.packed is not None:
            return self.packed
        assert self.indices is not None
        bits = np.zeros(self.blocks, bool)
        bits[self.indices] = True
        return np.packbits(bits, bitorder="little")

    @classmethod
    def decode(cls, read: Callable[[int], bytes], blocks: int) -> Changed:
        """``encode``'s description read back (``read(n)``: the next n bytes); raises
        ``ValueError`` for one that does not describe ``blocks`` blocks (an unknown kind, more
        rows than blocks, gaps that do not add up)."""
        kind = read(1)[0]
        if kind == BITMAP:
            return cls(blocks, packed=np.frombuffer(read(packed_size(blocks)), np.uint8))
        if kind != GAPS:
            raise ValueError(f"unknown delta kind {kind}")
        count, n = (int(v) for v in np.frombuffer(read(2 * _COUNT.itemsize), _COUNT))
        if count > blocks or n > 5 * count:
            raise ValueError(f"a delta of {count} changed blocks in {n} bytes for a region of {blocks}")
        rows = np.empty(count, INDEX)
        if not _loops().decode_gaps(np.frombuffer(read(n), np.uint8) if n else np.zeros(0, np.uint8), blocks, rows):
            raise ValueError("a delta's block gaps do not describe ascending blocks of its region")
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


@dataclass(frozen=True)
class Patch:
    """Where a delta pull writes one region: ``out`` ends up with the new version's bytes, the
    base's with the changed blocks written over them. ``base``: the base's bytes of the region
    (same shape and dtype) when ``out`` does not hold them yet, copied in the same pass that
    writes the changed blocks (``scatter_blocks``); None when ``out`` holds them already (a
    server's staging buffer that held the base)."""

    out: np.ndarray
    base: np.ndarray | None = None
    later: list[tuple[np.ndarray, Changed, np.ndarray]] | None = None
    """When given, the region's delta is appended there (``out``, which blocks changed, their
    bytes) instead of written, to be written with the other regions of its buffer in one pass
    (``write_regions``)."""

    @property
    def nbytes(self) -> int:
        return self.out.nbytes

    def write(self, changed: Changed, block_bytes: int, payload: np.ndarray) -> None:
        """The region's delta, as it arrived: written over the base now, or kept in ``later``."""
        if self.later is not None:
            self.later.append((self.out, changed, payload))
        else:
            scatter_blocks(self.out, changed, block_bytes, payload, self.base)


def scatter_blocks(
    dst: np.ndarray, changed: Changed, block_bytes: int, payload: np.ndarray, base: np.ndarray | None = None
) -> None:
    """Write ``gather_blocks``'s ``payload`` over the changed blocks of ``dst``'s row-major bytes,
    which hold the base's bytes, or are given them from ``base`` in the same pass (``Patch``).

    ``dst`` may be a strided view (a trainer shard's region inside a server's buffer) when a
    block is one element: the elements are written through it by their memory offsets (runs of
    contiguous memory, ``_runs``; ``delta_loops``), so the region is never copied out and back
    (two strided copies of the whole region, most of a delta pull's time before: Qwen3-0.6B from
    two fsdp trainer processes)."""
    bits = as_bits(dst)
    runs = _runs(bits) if block_bytes == dst.itemsize else None
    base_span = None
    if base is not None:
        if base.shape != dst.shape or base.dtype != dst.dtype:
            raise ValueError(f"scatter_blocks: base {base.dtype}{list(base.shape)} for {dst.dtype}{list(dst.shape)}")
        same = _runs(as_bits(base)) if runs is not None else None
        if same is not None and same[2] == runs[2] and np.array_equal(same[1], runs[1]):  # type: ignore[index]
            base_span = same[0]
        else:  # another layout of memory: copy it first
            copy_into(dst, base)
    if runs is None:
        if dst.flags.c_contiguous:
            _scatter_flat(dst.reshape(-1).view(np.uint8), changed, block_bytes, payload)
            return
        if block_bytes != dst.itemsize:
            raise ValueError(f"scatter_blocks: a strided destination takes blocks of one element ({dst.itemsize} bytes), not {block_bytes}")
        at, values = 0, payload.view(bits.dtype)
        for rows in changed.windows():  # a last axis that is not contiguous: never a server buffer's
            bits[np.unravel_index(rows, bits.shape)] = values[at : at + rows.size]
            at += rows.size
        return
    span, starts, inner = runs
    at, values = 0, payload.view(bits.dtype)
    for begin, end, rows in changed.spans():
        part = values[at : at + rows.size]
        if base_span is None:
            _loops().scatter_runs(span, starts, inner, rows, part)
        else:
            _loops().patch_runs(span, base_span, starts, inner, begin, end, rows, part)
        at += rows.size


def write_regions(
    buf: np.ndarray, base: np.ndarray, parts: list[tuple[np.ndarray, Changed, np.ndarray]], block_bytes: int
) -> None:
    """``buf`` (C-contiguous) made the new version: ``base``'s bytes (same shape and dtype) with the
    deltas of ``parts`` written over them: (a region of ``buf``, which of its blocks changed,
    their bytes), regions that cover ``buf``. One pass over ``buf`` where a block is one element
    (``delta_loops.patch_regions``), else a copy and then each region's scatter."""
    bits = as_bits(buf)
    runs = [_runs(as_bits(out)) for out, _, _ in parts]
    if (
        not parts
        or block_bytes != buf.itemsize
        or any(r is None for r in runs)
        or not (buf.flags.c_contiguous and base.flags.c_contiguous)
        or base.shape != buf.shape
        or base.dtype != buf.dtype
        or not all(c.blocks <= np.iinfo(INDEX).max for _, c, _ in parts)
    ):
        copy_into(buf, base)
        for out, changed, payload in parts:
            scatter_blocks(out, changed, block_bytes, payload)
        return
    at = [(out.ctypes.data - buf.ctypes.data) // buf.itemsize for out, _, _ in parts]
    starts = tuple(r[1] + a for r, a in zip(runs, at, strict=True))  # type: ignore[index]
    inners = np.array([r[2] for r in runs], np.int64)  # type: ignore[index]
    # One array type for every region (the compiled loop indexes the tuples at run time): C-contiguous
    # and writable (a read-only array is another numba type).
    rows = tuple(
        np.require(c.indices if c.indices is not None else np.concatenate([*c.windows(), np.zeros(0, INDEX)]), INDEX, "CW")
        for _, c, _ in parts
    )
    values = tuple(np.require(p.view(bits.dtype), None, "CW") for _, _, p in parts)
    _loops().patch_regions(bits.reshape(-1), as_bits(base).reshape(-1), starts, inners, rows, values)


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """A strided view as runs of contiguous memory (a trainer shard's region of a server buffer:
    e.g. stacked layers [L, rows, cols] split on rows make L runs of rows x cols): a 1-D view of
    the memory from its first element to its last, each run's start in it (elements) and the
    run length, as ``delta_loops.scatter_runs`` writes through them. None unless the last axis
    is contiguous."""
    item = x.itemsize
    if x.ndim == 0 or x.size == 0 or x.strides[-1] != item or any(st % item or st < 0 for st in x.strides):
        return None
    starts, inner = _run_starts(list(x.shape), [st // item for st in x.strides])
    length = int(starts[-1]) + inner
    return np.lib.stride_tricks.as_strided(x, shape=(length,), strides=(item,)), starts, inner


def _run_starts(shape: list[int], strides: list[int]) -> tuple[np.ndarray, int]:
    """Where each run of an array of ``shape`` with ``strides`` (elements; the last 1) starts,
    from its first element, and the run length."""
    inner = shape.pop()
    strides.pop()
    while shape and strides[-1] == inner:  # the axis's steps are whole runs: merge it into the run
        inner *= shape.pop()
        strides.pop()
    starts = np.zeros(1, np.int64)
    for n, st in zip(shape, strides, strict=True):  # row-major: the last outer axis varies fastest
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    return starts, inner


def element_offsets(within: Box, parts: list[tuple[Box, Changed]]) -> np.ndarray:
    """The changed elements of regions of a row-major array holding ``within`` as offsets into
    it, region after region (``int32``; each region's ascending): where a server scatters a
    delta on its device (``puller``). ``parts``: (a region inside ``within``, its changed
    elements)."""
    shape = [b - a for a, b in within]
    strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    out = np.empty(sum(c.count for _, c in parts), np.int32)
    at = 0
    for region, changed in parts:
        first = sum((r[0] - w[0]) * st for r, w, st in zip(region, within, strides, strict=True))
        starts, inner = _run_starts([b - a for a, b in region], list(strides))
        for rows in changed.windows():
            _loops().run_offsets(starts + first, inner, rows, out[at : at + rows.size])
            at += rows.size
    return out


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


@functools.cache
def _loops() -> ModuleType:
    """The compiled loops (``delta_loops``, numba), imported when a delta is first made or
    applied: importing this package (the engine does) needs no numba, so a host that never
    makes a delta runs without it (the accelerator check's offline install leaves its 60 MB out:
    docs/accelerator.md)."""
    try:
        return importlib.import_module("jaxrl.weight_transfer.delta_loops")
    except ImportError as e:
        raise ImportError(f"weight deltas need numba, a jaxrl dependency missing here ({e}): pip install 'numba>=0.62'") from e


def _windows(blocks: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, blocks, WINDOW_BLOCKS):
        yield lo, min(lo + WINDOW_BLOCKS, blocks)


def _bitmap_spans(packed: np.ndarray, blocks: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """Each window of a packed bitmap's blocks and the indices of those it marks."""
    for lo, hi in _windows(blocks):
        bits = np.unpackbits(packed[lo // 8 : packed_size(hi)], count=hi - lo, bitorder="little")
        yield lo, hi, np.flatnonzero(bits.view(bool)) + lo  # as bool: 4x faster than over uint8 (no copy)


def _bitmap_rows(packed: np.ndarray, blocks: int) -> Iterator[np.ndarray]:
    """The indices of the blocks a packed bitmap marks, a window at a time."""
    return (rows for _, _, rows in _bitmap_spans(packed, blocks) if rows.size)


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
