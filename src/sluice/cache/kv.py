"""KV caches of the full-attention layers: dense (the model's dtype) and TurboQuant 4-bit (`cache/turboquant.py`),
either one whole (position p in slot p) or a sliding-window ring buffer (slot p % capacity, capacity = window).

A cache is a pool of `rows` sequences; a forward says which rows and positions its tokens have (`engine/batch.py`
ForwardMeta). A layer hands its new keys and values to `attend`, which stores them and returns the attention of the
new queries over everything the cache lets them see; how a kind holds K/V (and in which domain it attends) is its
own business. The positions, slots and capacity checks are the base class's. The gated attention's output gate,
o * sigmoid(gate), rides along (`attend(..., gate=)`): applied by the decode kernel where there is one, by torch
elsewhere. A decode step may also store its new keys and values itself (its q/k norm + RoPE kernel writes them)
where `append_buffers` hands it the buffers; it then calls `attend` with k = v = None.

Prefill (eager): B sequences in consecutive rows, positions start..start+T-1, as views of those rows. Decode: one
query per sequence, rows and positions as device tensors; on a GPU the split-K kernel reads the rows in place; on the
CPU each row runs alone through the same path a single sequence takes, so a row's result never depends on the batch.
A flat forward (the engine's mixed steps) is its decode tokens as a decode step and each prompt chunk as a prefill.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from sluice.cache.blocks import BlockTable
from sluice.engine.batch import on_device
from sluice.kernels.attention.reference import attention


class KVCache:
    """What every cache kind shares: `rows` sequences of `capacity` positions each, or a ring of `window` slots,
    and the interface the attention layers call (`attend`, `append_buffers`, `dense_buffers`, `bytes_per_token`)."""

    PAGEABLE = False  # whether the kind can keep its positions in blocks (`cache/blocks.py`)
    table = None  # paged: the `BlockTable`

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.num_layers, self.rows, self.num_kv_heads, self.head_dim = num_layers, rows, num_kv_heads, head_dim
        self.window = window
        self.max_positions = capacity
        self.capacity = capacity if window is None else min(capacity, window)  # slots per sequence

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta,
               scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, T, D] with their k, v [B, Hkv, T, D] at meta's rows and positions: store k, v, return the
        attention output [B, Hq, T, D] (causal; with a window W, query p sees keys p-W+1..p), times
        sigmoid(gate [B, Hq, T, D]) if given. k = v = None: a decode step that stored them already
        (`append_buffers`)."""
        if meta.flat:
            return self._attend_flat(layer, q, k, v, meta, scale, gate)
        if meta.decode and self.use_decode_kernel(q):
            return self.decode(layer, q, k, v, meta, scale, gate)
        if not meta.decode:
            o = self.prefill(layer, meta.row0, q, k, v, meta.start, scale)
        else:  # one row at a time, as a sequence alone takes it
            o = torch.cat([self.prefill(layer, row, q[i:i + 1], k[i:i + 1], v[i:i + 1], pos, scale)
                           for i, (row, pos) in enumerate(zip(meta.rows_host, meta.positions_host))])
        return o if gate is None else o * torch.sigmoid(gate)

    def _attend_flat(self, layer, q, k, v, meta, scale, gate):
        """A flat forward (B = 1, `engine/batch.py`): the decode tokens as one decode step, each prompt chunk as its
        own prefill; the padding tokens' output is zero. Static (`static_flat`): every token stored, then each one
        attended as a decode query of its row at its position (the padding's output is then finite, not zero)."""
        if meta.static:
            one = lambda x: None if x is None else x[0].transpose(0, 1)  # noqa: E731  [1, H, T, Dh] -> [T, H, Dh]
            o = self.static_flat(layer, one(q), one(k), one(v), meta, scale, one(gate))
            return o.transpose(0, 1)[None]
        o = torch.zeros_like(q)
        D = meta.decode_tokens
        if D:  # [1, H, D, Dh] -> [D, H, 1, Dh]: one query per sequence
            one = lambda x: None if x is None else x[0, :, :D].transpose(0, 1)[:, :, None].contiguous()  # noqa: E731
            od = self.attend(layer, one(q), one(k), one(v), meta.decodes, scale, one(gate))
            o[0, :, :D] = od[:, :, 0].transpose(0, 1)
        for t0, t1, part in meta.parts:
            cut = lambda x: None if x is None else x[:, :, t0:t1]  # noqa: E731
            o[:, :, t0:t1] = self.attend(layer, cut(q), cut(k), cut(v), part, scale, cut(gate))
        return o

    def prefill(self, layer: int, row0: int, q, k, v, start: int, scale: float) -> torch.Tensor:
        """The B sequences of rows row0.. (eager; every position start..start+T-1 new)."""
        raise NotImplementedError

    @property
    def supports_static_flat(self) -> bool:
        """Whether flat forwards may take the static path (`static_flat`) with this cache."""
        return False

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

    def static_flat(self, layer: int, q, k, v, meta, scale: float, gate=None) -> torch.Tensor:
        """A static flat forward's attention (`engine/batch.py`): q [T, Hq, D], k, v [T, Hkv, D], gate like q or
        None: token t stored at meta.positions[0, t] of row meta.token_rows[t], then attended over its row up to
        its position; [T, Hq, D]. Shapes and launches depend on T only."""
        raise NotImplementedError

    def decode(self, layer: int, q, k, v, meta, scale: float, gate=None) -> torch.Tensor:
        """One query per sequence on a GPU: the split-K kernel over the rows in place (and the gate in its merge)."""
        raise NotImplementedError

    def slots(self, start: int, end: int, device=None) -> torch.Tensor:
        """Slots of positions start..end-1 (checked against the capacity), made on `device`."""
        if end > self.max_positions:
            raise IndexError(f"KV cache holds {self.max_positions} positions, asked to write up to {end}")
        pos = torch.arange(start, end, device=device)
        return pos if self.window is None else pos % self.capacity

    def first_visible(self, start: int) -> int:
        """The oldest position a query at `start` (or later) may see."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def use_decode_kernel(self, x: torch.Tensor) -> bool:
        """Whether a decode step (one new query per sequence) whose activations are like `x` (their device) runs the
        split-K Triton kernel (`kernels/attention/triton.py`): on a GPU."""
        return x.is_cuda

    def append_buffers(self, layer: int, meta, x: torch.Tensor):
        """(k, v, positions, rows) for a decode step (activations like `x`) that writes its new key and value itself,
        into k, v [P, Hkv, cap, D] at [rows[b], :, positions[b] % cap] (a paged cache's rows are blocks, its cap the
        page), then calls `attend` with k = v = None; None where this cache stores them itself."""
        return None

    def dense_buffers(self, layer: int):
        """(k, v) [rows, Hkv, capacity, D] buffers that position p's vectors sit in at slot p, for kernels that
        write in place; None where the cache is not laid out so."""
        return None

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
    positions (`cache/blocks.py`; the last block is scratch). Prefill reads a paged row's keys gathered through its
    table; decode kernels read the blocks in place."""

    PAGEABLE = True

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", window: int | None = None,
                 page: int | None = None, blocks: int | None = None):
        super().__init__(num_layers, rows, num_kv_heads, head_dim, capacity, window)
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

    def _at(self, meta, rows: torch.Tensor, pos: torch.Tensor, key: str):
        """Where the tokens at cache rows `rows`, positions `pos` (device tensors) are stored: (index along the
        buffers' first dim, slot), derived once a forward (`meta.once`)."""
        if self.table is None:
            return rows, pos % self.capacity
        page, table = self.table.page, self.table.device
        return meta.once(key, lambda: (table[rows.long(), (pos // page).long()], pos % page))

    def decode(self, layer, q, k, v, meta, scale, gate=None):
        from sluice.kernels.attention.triton import decode_attention

        pos = meta.last_positions
        if k is not None:  # else stored by the caller (`append_buffers`)
            where, slots = self._at(meta, meta.rows, pos, "kv_decode")
            self.k[layer][where, :, slots] = k[:, :, 0].to(self.k.dtype)
            self.v[layer][where, :, slots] = v[:, :, 0].to(self.v.dtype)
        o = decode_attention(q[:, :, 0], self.k[layer], self.v[layer], pos, scale, min(meta.visible, self.capacity),
                             self.window, rows=meta.rows, gate=None if gate is None else gate[:, :, 0],
                             table=None if self.table is None else self.table.device)
        return o[:, :, None]

    def _attend_flat(self, layer, q, k, v, meta, scale, gate):
        """Paged, a flat step in pieces: the decode tokens as the base class takes them; the prompt chunks stored in
        one go, then each attended over its row: a chunk that starts a row over its own keys, a later one over its
        row's keys gathered (a chunk at a time). The blocks and slots are planned once a forward."""
        if self.table is None or meta.static or not meta.parts:
            return super()._attend_flat(layer, q, k, v, meta, scale, gate)
        chunks = meta.parts
        o = super()._attend_flat(layer, q, k, v, replace(meta, parts=[]), scale, gate) if meta.decode_tokens \
            else torch.zeros_like(q)
        t0, t1 = chunks[0][0], chunks[-1][1]
        where, slots, history, spans = meta.once("kv_paged_chunks", lambda: self._chunk_plan(chunks, q.device))
        kl, vl = self.k[layer], self.v[layer]
        new_k, new_v = k[0, :, t0:t1].to(kl.dtype), v[0, :, t0:t1].to(vl.dtype)
        kl[where, :, slots] = new_k.transpose(0, 1)
        vl[where, :, slots] = new_v.transpose(0, 1)
        for (c0, c1, part), span in zip(chunks, spans):
            if span is None:  # the row's first positions: its own keys
                keys, values = new_k[None, :, c0 - t0:c1 - t0], new_v[None, :, c0 - t0:c1 - t0]
            else:  # gathered a chunk at a time: one row's keys at once (the memory plan reserves that much)
                b0, b1, end = span
                keys, values = (x.index_select(0, history[b0:b1]).transpose(0, 1).flatten(1, 2)[None, :, :end]
                                for x in (kl, vl))
            oc = attention(q[:, :, c0:c1], keys, values, scale)
            o[:, :, c0:c1] = oc if gate is None else oc * torch.sigmoid(gate[:, :, c0:c1])
        return o

    def _chunk_plan(self, chunks, device):
        """Where a flat step's prompt chunks go in a paged cache and what they read: (block, slot) of every chunk
        token, the blocks of the rows of chunks that start past position 0 (one list), and per chunk None (it starts
        its row) or (first, end of its blocks in that list, its end position)."""
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

    def _row(self, layer: int, row: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged: row's keys and values of positions 0..end-1, [Hkv, end, D] (gathered from its blocks)."""
        blocks = self.table.device[row, :self.table.blocks_for(end)].long()
        gather = lambda x: x.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :end]  # noqa: E731
        return gather(self.k[layer]), gather(self.v[layer])

    def prefill(self, layer, row0, q, k, v, start, scale):
        B, T = q.shape[0], k.shape[2]
        end = start + T
        if self.table is not None:
            self.slots(start, end)  # the capacity check
            page, out = self.table.page, []
            p = torch.arange(start, end, device=k.device)
            for b in range(B):
                where = self.table.device[row0 + b, p // page].long()
                self.k[layer][where, :, p % page] = k[b].transpose(0, 1).to(self.k.dtype)
                self.v[layer][where, :, p % page] = v[b].transpose(0, 1).to(self.v.dtype)
                kb, vb = self._row(layer, row0 + b, end)
                out.append(attention(q[b:b + 1], kb[None], vb[None], scale))
            return torch.cat(out)
        kl, vl = self.k[layer][row0:row0 + B], self.v[layer][row0:row0 + B]
        if self.window is None:
            self.slots(start, end)  # the capacity check
            kl[:, :, start:end] = k
            vl[:, :, start:end] = v
            return attention(q, kl[:, :, :end], vl[:, :, :end], scale)
        # ring: the keys older than the chunk still visible to its first query, then the chunk's own, attended
        # with a causal window mask; the chunk is written afterwards, since it may overwrite slots its own first
        # queries still see
        first = self.first_visible(start)
        old = self.slots(first, start, kl.device)
        old_k, old_v = kl.index_select(2, old), vl.index_select(2, old)
        kc, vc = torch.cat([old_k, k.to(old_k.dtype)], dim=2), torch.cat([old_v, v.to(old_v.dtype)], dim=2)
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(first, end, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)
        o = F.scaled_dot_product_attention(q, kc.to(q.dtype), vc.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        keep = min(T, self.capacity)  # the last `capacity` positions of the chunk are what the ring keeps
        idx = self.slots(end - keep, end, kl.device)
        kl.index_copy_(2, idx, k[:, :, T - keep:].to(kl.dtype))
        vl.index_copy_(2, idx, v[:, :, T - keep:].to(vl.dtype))
        return o

    @property
    def supports_static_flat(self) -> bool:
        return self.window is None and self.k.is_cuda

    @property
    def supports_prefix(self) -> bool:
        return self.window is None

    def copy_rows(self, src, dst, n, into):
        into.k[:, dst, :, :n].copy_(self.k[:, src, :, :n])
        into.v[:, dst, :, :n].copy_(self.v[:, src, :, :n])

    def block_tensors(self):
        return (self.k, self.v) if self.table is not None else ()

    def static_flat(self, layer, q, k, v, meta, scale, gate=None):
        from sluice.kernels.attention.triton import decode_attention

        rows, pos = meta.token_rows, meta.positions[0]
        where, slots = self._at(meta, rows, pos, "kv_static")
        self.k[layer][where, :, slots] = k.to(self.k.dtype)
        self.v[layer][where, :, slots] = v.to(self.v.dtype)
        return decode_attention(q.contiguous(), self.k[layer], self.v[layer], pos, scale, self.capacity, rows=rows,
                                gate=None if gate is None else gate.contiguous(),
                                table=None if self.table is None else self.table.device)

    def append_buffers(self, layer, meta, x):
        if not (meta.decode and self.use_decode_kernel(x)):
            return None
        where, _ = self._at(meta, meta.rows, meta.last_positions, "kv_decode")
        return self.k[layer], self.v[layer], meta.last_positions, where

    def dense_buffers(self, layer: int):
        return (self.k[layer], self.v[layer]) if self.window is None and self.table is None else None

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()
