"""KV caches of the full-attention layers: dense (the model's dtype) and TurboQuant 4-bit (`cache/turboquant.py`),
either one whole (position p in slot p) or a sliding-window ring buffer (slot p % capacity, capacity = window).

A layer hands its new keys and values to `attend`, which stores them and returns the attention of the new
queries over everything the cache lets them see. How the cache holds K/V (and in which domain it attends) is its
own business; the positions, the ring and the masks are this base class's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.attention.reference import attention

KV_CACHE_KINDS = ("dense", "turboquant4")


class KVCache:
    """Common part: `capacity` positions per sequence, or a ring of `window` slots. Subclasses implement
    `_store(layer, k, v, slots)` (k, v [B, Hkv, T, D]), `_load(layer, slots)` -> (k, v) in the attention domain,
    `_encode(k)` (what the cache makes of a vector, in the attention domain), `_to_domain(q)`, `_from_domain(o)`,
    and `bytes_per_token`."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.num_layers, self.batch, self.num_kv_heads, self.head_dim = num_layers, batch, num_kv_heads, head_dim
        self.window = window
        self.max_positions = capacity
        self.capacity = capacity if window is None else min(capacity, window)  # slots per sequence

    def slots(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return pos if self.window is None else pos % self.capacity

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               scale: float) -> torch.Tensor:
        """q [B, Hq, T, D] at positions start..start+T-1 with their k, v [B, Hkv, T, D]: store k, v, return the
        attention output [B, Hq, T, D] (causal; with a window W, query p sees keys p-W+1..p)."""
        T = k.shape[2]
        end = start + T
        if end > self.max_positions:
            raise IndexError(f"KV cache holds {self.max_positions} positions, asked to write up to {end}")
        qd = self._to_domain(q)
        if self.window is None:
            self._store(layer, k, v, self.slots(start, end))
            kc, vc = self._load(layer, self.slots(0, end))
            return self._from_domain(attention(qd, kc, vc, scale)).to(q.dtype)
        # ring: the keys older than the chunk still visible to its first query, then the chunk's own (as the
        # cache would hold them), attended with a causal window mask; the chunk is written afterwards, since
        # it may overwrite slots its own first queries still see
        first = max(0, start - self.window + 1)
        old_k, old_v = self._load(layer, self.slots(first, start))
        kc, vc = torch.cat([old_k, self._encode(k)], dim=2), torch.cat([old_v, self._encode(v)], dim=2)
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(first, end, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)
        o = F.scaled_dot_product_attention(qd, kc.to(qd.dtype), vc.to(qd.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        keep = min(T, self.capacity)  # the last `capacity` positions of the chunk are what the ring keeps
        self._store(layer, k[:, :, T - keep:], v[:, :, T - keep:], self.slots(end - keep, end))
        return self._from_domain(o).to(q.dtype)

    def use_decode_kernel(self, q: torch.Tensor) -> bool:
        """One new query per sequence on a GPU: the split-K Triton kernel (`kernels/attention/triton.py`)."""
        return q.is_cuda and q.shape[2] == 1

    def positions(self, start: int, q: torch.Tensor) -> torch.Tensor:
        return torch.full((q.shape[0],), start, dtype=torch.int32, device=q.device)

    def visible(self, start: int) -> int:
        return start + 1 if self.window is None else min(start + 1, self.window)

    def dense_buffers(self, layer: int):
        """(k, v) [B, Hkv, capacity, D] buffers that position p's vectors sit in at slot p, for kernels that
        write in place; None where the cache is not laid out so."""
        return None

    def _to_domain(self, q):
        return q

    def _from_domain(self, o):
        return o

    def bytes_per_token(self) -> int:
        """Bytes one position costs across all layers (all sequences of the batch)."""
        raise NotImplementedError


class DenseKVCache(KVCache):
    """K and V in the model's dtype: one preallocated [B, Hkv, capacity, D] buffer each per layer."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", window: int | None = None):
        super().__init__(num_layers, batch, num_kv_heads, head_dim, capacity, window)
        shape = (batch, num_kv_heads, self.capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def attend(self, layer, q, k, v, start, scale):
        if not self.use_decode_kernel(q):
            return super().attend(layer, q, k, v, start, scale)
        from sluice.kernels.attention.triton import decode_attention

        if start + 1 > self.max_positions:
            raise IndexError(f"KV cache holds {self.max_positions} positions, asked to write up to {start + 1}")
        slot = start if self.window is None else start % self.capacity
        self.k[layer][:, :, slot] = k[:, :, 0]
        self.v[layer][:, :, slot] = v[:, :, 0]
        o = decode_attention(q[:, :, 0], self.k[layer], self.v[layer], self.positions(start, q), scale,
                             self.visible(start), self.window)
        return o[:, :, None]

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

    def _encode(self, x):
        return x.to(self.k[0].dtype)

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
