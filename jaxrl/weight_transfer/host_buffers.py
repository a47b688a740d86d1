"""Host buffers a server pulls into, and a publisher copies CPU shards into, reused from one
version to the next.

Why a pool: a fresh host buffer costs the kernel a zero-fill of every page on first touch, and
on this kind of VM that first touch runs at 0.5-0.9 GB/s against ~11 GB/s for a write into
pages already mapped (measured, 2-core host, 2026-11-29; transparent huge pages did not help).
A full bfloat16 pull of Qwen3-0.6B (1.19 GB) spent ~1.7 s of its ~4.2 s on it. numpy hands
large arrays back to the kernel when they die, so every version paid it again.

When a buffer is free: nothing but the pool holds it. A CPU device adopts an aligned host
buffer as its device buffer (no copy), so version n's buffers are the arrays served until
version n + 1 is swapped in and the engine lets them go; on TPU / GPU the host buffer is a
staging copy, held by jax only until its transfer is done. Both are seen the same way, by the
buffer's reference count (every numpy view and every jax array made from one holds a
reference to the block it views): a block the count says is still held is never handed out,
so a served array is never written. jax lets go of an adopted buffer at its next garbage
collection point, not when the array dies (jax issue 14882: it runs on every ``gc`` pass), so
the first request of each pull runs ``gc.collect(0)``, the youngest generation only (cheap), to
let that happen before the search. Steady state on CPU: two versions' blocks (the one
served, the one being pulled), as a pull needs today at its peak; on TPU / GPU: the staging
buffers of the groups of one pull.

A publisher (``Publisher``) keeps the newest ``keep`` versions' host copies; a dropped version's
blocks are free once no pull reads them (a transfer in flight holds a view), and ``settle()``
follows each publish.

The pool keeps only what the last pull used: ``settle()`` (called at a pull's end) drops free
blocks it did not hand out, so a layout change or a one-off large pull does not pin memory.

A block can carry a tag naming what it holds (``tag``: the puller's (lineage, version, param,
chunk)), which ``take`` finds again once the block is free: a TPU / GPU server's delta pull then
starts from the staging buffer its base was pulled into instead of reading the base back from
the device (``puller``). Handing a block out (``empty``, ``take``) clears its tag: whoever
writes it tags it again.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Hashable
from typing import Any

import numpy as np

ALIGN = 64
"""Byte alignment of host buffers: XLA:CPU adopts a buffer aligned so without a copy (measured,
jaxlib 0.10.2: ``device_put`` of 1 GB aligned to 16 bytes copies at ~0.6 GB/s, aligned to 64 it
takes no time)."""

_OWNED_REFS = 2
"""``sys.getrefcount`` of a block only the pool's list holds: the list's reference and the
call's own argument."""


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` starting on an ``ALIGN``-byte boundary (fresh memory)."""
    return _view(np.empty(_nbytes(shape, dtype) + ALIGN, np.uint8), shape, dtype)


class HostBufferPool:
    """Aligned host buffers, reused once nothing but the pool holds them; see the module
    docstring. Thread-safe: a pull's fetch threads may ask at once."""

    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []  # raw uint8 blocks, each ALIGN bytes over its size
        self._used: set[int] = set()  # id() of the blocks handed out since the last settle()
        self._flushed = False  # whether this pull ran gc.collect(0) yet (module docstring)
        self._tags: dict[int, Hashable] = {}  # id() of a block -> what it holds (``tag``)
        self._handed: dict[int, int] = {}  # address of a buffer handed out -> id() of its block
        self._lock = threading.Lock()
        self.reused_bytes = 0  # bytes handed out from reused blocks (for tests and benches)
        self.fresh_bytes = 0  # bytes handed out from new blocks
        self.taken_bytes = 0  # bytes handed out by ``take``: tagged contents reused

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An aligned, uninitialised ``shape`` x ``dtype`` buffer: a free block of the pool when
        one fits (the smallest at least as large, and at most twice as large), else a new one."""
        n = _nbytes(shape, dtype)
        with self._lock:
            self._flush()
            best = None
            for i in range(len(self._blocks)):
                size = self._blocks[i].size - ALIGN
                if n <= size <= 2 * max(n, 1) and id(self._blocks[i]) not in self._used:
                    if sys.getrefcount(self._blocks[i]) == _OWNED_REFS and (
                        best is None or size < self._blocks[best].size - ALIGN
                    ):
                        best = i
            if best is None:
                block = np.empty(n + ALIGN, np.uint8)
                self._blocks.append(block)
                self.fresh_bytes += n
            else:
                block = self._blocks[best]
                self.reused_bytes += n
            return self._hand_out(block, shape, dtype)

    def take(self, key: Hashable, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """The free block tagged ``key`` as a ``shape`` x ``dtype`` buffer, its bytes as they
        were tagged; None when no such block is free (still served, dropped, or never tagged)."""
        n = _nbytes(shape, dtype)
        with self._lock:
            self._flush()
            for block in self._blocks:
                if self._tags.get(id(block)) != key or id(block) in self._used:
                    continue
                if block.size - ALIGN < n or sys.getrefcount(block) != _OWNED_REFS + 1:  # + the loop's
                    return None
                self.reused_bytes += n
                self.taken_bytes += n
                return self._hand_out(block, shape, dtype)
            return None

    def _hand_out(self, block: np.ndarray, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """``block`` as a buffer, marked used until ``settle``; its tag cleared (it is written next)."""
        self._used.add(id(block))
        self._tags.pop(id(block), None)
        buffer = _view(block, shape, dtype)
        self._handed[buffer.ctypes.data] = id(block)
        return buffer

    def tag(self, buffer: np.ndarray, key: Hashable) -> None:
        """Say that the block under ``buffer`` (from ``empty`` or ``take`` since the last
        ``settle``) now holds ``key``; no-op for any other buffer."""
        with self._lock:
            if (block := self._handed.get(buffer.ctypes.data)) is not None:
                self._tags[block] = key

    def _flush(self) -> None:
        if not self._flushed:
            gc.collect(0)
            self._flushed = True

    def settle(self) -> None:
        """A pull ended: drop the free blocks it did not use; what it used stays for the next."""
        with self._lock:
            self._blocks = [
                b for b in self._blocks if id(b) in self._used or sys.getrefcount(b) > _OWNED_REFS + 1
            ]
            kept = {id(b) for b in self._blocks}
            self._tags = {k: v for k, v in self._tags.items() if k in kept}
            self._handed.clear()
            self._used.clear()
            self._flushed = False

    @property
    def held_bytes(self) -> int:
        """Bytes of every block the pool holds, free or in use."""
        with self._lock:
            return sum(b.size - ALIGN for b in self._blocks)


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _view(block: np.ndarray, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    n = _nbytes(shape, dtype)
    start = -block.ctypes.data % ALIGN
    return block[start : start + n].view(np.dtype(dtype)).reshape(shape)
