"""The per-element loops of a delta, compiled (numba): finding a shard's changed elements on the
trainer, and writing them into a server's buffer.

Why compiled: a delta step is host CPU work on both sides (every trainer host compares its
shards, every server writes the changed elements over its base), and numpy does each as several
whole passes with temporaries: ``!=``, ``flatnonzero``, two ``take``s, index arithmetic, an
int64 offset per element, a fancy assignment. Measured on the 2-core CI host (2026-11-30,
Qwen3-0.6B from 2 trainer processes to 2 servers, 2.8% of the bfloat16 elements changed): a delta
step was ~1.5 CPU-seconds, 0.2 s of it per trainer in numpy's compare and 0.2 s per server in its
scatter. Each loop here is one pass that reads every word once and touches only what changed.
The loops run without the GIL (``nogil``), so a server's fetch threads scatter side by side.

numba compiles each loop on first use and caches the machine code beside this file
(``cache=True``), so a process pays the compile once per machine, not per version.
"""

from __future__ import annotations

import numba
import numpy as np


CHUNK_WORDS = 1 << 14
"""Words looked at per round of ``changed_lanes`` (a 128 KB list of the changed ones)."""


@numba.njit(nogil=True, cache=True)
def changed_lanes(old: np.ndarray, new: np.ndarray, bits: int, limit: int, rows: np.ndarray, values: np.ndarray) -> int:
    """The elements of ``bits`` bits (8, 16 or 32) that differ between two shards' bytes viewed as
    ``uint64`` words (``old``, ``new``): their indices (element order, ascending) into ``rows`` and
    their new values into ``values``; returns how many, or -1 once more than ``limit`` differ (the
    caller's bitmap is then the shorter description). ``rows`` and ``values`` hold at least
    ``limit + (64 // bits) * CHUNK_WORDS`` (a round may overshoot ``limit`` before it is checked).

    Two levels, a round of ``CHUNK_WORDS`` words at a time: the changed words, then the changed
    elements within them. Both without a branch on the data (every candidate is written, the
    count moves on by whether it changed): at an RL learning rate 3-10% of bfloat16 words change,
    scattered, and a branch per word mispredicted that often (300M elements, 2.8% changed, 2-core
    host 2026-11-30: 0.175 s with branches, 0.10 s without; numpy's ``!=`` alone takes 0.075)."""
    lanes = 64 // bits
    mask = (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    hits = np.empty(CHUNK_WORDS, np.int64)
    k = 0
    for lo in range(0, old.size, CHUNK_WORDS):
        m = 0
        for w in range(lo, min(lo + CHUNK_WORDS, old.size)):
            hits[m] = w
            m += old[w] != new[w]
        for h in range(m):
            w = hits[h]
            b = new[w]
            x = old[w] ^ b
            for j in range(lanes):
                shift = np.uint64(j * bits)
                rows[k] = w * lanes + j
                values[k] = (b >> shift) & mask
                k += ((x >> shift) & mask) != 0
        if k > limit:
            return -1
    return k


@numba.njit(inline="always")
def _run_of(r: int, run: int, end: int, shift: int, starts: np.ndarray, inner: int) -> tuple[int, int, int]:
    """The run holding region element ``r``, walked forward from ``run`` (which ends at region
    element ``end``): (run, where it ends, ``shift`` with element ``r`` at ``shift + r``)."""
    while r >= end:
        run += 1
        end += inner
        shift = starts[run] - run * inner
    return run, end, shift


@numba.njit(nogil=True, cache=True)
def scatter_runs(span: np.ndarray, starts: np.ndarray, inner: int, rows: np.ndarray, values: np.ndarray) -> None:
    """``span[offset(rows[i])] = values[i]`` for a region laid out as runs of ``inner`` contiguous
    elements starting at ``starts`` (``delta._runs``; one run for a contiguous region): element
    ``r`` is at ``starts[r // inner] + r % inner``. ``rows`` ascending and below
    ``starts.size * inner`` (``Changed.decode`` makes sure of both), so the run only moves forward."""
    run, end, shift = 0, inner, starts[0]
    for i in range(rows.size):
        run, end, shift = _run_of(np.int64(rows[i]), run, end, shift, starts, inner)
        span[shift + rows[i]] = values[i]


@numba.njit(nogil=True, cache=True)
def run_offsets(starts: np.ndarray, inner: int, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[i]``: where ``scatter_runs`` would write ``rows[i]`` (an offset from the start of
    the memory ``starts`` count from): the offsets a device scatter takes."""
    run, end, shift = 0, inner, starts[0]
    for i in range(rows.size):
        run, end, shift = _run_of(np.int64(rows[i]), run, end, shift, starts, inner)
        out[i] = shift + rows[i]


COPY_BLOCK = 1 << 16
"""Elements ``patch_runs`` copies before writing the changed ones among them (128 KB of
bfloat16: they are still in cache when written)."""


@numba.njit(inline="always")
def _copy(dst: np.ndarray, src: np.ndarray, lo: int, hi: int) -> None:
    """``dst[lo:hi] = src[lo:hi]`` as an element loop over slices, which LLVM turns into a block
    copy (numba's slice assignment took twice as long)."""
    d = dst[lo:hi]
    s = src[lo:hi]
    for j in range(hi - lo):
        d[j] = s[j]


@numba.njit(nogil=True, cache=True)
def patch_runs(
    dst: np.ndarray, src: np.ndarray, starts: np.ndarray, inner: int, begin: int, end: int, rows: np.ndarray, values: np.ndarray
) -> None:
    """Elements ``begin`` to ``end`` of a region laid out as runs (``scatter_runs``) copied from
    ``src`` (the same layout) into ``dst``, and ``rows[i]`` (all in ``[begin, end)``, ascending)
    set to ``values[i]``: a delta written over its base in one pass over the memory. A copy then
    a scatter is two: at 2.8% of the elements changed nearly every cache line holds one, so the
    scatter streams the whole region again (600M bfloat16 elements, 2-core host 2026-11-30: copy
    + scatter 0.154 s, this 0.112)."""
    i = 0
    r = begin
    while r < end:
        run = r // inner
        stop = min((run + 1) * inner, end)
        off = starts[run] - run * inner
        while r < stop:
            hi = min(r + COPY_BLOCK, stop)
            _copy(dst, src, off + r, off + hi)
            while i < rows.size and rows[i] < hi:
                dst[off + rows[i]] = values[i]
                i += 1
            r = hi


@numba.njit(nogil=True, cache=True)
def patch_regions(
    dst: np.ndarray, src: np.ndarray, starts: tuple, inners: np.ndarray, rows: tuple, values: tuple
) -> None:
    """``patch_runs`` for a whole buffer split among regions whose runs are short (a weight split
    along its last axis: runs of a few hundred elements, interleaved): ``dst`` (C-contiguous,
    1-D) gets ``src``'s elements a block at a time, contiguously, and then every region's changed
    elements that fall in the block, each region walked with a cursor of its own (region ``q``:
    runs of ``inners[q]`` elements at ``starts[q]`` in ``dst``, changed ``rows[q]`` ascending,
    new ``values[q]``). The regions must cover ``dst`` between them. Copying region by region
    through 512-byte runs, or the whole buffer first and the changed elements after, both cost
    about twice this (Qwen3-0.6B's embedding split in 4 along its columns, 2-core host 2026-11-30)."""
    n = len(rows)
    at = np.zeros(n, np.int64)  # each region's next changed element
    run = np.zeros(n, np.int64)
    end = inners.copy()  # the region element where its current run ends
    shift = np.empty(n, np.int64)  # buffer offset of the region's element r in its current run: shift + r
    for q in range(n):
        shift[q] = starts[q][0]
    for lo in range(0, dst.size, COPY_BLOCK):
        hi = min(lo + COPY_BLOCK, dst.size)
        _copy(dst, src, lo, hi)
        for q in range(n):
            r_q = rows[q]
            v_q = values[q]
            i = at[q]
            while i < r_q.size:
                r = np.int64(r_q[i])
                run[q], end[q], shift[q] = _run_of(r, run[q], end[q], shift[q], starts[q], inners[q])
                off = shift[q] + r
                if off >= hi:
                    break
                dst[off] = v_q[i]
                i += 1
            at[q] = i


@numba.njit(nogil=True, cache=True)
def encode_gaps(rows: np.ndarray, out: np.ndarray) -> int:
    """Ascending ``rows`` as the gaps between them (each row's distance from the one before, minus
    one; the first's from -1), each a LEB128 varint (7 bits a byte, low first, the high bit set
    on all but the last) into ``out`` (room for 5 bytes a row); returns the bytes written. At an
    RL learning rate's 3% of bfloat16 elements changed, nearly every gap is under 128: a byte a
    changed element instead of a 4-byte index, half of what a delta sends."""
    prev = -1
    k = 0
    for i in range(rows.size):
        d = np.int64(rows[i]) - prev - 1
        prev = np.int64(rows[i])
        while d >= 128:
            out[k] = (d & 127) | 128
            k += 1
            d >>= 7
        out[k] = d
        k += 1
    return k


@numba.njit(nogil=True, cache=True)
def decode_gaps(data: np.ndarray, blocks: int, rows: np.ndarray) -> bool:
    """``encode_gaps``'s bytes back into ``rows`` (its size: how many there are); False unless
    ``data`` holds exactly that many gaps and every row is below ``blocks`` (a delta as it
    arrives: ``scatter_runs`` writes unchecked through its rows). Ascending by construction."""
    prev = np.int64(-1)
    k = 0
    for i in range(rows.size):
        d = np.int64(0)
        shift = 0
        while True:
            if k >= data.size or shift > 28:  # 5 bytes hold any gap below 2**35
                return False
            b = np.int64(data[k])
            k += 1
            d |= (b & 127) << shift
            if b < 128:
                break
            shift += 7
        prev += d + 1
        if prev >= blocks:
            return False
        rows[i] = prev
    return k == data.size
