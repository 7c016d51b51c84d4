"""Caches of a hybrid model: a dense KV cache for the full-attention layers and, per Gated DeltaNet layer, the
causal-conv state (last W-1 inputs) and the fp32 recurrent state."""

from __future__ import annotations

import torch

from sluice.cache.kv import KVCache


class HybridCache:
    def __init__(self, kv: KVCache | None, num_gdn_layers: int):
        self.kv = kv
        self.conv: list[torch.Tensor | None] = [None] * num_gdn_layers  # [B, C, W-1], model dtype
        self.recurrent: list[torch.Tensor | None] = [None] * num_gdn_layers  # [B, Hv, K, V], fp32

    def bytes_per_token(self) -> int:
        """KV bytes per position (the GDN states are a fixed size per sequence)."""
        return self.kv.bytes_per_token()

    # the attention layers see the KV cache's interface
    def attend(self, layer: int, q, k, v, start: int, scale: float):
        return self.kv.attend(layer, q, k, v, start, scale)

    def dense_buffers(self, layer: int):
        return self.kv.dense_buffers(layer)
