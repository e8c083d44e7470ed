"""The host (CPU memory) tier of the KV cache: a preallocated block store with a free list.

Blocks of sessions parked on a tool call are copied here from the device. The
store is allocated once up front (pinned on CUDA so device<->host copies are
DMA transfers, not staged) so a long-running server never fragments host
memory or fails an allocation mid-move. Optionally the store holds int8 blocks
plus one float32 scale per (token, layer, K/V, head), which fits ~3.8x as many
fp32 blocks (~2x fp16) in the same budget at an error of at most absmax/254.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np
import torch

from sessionserve.cache.kv_layout import KVLayout
from sessionserve.cache.quant import dequantize_int8, quantize_int8


class HostTier:
    """`num_blocks` host blocks, ids 0..num_blocks-1, each free or allocated.

    Threading: `try_allocate`/`free` run on the engine thread, `write`/`read`
    on the mover thread on ids the engine allocated and will not free until
    the move is done. `_lock` guards the free list and allocated flags; the
    store tensors are touched without it because concurrent moves use
    disjoint rows.

    Invariants (`check_integrity`): every id is in exactly one of the free
    list or the allocated set; `used_bytes <= budget_bytes`.
    """

    def __init__(self, layout: KVLayout, budget_bytes: int, quantize_int8: bool = False,
                 pin_memory: bool = False) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if quantize_int8 and not layout.dtype.is_floating_point:
            raise ValueError("int8 quantization needs a float KV dtype")
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.quantized = quantize_int8
        # Pinning needs a CUDA runtime (it raises on CPU-only builds) and only
        # helps device<->host DMA, so it is silently off without CUDA.
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.stored_block_bytes = layout.int8_block_bytes if quantize_int8 else layout.block_bytes
        self.num_blocks = budget_bytes // self.stored_block_bytes
        shape = layout.group_shape(self.num_blocks)
        if quantize_int8:
            self._data = _zeros(shape, torch.int8, self.pin_memory)
            scale_shape = (self.num_blocks, layout.num_layers, 2, layout.num_kv_heads, layout.block_size, 1)
            self._scales: torch.Tensor | None = _zeros(scale_shape, torch.float32, self.pin_memory)
        else:
            self._data = _zeros(shape, layout.dtype, self.pin_memory)
            self._scales = None
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(self.num_blocks))
        self._allocated = [False] * self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes of the store held by allocated blocks (the store itself is always allocated)."""
        with self._lock:
            return (self.num_blocks - len(self._free)) * self.stored_block_bytes

    def try_allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free ids, or return None (taking nothing) if too few are free.

        Mutates the free list. The returned blocks hold stale data until written.
        """
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        with self._lock:
            if num_blocks > len(self._free):
                return None
            ids = [self._free.popleft() for _ in range(num_blocks)]
            for block in ids:
                self._allocated[block] = True
            return ids

    def free(self, ids: list[int]) -> None:
        """Return `ids` to the free list. All-or-nothing: raises ValueError, freeing
        none, if any id is unknown, not allocated, or repeated."""
        with self._lock:
            self._check_allocated(ids)
            if len(set(ids)) != len(ids):
                raise ValueError("duplicate host block ids in free")
            for block in ids:
                self._allocated[block] = False
                self._free.append(block)

    def write(self, ids: list[int], data: torch.Tensor) -> None:
        """Store block group `data` (n, L, 2, Hkv, bs, D) in the allocated blocks `ids`.

        Mutates the store rows `ids` only. `data` may be on any device; when
        quantizing, it is quantized there first so only int8 crosses the bus.
        Blocks until the data is on the host.
        """
        expected = self.layout.group_shape(len(ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"data shape {tuple(data.shape)} != {expected}")
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate host block ids in write")
        with self._lock:
            self._check_allocated(ids)
        if not ids:
            return
        if self._scales is not None:
            q, scales = quantize_int8(data)
            self._store_rows(self._data, ids, q)
            self._store_rows(self._scales, ids, scales)
        else:
            self._store_rows(self._data, ids, data.to(self.layout.dtype))

    def read(self, ids: list[int]) -> torch.Tensor:
        """A new CPU tensor (n, L, 2, Hkv, bs, D) in the layout dtype holding blocks `ids`.

        Mutates nothing. Dequantizes when the tier is int8. The result is pinned
        when the tier is, so `scatter_blocks` can copy it to the device async.
        """
        with self._lock:
            self._check_allocated(ids)
        index = torch.tensor(ids, dtype=torch.long)
        if self._scales is not None:
            q = self._data.index_select(0, index)
            out = dequantize_int8(q, self._scales.index_select(0, index), self.layout.dtype)
            return out.pin_memory() if self.pin_memory and len(ids) else out
        out = torch.empty(self.layout.group_shape(len(ids)), dtype=self.layout.dtype,
                          pin_memory=self.pin_memory and bool(ids))
        return torch.index_select(self._data, 0, index, out=out)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and allocated flags disagree."""
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "duplicate id in host free list"
            for block in range(self.num_blocks):
                assert self._allocated[block] != (block in free), f"host block {block} lost or double"
            used_bytes = (self.num_blocks - len(free)) * self.stored_block_bytes
            assert used_bytes <= self.budget_bytes, "host tier over budget"

    def _check_allocated(self, ids: list[int]) -> None:
        """Raise ValueError unless every id is an allocated block. Caller holds `_lock`."""
        for block in ids:
            if not 0 <= block < self.num_blocks or not self._allocated[block]:
                raise ValueError(f"host block {block} is not allocated")

    @staticmethod
    def _store_rows(store: torch.Tensor, ids: list[int], rows: torch.Tensor) -> None:
        """Copy `rows` (on any device) into `store[ids]`. Mutates `store` only.

        Ids from a fresh free list are usually one ascending run: copy straight
        into that slice (a direct device-to-pinned DMA on CUDA). Otherwise the
        rows come to the CPU first and land with one `index_copy_`.
        """
        first = ids[0]
        if ids == list(range(first, first + len(ids))):
            store[first:first + len(ids)].copy_(rows)
            return
        index = torch.tensor(ids, dtype=torch.long)
        store.index_copy_(0, index, rows.to("cpu", store.dtype))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A zero-filled host buffer that costs memory only where it is written.

    Zero-filled rather than empty, so a bug that reads an unwritten block
    returns zeros, not stale data of another session. `torch.zeros` writes
    every page up front (a 2 GiB tier is 2 GiB of RSS at start); calloc'd
    memory (numpy.zeros) maps the kernel's zero page until first written.
    Pinned buffers (CUDA) are allocated and filled eagerly.
    """
    if pin_memory or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
