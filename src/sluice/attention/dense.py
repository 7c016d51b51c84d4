"""Attention over a dense KV cache (`cache/kv.py` `DenseKVCache`: K/V in the model's dtype, whole rows, paged or a
sliding-window ring).

Prefill: the chunk stored, then SDPA over the row's keys up to it (paged: the row's blocks gathered; a ring: the keys
still visible to the chunk's first query, then the chunk's own, under a window mask). Decode on a GPU: the split-K
Triton kernel (`kernels/attention/triton.py`) reading the rows or blocks in place, the output gate in its merge; on
the CPU with fp32 weights, one native C call per sequence doing RoPE, the cache write and the attention
(`rope_decode`, which the layer calls before its own RoPE); elsewhere one row at a time through the prefill path, so
a row's result never depends on its batch. Static flat forwards (GPU, no window): every token a decode query of its
row through the same kernel.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from sluice.attention import AttentionBackend
from sluice.cache.kv import DenseKVCache
from sluice.kernels import cpu as native
from sluice.kernels.attention.reference import attention


class DenseAttention(AttentionBackend):
    name = "dense"
    cache_class = DenseKVCache

    def __init__(self, cache: DenseKVCache):
        super().__init__(cache)
        self.static_flat = cache.window is None and cache.device.type == "cuda"
        # the CPU's one C call per decoding sequence: fp32, whole rows, no window
        self.native_decode = (cache.device.type == "cpu" and cache.dtype == torch.float32 and cache.window is None
                              and cache.table is None and native.available())

    def rope_decode(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, scale: float,
                    num_heads: int) -> torch.Tensor:
        """`native_decode`: a decode step's fused qkv [B, 1, (H + 2 Hkv) D] (before RoPE) through the C kernel, one
        call per sequence: RoPE, the cache write, the attention; [B, H, D]."""
        from sluice.kernels.attention import cpu as attention_cpu

        c = self.cache
        B, D = qkv.shape[0], c.head_dim
        qkv = qkv.view(B, num_heads + 2 * c.num_kv_heads, D)
        k_cache, v_cache = c.k[layer], c.v[layer]
        return torch.stack([attention_cpu.decode_step(qkv[i], cos[i, 0], sin[i, 0], k_cache[row], v_cache[row], pos,
                                                      scale)
                            for i, (row, pos) in enumerate(zip(meta.rows_host, meta.positions_host))])

    def decode(self, layer, q, k, v, meta, scale, gate=None):
        from sluice.kernels.attention.triton import decode_attention

        c = self.cache
        pos = meta.last_positions
        if k is not None:  # else stored by the caller (`append_buffers`)
            where, slots = c.locate(meta, meta.rows, pos, "kv_decode")
            c.k[layer][where, :, slots] = k[:, :, 0].to(c.dtype)
            c.v[layer][where, :, slots] = v[:, :, 0].to(c.dtype)
        o = decode_attention(q[:, :, 0], c.k[layer], c.v[layer], pos, scale, min(meta.visible, c.capacity),
                             c.window, rows=meta.rows, gate=None if gate is None else gate[:, :, 0],
                             table=None if c.table is None else c.table.device)
        return o[:, :, None]

    def flat(self, layer, q, k, v, meta, scale, gate):
        """Paged, a flat step in pieces: the decode tokens as the base class takes them; the prompt chunks stored in
        one go, then each attended over its row: a chunk that starts a row over its own keys, a later one over its
        row's keys gathered (a chunk at a time). The blocks and slots are planned once a forward."""
        c = self.cache
        if c.table is None or meta.static or not meta.parts:
            return super().flat(layer, q, k, v, meta, scale, gate)
        chunks = meta.parts
        o = super().flat(layer, q, k, v, replace(meta, parts=[]), scale, gate) if meta.decode_tokens \
            else torch.zeros_like(q)
        t0, t1 = chunks[0][0], chunks[-1][1]
        where, slots, history, spans = meta.once("kv_paged_chunks", lambda: c.chunk_plan(chunks, q.device))
        kl, vl = c.k[layer], c.v[layer]
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

    def prefill(self, layer, row0, q, k, v, start, scale):
        c = self.cache
        B, T = q.shape[0], k.shape[2]
        end = start + T
        if c.table is not None:
            c.slots(start, end)  # the capacity check
            page, out = c.table.page, []
            p = torch.arange(start, end, device=k.device)
            for b in range(B):
                where = c.table.device[row0 + b, p // page].long()
                c.k[layer][where, :, p % page] = k[b].transpose(0, 1).to(c.dtype)
                c.v[layer][where, :, p % page] = v[b].transpose(0, 1).to(c.dtype)
                kb, vb = c.gather(layer, row0 + b, end)
                out.append(attention(q[b:b + 1], kb[None], vb[None], scale))
            return torch.cat(out)
        kl, vl = c.k[layer][row0:row0 + B], c.v[layer][row0:row0 + B]
        if c.window is None:
            c.slots(start, end)  # the capacity check
            kl[:, :, start:end] = k
            vl[:, :, start:end] = v
            return attention(q, kl[:, :, :end], vl[:, :, :end], scale)
        # ring: the keys older than the chunk still visible to its first query, then the chunk's own, attended
        # with a causal window mask; the chunk is written afterwards, since it may overwrite slots its own first
        # queries still see
        first = c.first_visible(start)
        old = c.slots(first, start, kl.device)
        old_k, old_v = kl.index_select(2, old), vl.index_select(2, old)
        kc, vc = torch.cat([old_k, k.to(old_k.dtype)], dim=2), torch.cat([old_v, v.to(old_v.dtype)], dim=2)
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(first, end, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - c.window)
        o = F.scaled_dot_product_attention(q, kc.to(q.dtype), vc.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        keep = min(T, c.capacity)  # the last `capacity` positions of the chunk are what the ring keeps
        idx = c.slots(end - keep, end, kl.device)
        kl.index_copy_(2, idx, k[:, :, T - keep:].to(kl.dtype))
        vl.index_copy_(2, idx, v[:, :, T - keep:].to(vl.dtype))
        return o

    def static(self, layer, q, k, v, meta, scale, gate=None):
        from sluice.kernels.attention.triton import decode_attention

        c = self.cache
        rows, pos = meta.token_rows, meta.positions[0]
        where, slots = c.locate(meta, rows, pos, "kv_static")
        c.k[layer][where, :, slots] = k.to(c.dtype)
        c.v[layer][where, :, slots] = v.to(c.dtype)
        return decode_attention(q.contiguous(), c.k[layer], c.v[layer], pos, scale, c.capacity, rows=rows,
                                gate=None if gate is None else gate.contiguous(),
                                table=None if c.table is None else c.table.device)

    def append_buffers(self, layer, meta):
        if not (meta.decode and self.decode_kernel):
            return None
        c = self.cache
        where, _ = c.locate(meta, meta.rows, meta.last_positions, "kv_decode")
        return c.k[layer], c.v[layer], meta.last_positions, where
