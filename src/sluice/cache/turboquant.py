"""TurboQuant 4-bit KV cache, the storage (its attention: `attention/turboquant.py`): each K and V vector stored as
4-bit Lloyd-Max codes of its randomised-Hadamard rotation plus one fp32 scale (`kernels/turboquant/reference.py`):
D/2 + 4 bytes instead of 2 D in bf16 (3.76x fewer at D = 128).

The most recent RECENT positions are also kept exact (rotated, in the model's dtype, a ring of RECENT slots): a
query at position p reads key/value j exactly when p - j < RECENT, from the codes otherwise. This is KIVI's
"residual window": measured on the demo model (SmolLM2-135M, 3 KV heads of 64), 4-bit K and V cost +7.2%
perplexity and 88% top-1 agreement; with the 16 / 32 / 64 / 128 most recent positions exact, +1.3 / +1.0 / +0.5 /
+0.3% and 94 / 96 / 97 / 97% (docs/ACCURACY.md). The rule depends on the query's position only, so prefill in
chunks and token-by-token decode give the same result. The fixed cost: 64 positions in the model's dtype.

Paged (`page`, `blocks`; `cache/blocks.py`): the codes and scales live in blocks of `page` positions, [layers,
blocks + 1, Hkv, page, ...] (the last block scratch), a row's position p in block table[row, p // page] at slot
p % page; the exact ring stays one per row.
"""

from __future__ import annotations

import torch

from sluice.cache.blocks import BlockTable
from sluice.cache.kv import KVCache
from sluice.kernels.turboquant import reference as tq

RECENT = 64


class TurboQuantKVCache(KVCache):
    PAGEABLE = True

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", window: int | None = None,
                 page: int | None = None, blocks: int | None = None, recent: int = RECENT):
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"the TurboQuant KV cache needs a power-of-two head dim, this model has {head_dim}")
        super().__init__(num_layers, rows, num_kv_heads, head_dim, capacity, window, device)
        self.capacity = -(-self.capacity // 32) * 32  # slots in 32s: the values interleave four positions, the CUDA
        # decode kernel (kernels/attention/cuda.py) reads blocks of 32
        self.recent = recent
        self.table = None
        slots, n = self.capacity, rows  # per code array: its first dim (rows or blocks), its slots
        if page is not None:
            if window is not None:
                raise ValueError("a sliding-window KV cache is not paged")
            if page < 32 or page % 32:
                raise ValueError(f"the TurboQuant KV cache's page must be a multiple of 32 positions, got {page}")
            if blocks is None:
                raise ValueError("a paged KV cache needs its number of blocks")
            self.table = BlockTable(rows, blocks, page, capacity, device)
            self.max_positions = self.capacity = self.table.max_positions
            slots, n = page, blocks + 1
        codes = (num_layers, n, num_kv_heads, slots, head_dim // 2)
        scales = (num_layers, n, num_kv_heads, slots)
        ring = (num_layers, rows, num_kv_heads, recent, head_dim)
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        # per layer: keys [rows, Hkv, cap, D/2]; values [rows, Hkv, cap/4, D/2, 4] (reference.interleave); paged,
        # blocks and page instead of rows and cap
        self.k_codes = z(codes, torch.uint8)
        self.v_codes = z((num_layers, n, num_kv_heads, slots // 4, head_dim // 2, 4), torch.uint8)
        self.k_scale, self.v_scale = z(scales, torch.float32), z(scales, torch.float32)
        self.k_recent, self.v_recent = z(ring, dtype), z(ring, dtype)  # rotated, slot p % recent

    @property
    def supports_prefix(self) -> bool:
        return self.window is None

    def copy_rows(self, src, dst, n, into):
        """The codes and scales of positions 0..n-1 (the values' groups of four whole: the rest of the last group
        is written again as the destination goes on); the exact ring is row state (`row_state`)."""
        groups = -(-n // 4)
        for a, b, m in ((self.k_codes, into.k_codes, n), (self.v_codes, into.v_codes, groups),
                        (self.k_scale, into.k_scale, n), (self.v_scale, into.v_scale, n)):
            b[:, dst, :, :m].copy_(a[:, src, :, :m])

    def block_tensors(self):
        """The codes and scales (the exact ring stays per row)."""
        return (self.k_codes, self.v_codes, self.k_scale, self.v_scale) if self.table is not None else ()

    def row_state(self):
        return [self.k_recent, self.v_recent]

    def bytes_per_token(self) -> int:
        """Bytes per position of one sequence across layers (the `recent` exact positions are `fixed_bytes`)."""
        return 2 * self.num_layers * self.num_kv_heads * tq.bytes_per_vector(self.head_dim)

    def fixed_bytes(self) -> int:
        r = self.k_recent[0, 0]
        return 2 * self.num_layers * r.numel() * r.element_size()
