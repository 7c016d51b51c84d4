"""The latent KV cache of multi-head latent attention (DeepSeek-V2/V3 MLA), the storage (its attention:
`attention/mla.py`): per layer, row and position the normalised latent (kv_lora_rank values) and the roped key shared
by all heads (qk_rope_head_dim), one [layers, rows, capacity, kv_lora_rank + rope] tensor in the model's dtype (576
values a token and layer for V3), or paged: [layers, blocks + 1, page, kv_lora_rank + rope] (`cache/blocks.py`).

It is a `KVCache` (one "head" of kv_lora_rank + rope values), so the pool's capacity, sizing and bytes per token
read it as they read the dense cache.
"""

from __future__ import annotations

import torch

from sluice.cache.blocks import BlockTable
from sluice.cache.kv import KVCache


class LatentCache(KVCache):
    PAGEABLE = True

    def __init__(self, num_layers: int, rows: int, kv_lora_rank: int, rope_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", page: int | None = None,
                 blocks: int | None = None):
        super().__init__(num_layers, rows, 1, kv_lora_rank + rope_dim, capacity, device=device)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        C = kv_lora_rank + rope_dim
        if page is not None:  # paged: [layers, blocks + 1, page, C], the last block scratch (`cache/blocks.py`)
            self.table = BlockTable(rows, blocks, page, capacity, device)
            self.max_positions = self.capacity = self.table.max_positions
            self.latent = torch.zeros(num_layers, blocks + 1, page, C, dtype=dtype, device=device)
        else:
            self.latent = torch.zeros(num_layers, rows, capacity, C, dtype=dtype, device=device)

    def gather(self, layer: int, row: int, end: int) -> torch.Tensor:
        """Positions 0..end-1 of a row, [end, C]: a view of its row, or its blocks gathered (paged)."""
        if self.table is None:
            return self.latent[layer][row, :end]
        blocks = self.table.device[row, :self.table.blocks_for(end)].long()
        return self.latent[layer].index_select(0, blocks).flatten(0, 1)[:end]

    def store(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, new: torch.Tensor, meta=None) -> None:
        """new [N, C] at cache rows `rows`, positions `positions` (device tensors [N]); paged, their blocks and slots
        derived once a forward where `meta` is given (`meta.once`)."""
        if self.table is None:
            self.latent[layer][rows, positions] = new
            return
        page, table = self.table.page, self.table.device

        def where():
            return table[rows.long(), (positions // page).long()].long(), positions % page

        blocks, slots = where() if meta is None else meta.once("latent_store", where)
        self.latent[layer][blocks, slots] = new

    def bytes_per_token(self) -> int:
        return self.num_layers * self.head_dim * self.latent.element_size()

    @property
    def supports_prefix(self) -> bool:
        """A row's first positions can be copied into another row to go on from there (a prefix cache)."""
        return True

    def copy_rows(self, src: int, dst: int, n: int, into: LatentCache) -> None:
        into.latent[:, dst, :n].copy_(self.latent[:, src, :n])

    def block_tensors(self):
        return (self.latent,) if self.table is not None else ()
