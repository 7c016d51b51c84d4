"""KV caches of the full-attention layers, as storage: dense (the model's dtype, here) and TurboQuant 4-bit
(`cache/turboquant.py`), either one whole row per sequence (position p in slot p), paged (blocks of `page` positions
through a `BlockTable`, `cache/blocks.py`), or a sliding-window ring buffer (slot p % capacity, capacity = window).

A cache is a pool of `rows` sequences; a forward says which rows and positions its tokens have (`engine/batch.py`
ForwardMeta). A cache knows its layout: where a row's position lives (`locate`), a row's positions gathered
(`gather`), the capacity checks (`slots`), and how a prefix moves between rows (`copy_prefix`). How attention reads
and writes it is its backend's business (`sluice/attention/`: one backend per cache kind, chosen once when the pool is
made).
"""

from __future__ import annotations

import torch

from sluice.cache.blocks import BlockTable
from sluice.engine.batch import on_device


class KVCache:
    """What every cache kind shares: `rows` sequences of `capacity` positions each (or paged: `table`), or a ring of
    `window` slots; what the pool, the prefix cache and the memory plan ask of it."""

    PAGEABLE = False  # whether the kind can keep its positions in blocks (`cache/blocks.py`)
    table = None  # paged: the `BlockTable`

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 window: int | None = None, device: torch.device | str = "cpu"):
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.num_layers, self.rows, self.num_kv_heads, self.head_dim = num_layers, rows, num_kv_heads, head_dim
        self.window = window
        self.device = torch.device(device)
        self.max_positions = capacity
        self.capacity = capacity if window is None else min(capacity, window)  # slots per sequence

    @property
    def supports_prefix(self) -> bool:
        """Whether a row's first positions can be copied into another row to go on from there (`copy_prefix`)."""
        return False

    def copy_prefix(self, src: int, dst: int, n: int, into: "KVCache") -> None:
        """Positions 0..n-1 of row src into row dst of `into` (this cache or another of the same layout). Paged:
        within this cache the whole blocks shared and a partial last one copied (`BlockTable.share`); into another,
        block by block into blocks of its own. Whole rows: `copy_rows`."""
        if self.table is None:
            self.copy_rows(src, dst, n, into)
        elif into is self:
            if not self.table.share(src, dst, n, self.copy_block):
                raise RuntimeError("no free KV block for a prefix's last block")
        else:
            if not into.table.ensure(dst, n):
                raise RuntimeError("no free KV blocks for a prefix")
            for a, b in zip(self.table.owned[src][:self.table.blocks_for(n)], into.table.owned[dst]):
                for x, y in zip(self.block_tensors(), into.block_tensors()):
                    y[:, b].copy_(x[:, a])

    def copy_rows(self, src: int, dst: int, n: int, into: "KVCache") -> None:
        """`copy_prefix` in the whole-rows layout."""
        raise NotImplementedError

    def block_tensors(self) -> tuple[torch.Tensor, ...]:
        """Paged: the tensors that hold the blocks, [layers, blocks + 1, ...]."""
        return ()

    def copy_block(self, src: int, dst: int) -> None:
        """Paged: block src's contents into block dst (`BlockTable.share`, `truncate`)."""
        for t in self.block_tensors():
            t[:, dst].copy_(t[:, src])

    def row_state(self) -> list[torch.Tensor]:
        """Tensors [layers, rows, ...] a row holds that are not its positions' (a TurboQuant ring): copied whole
        where a sequence resumes from another's row (`CachePool.row_state`)."""
        return []

    def slots(self, start: int, end: int, device=None) -> torch.Tensor:
        """Slots of positions start..end-1 (checked against the capacity), made on `device`."""
        if end > self.max_positions:
            raise IndexError(f"KV cache holds {self.max_positions} positions, asked to write up to {end}")
        pos = torch.arange(start, end, device=device)
        return pos if self.window is None else pos % self.capacity

    def first_visible(self, start: int) -> int:
        """The oldest position a query at `start` (or later) may see."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def nbytes(self) -> int:
        """Bytes its tensors hold (exact on the "meta" device too)."""
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))

    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence costs across all layers."""
        raise NotImplementedError

    def fixed_bytes(self) -> int:
        """Bytes one sequence's cache holds whatever the number of positions."""
        return 0


class DenseKVCache(KVCache):
    """K and V in the model's dtype: one preallocated buffer each, [layers, rows, Hkv, capacity, D] (rows layout), or
    paged (`page`): [layers, blocks + 1, Hkv, page, D] and a `BlockTable` saying which blocks hold a row's
    positions (`cache/blocks.py`; the last block is scratch)."""

    PAGEABLE = True

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", window: int | None = None,
                 page: int | None = None, blocks: int | None = None):
        super().__init__(num_layers, rows, num_kv_heads, head_dim, capacity, window, device)
        self.table = None
        if page is not None:
            if window is not None:
                raise ValueError("a sliding-window KV cache is not paged")
            self.table = BlockTable(rows, blocks, page, capacity, device)
            self.max_positions = self.capacity = self.table.max_positions
            shape = (num_layers, blocks + 1, num_kv_heads, page, head_dim)
        else:
            shape = (num_layers, rows, num_kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def locate(self, meta, rows: torch.Tensor, pos: torch.Tensor, key: str):
        """Where the tokens at cache rows `rows`, positions `pos` (device tensors) are stored: (index along the
        buffers' first dim, slot); paged, derived once a forward (`meta.once` under `key`)."""
        if self.table is None:
            return rows, pos % self.capacity
        page, table = self.table.page, self.table.device
        return meta.once(key, lambda: (table[rows.long(), (pos // page).long()], pos % page))

    def chunk_plan(self, chunks, device):
        """Paged: where a flat step's prompt chunks go and what they read: (block, slot) of every chunk token, the
        blocks of the rows of chunks that start past position 0 (one list), and per chunk None (it starts its row)
        or (first, end of its blocks in that list, its end position)."""
        table, page = self.table, self.table.page
        where, slots, history, spans = [], [], [], []
        for c0, c1, part in chunks:
            start, end = part.start, part.start + c1 - c0
            self.slots(start, end)  # the capacity check
            p = torch.arange(start, end)
            where.append(table.host[part.row0, p // page])
            slots.append(p % page)
            if start == 0:
                spans.append(None)
            else:
                blocks = table.host[part.row0, :table.blocks_for(end)]
                spans.append((sum(map(len, history)), sum(map(len, history)) + len(blocks), end))
                history.append(blocks)
        cat = lambda xs: on_device(torch.cat(xs), torch.long, device)  # noqa: E731
        return cat(where), cat(slots), cat(history) if history else None, spans

    def gather(self, layer: int, row: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged: row's keys and values of positions 0..end-1, [Hkv, end, D] (gathered from its blocks)."""
        blocks = self.table.device[row, :self.table.blocks_for(end)].long()
        gather = lambda x: x.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :end]  # noqa: E731
        return gather(self.k[layer]), gather(self.v[layer])

    @property
    def supports_prefix(self) -> bool:
        return self.window is None

    def copy_rows(self, src, dst, n, into):
        into.k[:, dst, :, :n].copy_(self.k[:, src, :, :n])
        into.v[:, dst, :, :n].copy_(self.v[:, src, :, :n])

    def block_tensors(self):
        return (self.k, self.v) if self.table is not None else ()

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()
