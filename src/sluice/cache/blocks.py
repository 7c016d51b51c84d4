"""Paged KV: which blocks of a KV cache hold each row's positions.

A paged cache keeps K/V as blocks of `page` positions ([blocks + 1, Hkv, page, D] a layer; the last block is
scratch) instead of whole rows of the longest length, so short and long sequences share one pool of blocks. A row's
position p sits in block table[row, p // page] at slot p % page. The table lives on the host (what the scheduler
changes) and on the device (what kernels and captured graphs read; `sync` copies it before a step, only when it
changed). Entries not handed out point at the scratch block, where a captured graph's padding rows write.

Blocks are reference counted: a cached prefix's full blocks are shared with every row that resumes from it (`share`:
no copy; a partial last block is copied, so a row only ever writes into blocks it holds alone). A row that goes on
from a position inside blocks it shares first makes its own copies of them (`truncate`).
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, rows: int, blocks: int, page: int, max_positions: int, device):
        """`rows` table rows (the pool's rows and its scratch row), `blocks` blocks to hand out (block `blocks` is
        the scratch block), `page` positions a block, `max_positions` a row may hold."""
        if page < 1 or blocks < 1:
            raise ValueError(f"a paged KV cache needs blocks >= 1 and page >= 1, got {blocks} and {page}")
        self.page, self.blocks, self.scratch = page, blocks, blocks
        self.width = -(-max_positions // page)  # blocks a row may hold
        self.max_positions = self.width * page
        self.host = torch.full((rows, self.width), blocks, dtype=torch.int32)
        self.device = self.host.to(device)
        self.owned: list[list[int]] = [[] for _ in range(rows)]
        self.refs: dict[int, int] = {}  # holders of each block handed out
        self._free: list[int] = []  # blocks given back (a stack)
        self._fresh = 0  # blocks fresh..blocks-1 were never handed out (no per-block state for a pool's size)
        self._dirty = False

    @property
    def free_blocks(self) -> int:
        return len(self._free) + self.blocks - self._fresh

    def blocks_for(self, n: int) -> int:
        """Blocks that hold n positions."""
        return -(-n // self.page)

    def needs(self, row: int, n: int) -> int:
        """Blocks `row` still lacks to hold positions 0..n-1."""
        return max(0, self.blocks_for(n) - len(self.owned[row]))

    def ensure(self, row: int, n: int) -> bool:
        """Give `row` blocks for positions 0..n-1; False (and nothing given) if too few are free."""
        if n > self.max_positions:
            raise IndexError(f"KV cache rows hold {self.max_positions} positions, asked for {n}")
        want = self.needs(row, n)
        if want > self.free_blocks:
            return False
        for _ in range(want):
            self._append(row, self._take())
        return True

    def share(self, src: int, dst: int, n: int, copy) -> bool:
        """Row dst (holding nothing) takes row src's positions 0..n-1: src's whole blocks shared, a partial last one
        copied into a block of dst's own (`copy(src block, dst block)`). False (nothing done) if no block is free
        for that copy."""
        full, part = divmod(n, self.page)
        if part and not self.free_blocks:
            return False
        for blk in self.owned[src][:full]:
            self.refs[blk] += 1
            self._append(dst, blk)
        if part:
            blk = self._take()
            copy(self.owned[src][full], blk)
            self._append(dst, blk)
        return True

    def truncate(self, row: int, n: int, copy) -> bool:
        """Keep `row`'s positions 0..n-1 only, the blocks past them given back, and the block n falls in made the
        row's own (copied) if it is shared, since the row writes there next. False (nothing done) if that copy finds
        no free block."""
        keep = self.blocks_for(n)
        owned = self.owned[row]
        inside = n % self.page and keep <= len(owned) and self.refs[owned[keep - 1]] > 1
        if inside and not self.free_blocks:
            return False
        for blk in owned[keep:]:
            self._drop(blk)
        del owned[keep:]
        self.host[row, keep:] = self.scratch
        if inside:
            old, blk = owned[keep - 1], self._take()
            copy(old, blk)
            self._drop(old)
            owned[keep - 1] = blk
            self.host[row, keep - 1] = blk
        self._dirty = True
        return True

    def release(self, row: int) -> None:
        """Give every block of `row` back (shared ones stay with their other holders)."""
        for blk in self.owned[row]:
            self._drop(blk)
        self.owned[row] = []
        self.host[row] = self.scratch
        self._dirty = True

    def sync(self) -> None:
        """The device table as the host's (a copy on the current stream, before the step that reads it)."""
        if self._dirty:
            if self.device.is_cuda:
                self.device.copy_(self.host.pin_memory(), non_blocking=True)
            else:
                self.device.copy_(self.host)
            self._dirty = False

    def positions(self, row: int, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) of row's positions start..end-1 on `device` (they must be held)."""
        p = torch.arange(start, end)
        blocks = self.host[row, p // self.page].to(device=device, dtype=torch.long)
        return blocks, (p % self.page).to(device)

    # -- inside ---------------------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            blk = self._free.pop()
        else:
            blk, self._fresh = self._fresh, self._fresh + 1
        self.refs[blk] = 1
        return blk

    def _drop(self, blk: int) -> None:
        self.refs[blk] -= 1
        if self.refs[blk] == 0:
            del self.refs[blk]
            self._free.append(blk)

    def _append(self, row: int, blk: int) -> None:
        owned = self.owned[row]
        if len(owned) >= self.width:
            raise IndexError(f"KV cache rows hold {self.max_positions} positions")
        self.host[row, len(owned)] = blk
        owned.append(blk)
        self._dirty = True
