"""The shape of one KV block across all layers, and block gather/scatter on the device caches.

The device KV cache is a list of `num_layers` pairs `(k_cache, v_cache)`, each of
shape `(num_blocks, num_kv_heads, block_size, head_dim)`. When a session's blocks
leave the device they travel as one tensor of shape
`(num_blocks_moved, num_layers, 2, num_kv_heads, block_size, head_dim)`
(index 0 of the `2` axis is K, 1 is V): that "block group" layout is what the
host and disk tiers store, so a block is one contiguous slab of
`KVLayout.block_bytes` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sessionserve.types.kv_mover import int8_block_bytes

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVLayout:
    """Geometry and dtype of one KV block (all layers, K and V). Immutable."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def from_kv_caches(cls, kv_caches: KVCaches) -> KVLayout:
        """The layout of the device caches `kv_caches` (which are not modified)."""
        k_cache = kv_caches[0][0]
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        return cls(len(kv_caches), num_kv_heads, block_size, head_dim, k_cache.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_numel(self) -> int:
        """Elements in one block (all layers, K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V, in `dtype`."""
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def int8_block_bytes(self) -> int:
        """Bytes of one block in an int8 tier (see `int8_block_bytes`)."""
        return int8_block_bytes(self.block_bytes, torch.empty((), dtype=self.dtype).element_size(), self.head_dim)

    def group_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a block group of `num_blocks` blocks: (n, L, 2, Hkv, bs, D)."""
        return (num_blocks, *self.block_shape)


def _index_tensor(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """`block_ids` as a long tensor on the caches' device, after a range check.

    The check is done in Python because an out-of-range index on CUDA is a
    device-side assert that poisons the whole context rather than an exception.
    """
    num_device_blocks = kv_caches[0][0].shape[0]
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_device_blocks):
        raise IndexError(f"block id out of range [0, {num_device_blocks})")
    return torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)


def gather_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """Copy the device blocks `block_ids` into a new (n, L, 2, Hkv, bs, D) tensor.

    Mutates nothing. The result is on the caches' device, in their dtype,
    contiguous, with row i holding block `block_ids[i]`. One `index_select` per
    layer and K/V, written straight into the output (no per-block loop, no
    intermediate copy).
    """
    layout = KVLayout.from_kv_caches(kv_caches)
    k0 = kv_caches[0][0]
    out = torch.empty(layout.group_shape(len(block_ids)), dtype=k0.dtype, device=k0.device)
    if not block_ids:
        return out
    index = _index_tensor(kv_caches, block_ids)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        torch.index_select(k_cache, 0, index, out=out[:, layer, 0])
        torch.index_select(v_cache, 0, index, out=out[:, layer, 1])
    return out


def scatter_blocks(kv_caches: KVCaches, block_ids: list[int], data: torch.Tensor) -> None:
    """Write block group `data` (n, L, 2, Hkv, bs, D) into the device blocks `block_ids`.

    Mutates `kv_caches` (only the rows `block_ids`). `data` may live on another
    device or have another float dtype: it is moved/cast first. When `data` is
    pinned CPU memory and the caches are on CUDA the transfer is asynchronous on
    the current stream; later kernels on that stream see the written blocks,
    and the caching host allocator keeps `data`'s memory alive until the copy
    ends, but the caller must not *modify* `data` before the stream syncs.
    `block_ids` must be distinct (duplicate targets would race).
    """
    layout = KVLayout.from_kv_caches(kv_caches)
    expected = layout.group_shape(len(block_ids))
    if tuple(data.shape) != expected:
        raise ValueError(f"data shape {tuple(data.shape)} != {expected}")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("duplicate block ids in scatter")
    if not block_ids:
        return
    k0 = kv_caches[0][0]
    index = _index_tensor(kv_caches, block_ids)
    non_blocking = data.device.type == "cpu" and k0.device.type != "cpu" and data.is_pinned()
    data = data.to(device=k0.device, dtype=k0.dtype, non_blocking=non_blocking)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.index_copy_(0, index, data[:, layer, 0])
        v_cache.index_copy_(0, index, data[:, layer, 1])
