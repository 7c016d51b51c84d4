"""KV caches of the full-attention layers: dense (the model's dtype) and TurboQuant 4-bit (`cache/turboquant.py`),
either one whole (position p in slot p) or a sliding-window ring buffer (slot p % capacity, capacity = window).

A layer hands its new keys and values to `attend`, which stores them and returns the attention of the new
queries over everything the cache lets them see; how a kind holds K/V (and in which domain it attends) is its own
business. The positions, slots and capacity checks are the base class's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.cache import KV_CACHE_KINDS
from sluice.kernels.attention.reference import attention


class KVCache:
    """What every cache kind shares: `capacity` positions per sequence, or a ring of `window` slots, and the
    interface the attention layers call (`attend`, `dense_buffers`, `bytes_per_token`)."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.num_layers, self.batch, self.num_kv_heads, self.head_dim = num_layers, batch, num_kv_heads, head_dim
        self.window = window
        self.max_positions = capacity
        self.capacity = capacity if window is None else min(capacity, window)  # slots per sequence
        self._positions = (None, None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               scale: float) -> torch.Tensor:
        """q [B, Hq, T, D] at positions start..start+T-1 with their k, v [B, Hkv, T, D]: store k, v, return the
        attention output [B, Hq, T, D] (causal; with a window W, query p sees keys p-W+1..p)."""
        raise NotImplementedError

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slots of positions start..end-1 (checked against the capacity)."""
        if end > self.max_positions:
            raise IndexError(f"KV cache holds {self.max_positions} positions, asked to write up to {end}")
        pos = torch.arange(start, end)
        return pos if self.window is None else pos % self.capacity

    def first_visible(self, start: int) -> int:
        """The oldest position a query at `start` (or later) may see."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def use_decode_kernel(self, q: torch.Tensor) -> bool:
        """One new query per sequence on a GPU: the split-K Triton kernel (`kernels/attention/triton.py`)."""
        return q.is_cuda and q.shape[2] == 1

    def decode_slot(self, start: int) -> int:
        """The slot of a decode step's position (checked against the capacity)."""
        return int(self.slots(start, start + 1)[0])

    def positions(self, start: int, q: torch.Tensor) -> torch.Tensor:
        """The decode kernel's per-sequence positions, made once per step (every layer asks for the same)."""
        key, pos = self._positions
        if key != (start, q.shape[0], q.device):
            pos = torch.full((q.shape[0],), start, dtype=torch.int32, device=q.device)
            self._positions = ((start, q.shape[0], q.device), pos)
        return pos

    def visible(self, start: int) -> int:
        return start + 1 - self.first_visible(start)

    def dense_buffers(self, layer: int):
        """(k, v) [B, Hkv, capacity, D] buffers that position p's vectors sit in at slot p, for kernels that
        write in place; None where the cache is not laid out so."""
        return None

    def bytes_per_token(self) -> int:
        """Bytes one position costs across all layers (all sequences of the batch)."""
        raise NotImplementedError

    def fixed_bytes(self) -> int:
        """Bytes the cache holds whatever the number of positions."""
        return 0


class DenseKVCache(KVCache):
    """K and V in the model's dtype: one preallocated [B, Hkv, capacity, D] buffer each per layer."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", window: int | None = None):
        super().__init__(num_layers, batch, num_kv_heads, head_dim, capacity, window)
        shape = (batch, num_kv_heads, self.capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def attend(self, layer, q, k, v, start, scale):
        T = k.shape[2]
        end = start + T
        if self.use_decode_kernel(q):
            from sluice.kernels.attention.triton import decode_attention

            slot = self.decode_slot(start)
            self.k[layer][:, :, slot] = k[:, :, 0]
            self.v[layer][:, :, slot] = v[:, :, 0]
            o = decode_attention(q[:, :, 0], self.k[layer], self.v[layer], self.positions(start, q), scale,
                                 self.visible(start), self.window)
            return o[:, :, None]
        if self.window is None:
            self._store(layer, k, v, self.slots(start, end))
            kc, vc = self._load(layer, self.slots(0, end))
            return attention(q, kc, vc, scale)
        # ring: the keys older than the chunk still visible to its first query, then the chunk's own, attended
        # with a causal window mask; the chunk is written afterwards, since it may overwrite slots its own first
        # queries still see
        first = self.first_visible(start)
        old_k, old_v = self._load(layer, self.slots(first, start))
        kc, vc = torch.cat([old_k, k.to(old_k.dtype)], dim=2), torch.cat([old_v, v.to(old_v.dtype)], dim=2)
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(first, end, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)
        o = F.scaled_dot_product_attention(q, kc.to(q.dtype), vc.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        keep = min(T, self.capacity)  # the last `capacity` positions of the chunk are what the ring keeps
        self._store(layer, k[:, :, T - keep:], v[:, :, T - keep:], self.slots(end - keep, end))
        return o

    def _store(self, layer, k, v, slots):
        if self.window is None:  # contiguous: a slice, not an index_copy
            s = int(slots[0]) if len(slots) else 0
            self.k[layer][:, :, s:s + len(slots)] = k
            self.v[layer][:, :, s:s + len(slots)] = v
        else:
            idx = slots.to(self.k[layer].device)
            self.k[layer].index_copy_(2, idx, k.to(self.k[layer].dtype))
            self.v[layer].index_copy_(2, idx, v.to(self.v[layer].dtype))

    def _load(self, layer, slots):
        if self.window is None:
            n = len(slots)
            return self.k[layer][:, :, :n], self.v[layer][:, :, :n]
        idx = slots.to(self.k[layer].device)
        return self.k[layer].index_select(2, idx), self.v[layer].index_select(2, idx)

    def dense_buffers(self, layer: int):
        return (self.k[layer], self.v[layer]) if self.window is None else None

    def bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * self.num_layers * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()


def make_kv_cache(kind: str, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                  dtype: torch.dtype, device, window: int | None = None) -> KVCache:
    if kind == "dense":
        return DenseKVCache(num_layers, batch, num_kv_heads, head_dim, capacity, dtype, device, window)
    if kind == "turboquant4":
        from sluice.cache.turboquant import TurboQuantKVCache

        return TurboQuantKVCache(num_layers, batch, num_kv_heads, head_dim, capacity, dtype, device, window)
    raise ValueError(f"unknown KV cache kind {kind!r}; use one of {', '.join(KV_CACHE_KINDS)}")
