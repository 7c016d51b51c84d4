"""The latent KV cache of multi-head latent attention (DeepSeek-V2/V3 MLA): per layer, row and position the
normalised latent (kv_lora_rank values) and the roped key shared by all heads (qk_rope_head_dim), one
[layers, rows, capacity, kv_lora_rank + rope] tensor in the model's dtype (576 values a token and layer for V3).

It is a `KVCache` (one "head" of kv_lora_rank + rope values), so the pool's capacity, sizing and bytes per token
read it as they read the dense cache; what differs is `attend`, which takes MLA's pieces (`layers/mla.py`):

* prefill (B sequences in consecutive rows, positions start..start+T-1): the chunk stored, then the keys and values
  of every position so far decompressed through kv_b_proj and attended (`kernels/mla/reference.py`);
* decode (one query per sequence): the token stored at its row and position, then the absorbed form over the
  latents as they are; on the CPU one row at a time over exactly its positions, so a row never depends on its
  batch; on a GPU all rows at once over the `visible` positions, masked past each row's own: device tensors only,
  so a decode graph captures it, and eager steps take the same path (graphs change speed, not results); there
  the split-K Triton kernel (`kernels/mla/triton.py`, `use_decode_kernel`) reads each latent once for all heads;
* flat (the engine's mixed steps): the decode tokens as one decode step, each prompt chunk as its own prefill, the
  padding's output zero.
"""

from __future__ import annotations

import torch

from sluice.cache.blocks import BlockTable
from sluice.cache.kv import KVCache
from sluice.kernels.mla import kernels as mla_kernels
from sluice.kernels.mla.reference import absorbed_attention, decompressed_attention


