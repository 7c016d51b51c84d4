"""Attention over a latent cache (`cache/latent.py`): multi-head latent attention (DeepSeek-V2/V3 MLA) as
`layers/mla.py` hands it its pieces.

* prefill (B sequences in consecutive rows, positions start..start+T-1): the chunk stored, then the keys and values
  of every position so far decompressed through kv_b_proj and attended (`kernels/mla/reference.py`);
* decode (one query per sequence): the token stored at its row and position, then the absorbed form over the
  latents as they are; on the CPU one row at a time over exactly its positions, so a row never depends on its
  batch; on a GPU all rows at once over the `visible` positions, masked past each row's own: device tensors only,
  so a decode graph captures it, and eager steps take the same path (graphs change speed, not results); there
  the split-K Triton kernel (`kernels/mla/triton.py`, `decode_kernel`) reads each latent once for all heads;
* flat (the engine's mixed steps): the decode tokens as one decode step, each prompt chunk as its own prefill, the
  padding's output zero.
"""

from __future__ import annotations

import torch

from sluice.attention import AttentionBackend
from sluice.cache.latent import LatentCache
from sluice.kernels.mla import kernels as mla_kernels
from sluice.kernels.mla.reference import absorbed_attention, decompressed_attention


class MLAAttention(AttentionBackend):
    name = "mla"
    cache_class = LatentCache
    flat_axis = 1  # a flat forward's tensors: q_nope [1, T, H, nope], c [1, T, R], ...
    flat_contiguous = False  # its decode step takes views

    def __init__(self, cache: LatentCache):
        super().__init__(cache)
        self.decode_kernel = self.decode_kernel and mla_kernels()  # the split-K Triton kernel over the latents
        if cache.device.type == "cuda":  # a later chunk's causal mask (`kernels/attention/reference.py`): imported
            import torch.nn.attention.bias  # noqa: F401  now, not seconds into a serving step (it loads torch._dynamo)

    def forward(self, layer: int, q_nope, q_pe, c, k_pe, meta, scale: float, w_uk, w_uv) -> torch.Tensor:
        """Store the new tokens' latents c [B, T, R] and roped keys k_pe [B, T, rope] at meta's rows and positions
        and return the attention of their queries q_nope [B, T, H, nope], q_pe [B, T, H, rope] over everything
        their rows hold up to them: [B, T, H, v] (w_uk [H, nope, R], w_uv [H, v, R]: kv_b_proj per head)."""
        if meta.flat:
            return self.flat(layer, q_nope, q_pe, c, k_pe, meta, scale, w_uk, w_uv)
        lc = self.cache
        new = torch.cat([c, k_pe], dim=-1).to(lc.latent.dtype)
        cache = lc.latent[layer]
        if not meta.decode:
            B, T = c.shape[:2]
            end = meta.start + T
            lc.slots(meta.start, end)  # the capacity check
            R = lc.kv_lora_rank
            if lc.table is None:
                rows = cache[meta.row0:meta.row0 + B]
                rows[:, meta.start:end] = new
            else:  # paged: each row's chunk stored through its table, its positions gathered
                p = torch.arange(meta.start, end, device=c.device)
                for b in range(B):
                    lc.store(layer, torch.full_like(p, meta.row0 + b), p, new[b])
                rows = torch.stack([lc.gather(layer, meta.row0 + b, end) for b in range(B)])
            return decompressed_attention(q_nope, q_pe, rows[:, :end, :R], rows[:, :end, R:], w_uk, w_uv, scale)
        if meta.rows_host is not None and not cache.is_cuda:  # one row at a time, exactly its positions
            out = []
            for i, (row, pos) in enumerate(zip(meta.rows_host, meta.positions_host)):
                if pos >= lc.max_positions:
                    raise IndexError(f"KV cache holds {lc.max_positions} positions, asked to write {pos}")
                lc.store(layer, torch.tensor([row]), torch.tensor([pos]), new[i])
                out.append(absorbed_attention(q_nope[i:i + 1], q_pe[i:i + 1], lc.gather(layer, row, pos + 1)[None],
                                              w_uk, w_uv, scale))
            return torch.cat(out)
        # on a GPU (captured or not, the same path): all rows over the visible positions, masked
        rows, pos = meta.rows.long(), meta.last_positions.long()
        lc.store(layer, rows, pos, new[:, 0], meta)
        visible = min(meta.visible, lc.capacity)
        table = None if lc.table is None else lc.table.device
        if self.decode_kernel:  # the split-K Triton kernel over the stored latents
            from sluice.kernels.mla.triton import absorbed_decode

            return absorbed_decode(q_nope[:, 0], q_pe[:, 0], cache, meta.rows, meta.last_positions.contiguous(),
                                   visible, w_uk, w_uv, scale, table=table)[:, None]
        if table is None:
            seen = cache[rows, :visible]
        else:  # each row's blocks gathered
            nb = lc.table.blocks_for(visible)
            seen = cache[table[rows, :nb].long()].flatten(1, 2)[:, :visible]
        return absorbed_attention(q_nope, q_pe, seen, w_uk, w_uv, scale, meta.positions)

    def fuses_decode(self, x: torch.Tensor) -> bool:
        """Whether a decode step (not flat) takes `fused_decode`: the split-K kernel is on and the cache is where x
        is (a GPU; the interpreter tests' CPU)."""
        return bool(self.decode_kernel) and self.cache.latent.device == x.device

    def fused_decode(self, layer: int, q, kv, cos, sin, norm_weight, eps: float, meta, scale: float, w_uk, w_uv,
                     dtype: torch.dtype) -> torch.Tensor:
        """A decode step from the projections as they come out of their GEMVs (`kernels/mla/fused.py`): q [S, B,
        H * (nope + rope)] and kv [S, B, R + rope] (split-K partials, or S = 1 and the outputs), cos, sin [B, rope]:
        the latent normed (norm_weight, eps) and the key roped and stored, q roped and folded through W_UK (one
        launch), the split kernel and its merge over the stored latents, W_UV (one launch). Returns o_proj's
        input [B, H * v] in dtype. What `forward` computes from the pieces, with fewer roundings moved: none."""
        from sluice.kernels.mla import fused
        from sluice.kernels.mla.triton import mla_decode

        lc = self.cache
        cache = lc.latent[layer]
        table = None if lc.table is None else lc.table.device
        positions = meta.last_positions
        positions = positions if positions.is_contiguous() else positions.contiguous()
        q_lat, q_pe = fused.mla_prep(q, kv, cos, sin, norm_weight, eps, w_uk, cache, meta.rows, positions, table,
                                     dtype)
        visible = min(meta.visible, lc.capacity)
        o_lat = mla_decode(q_lat, q_pe, cache, meta.rows, positions, visible, scale, table=table)
        return fused.uv_out(o_lat, w_uv, dtype)

    def flat(self, layer, q_nope, q_pe, c, k_pe, meta, scale, w_uk, w_uv):
        """A flat forward (B = 1): the decode tokens as one decode step, each prompt chunk as its own prefill
        (`split_flat`); the padding tokens' output is zero."""
        H, v = w_uv.shape[:2]
        return self.split_flat(q_nope.new_zeros(*q_nope.shape[:2], H, v), meta, (q_nope, q_pe, c, k_pe),
                               lambda part, *x: self.forward(layer, *x, part, scale, w_uk, w_uv))


def make_mla_attention(kind: str, num_layers: int, rows: int, kv_lora_rank: int, rope_dim: int, capacity: int,
                       dtype: torch.dtype, device, page: int | None = None, blocks: int | None = None) -> MLAAttention:
    """The backend of an MLA model for KV cache kind `kind`: "dense" (the default kind) is the latent cache in the
    model's dtype; other kinds (TurboQuant codes of per-head K/V) do not apply to latents: ValueError."""
    if kind != "dense":
        raise ValueError(f"multi-head latent attention keeps a latent cache; the {kind!r} KV cache does not apply "
                         "to it")
    return MLAAttention(LatentCache(num_layers, rows, kv_lora_rank, rope_dim, capacity, dtype, device, page, blocks))
