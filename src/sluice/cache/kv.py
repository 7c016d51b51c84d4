"""Dense KV cache for the full-attention layers: one preallocated [B, Hkv, capacity, D] buffer per layer."""

from __future__ import annotations

import torch


class DenseKVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k, v [B, Hkv, T, D] at positions start..start+T; return the cache up to start+T."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise IndexError(f"KV cache holds {self.capacity} positions, asked to write up to {end}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def layer(self, layer: int):
        """The whole (k, v) buffers of one layer, [B, Hkv, capacity, D] each (for kernels that write in place)."""
        return self.k[layer], self.v[layer]

    def bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * len(self.k) * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()