class LatentCache(KVCache):
    PAGEABLE = True

    def __init__(self, num_layers: int, rows: int, kv_lora_rank: int, rope_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", page: int | None = None,
                 blocks: int | None = None):
        super().__init__(num_layers, rows, 1, kv_lora_rank + rope_dim, capacity)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        C = kv_lora_rank + rope_dim
        if page is not None:  # paged: [layers, blocks + 1, page, C], the last block scratch (`cache/blocks.py`)
            self.table = BlockTable(rows, blocks, page, capacity, device)
            self.max_positions = self.capacity = self.table.max_positions
            self.latent = torch.zeros(num_layers, blocks + 1, page, C, dtype=dtype, device=device)
        else:
            self.latent = torch.zeros(num_layers, rows, capacity, C, dtype=dtype, device=device)

    def _row(self, layer: int, row: int, end: int) -> torch.Tensor:
        """Positions 0..end-1 of a row, [end, C]: a view of its row, or its blocks gathered (paged)."""
        if self.table is None:
            return self.latent[layer][row, :end]
        blocks = self.table.device[row, :self.table.blocks_for(end)].long()
        return self.latent[layer].index_select(0, blocks).flatten(0, 1)[:end]

    def _store(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, new: torch.Tensor, meta=None) -> None:
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

    def attend(self, layer: int, q_nope, q_pe, c, k_pe, meta, scale: float, w_uk, w_uv) -> torch.Tensor:
        """Store the new tokens' latents c [B, T, R] and roped keys k_pe [B, T, rope] at meta's rows and positions
        and return the attention of their queries q_nope [B, T, H, nope], q_pe [B, T, H, rope] over everything
        their rows hold up to them: [B, T, H, v] (w_uk [H, nope, R], w_uv [H, v, R]: kv_b_proj per head)."""
        if meta.flat:
            return self._attend_flat(layer, q_nope, q_pe, c, k_pe, meta, scale, w_uk, w_uv)
        new = torch.cat([c, k_pe], dim=-1).to(self.latent.dtype)
        cache = self.latent[layer]
        if not meta.decode:
            B, T = c.shape[:2]
            end = meta.start + T
            self.slots(meta.start, end)  # the capacity check
            R = self.kv_lora_rank
            if self.table is None:
                rows = cache[meta.row0:meta.row0 + B]
                rows[:, meta.start:end] = new
            else:  # paged: each row's chunk stored through its table, its positions gathered
                p = torch.arange(meta.start, end, device=c.device)
                for b in range(B):
                    self._store(layer, torch.full_like(p, meta.row0 + b), p, new[b])
                rows = torch.stack([self._row(layer, meta.row0 + b, end) for b in range(B)])
            return decompressed_attention(q_nope, q_pe, rows[:, :end, :R], rows[:, :end, R:], w_uk, w_uv, scale)
        if meta.rows_host is not None and not cache.is_cuda:  # one row at a time, exactly its positions
            out = []
            for i, (row, pos) in enumerate(zip(meta.rows_host, meta.positions_host)):
                if pos >= self.max_positions:
                    raise IndexError(f"KV cache holds {self.max_positions} positions, asked to write {pos}")
                self._store(layer, torch.tensor([row]), torch.tensor([pos]), new[i])
                out.append(absorbed_attention(q_nope[i:i + 1], q_pe[i:i + 1], self._row(layer, row, pos + 1)[None],
                                              w_uk, w_uv, scale))
            return torch.cat(out)
        # on a GPU (captured or not, the same path): all rows over the visible positions, masked
        rows, pos = meta.rows.long(), meta.last_positions.long()
        self._store(layer, rows, pos, new[:, 0], meta)
        visible = min(meta.visible, self.capacity)
        table = None if self.table is None else self.table.device
        if self.use_decode_kernel(q_nope) and mla_kernels():  # the split-K Triton kernel over the stored latents
            from sluice.kernels.mla.triton import absorbed_decode

            return absorbed_decode(q_nope[:, 0], q_pe[:, 0], cache, meta.rows, meta.last_positions.contiguous(),
                                   visible, w_uk, w_uv, scale, table=table)[:, None]
        if table is None:
            seen = cache[rows, :visible]
        else:  # each row's blocks gathered
            nb = self.table.blocks_for(visible)
            seen = cache[table[rows, :nb].long()].flatten(1, 2)[:, :visible]
        return absorbed_attention(q_nope, q_pe, seen, w_uk, w_uv, scale, meta.positions)

    def _attend_flat(self, layer, q_nope, q_pe, c, k_pe, meta, scale, w_uk, w_uv):
        """A flat forward (B = 1): the decode tokens as one decode step, each prompt chunk as its own prefill; the
        padding tokens' output is zero."""
        H, v = w_uv.shape[:2]
        out = q_nope.new_zeros(*q_nope.shape[:2], H, v)
        D = meta.decode_tokens
        if D:  # [1, D, ...] -> [D, 1, ...]: one query per sequence
            one = lambda x: x[0, :D, None]  # noqa: E731
            out[0, :D] = self.attend(layer, one(q_nope), one(q_pe), one(c), one(k_pe), meta.decodes, scale, w_uk,
                                     w_uv)[:, 0]
        for t0, t1, part in meta.parts:
            cut = lambda x: x[:, t0:t1]  # noqa: E731
            out[:, t0:t1] = self.attend(layer, cut(q_nope), cut(q_pe), cut(c), cut(k_pe), part, scale, w_uk, w_uv)
        return out


def make_latent_cache(kind: str, num_layers: int, rows: int, kv_lora_rank: int, rope_dim: int, capacity: int,
                      dtype: torch.dtype, device, page: int | None = None, blocks: int | None = None) -> LatentCache:
    """The cache of an MLA model for KV cache kind `kind`: "dense" (the default kind) is the latent cache in the
    model's dtype; other kinds (TurboQuant codes of per-head K/V) do not apply to latents: ValueError."""
    if kind != "dense":
        raise ValueError(f"multi-head latent attention keeps a latent cache; the {kind!r} KV cache does not apply "
                         "to it")
    return LatentCache(num_layers, rows, kv_lora_rank, rope_dim, capacity, dtype, device, page, blocks)
