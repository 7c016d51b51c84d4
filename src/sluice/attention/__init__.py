"""Attention backends: how a model's attention layers read and write their KV cache (vLLM v1's
`attention/backends/*` split). `cache/` holds storage only (the tensors, their layout, the block table); a backend
holds the attention algorithm over one cache kind and every choice of implementation for it, made once when the
pool is made (`make_attention`), not per call:

* `dense.DenseAttention` over `DenseKVCache` (K/V in the model's dtype; whole rows, paged or a ring): prefill on
  SDPA; decode on the split-K Triton kernel (GPU), the native C step fused with RoPE (CPU, fp32), else torch.
* `turboquant.TurboQuantAttention` over `TurboQuantKVCache` (4-bit codes and an exact ring of the newest
  positions): prefill banded exact + coded (flash); decode on the split-K CUDA C or Triton kernel over the codes
  (GPU), a C call (CPU).
* `mla.MLAAttention` over `LatentCache` (the latent and the roped key): prefill with K/V decompressed (SDPA);
  decode absorbed, on the split-K Triton kernel (GPU), else torch.

Every backend takes the same forwards (`engine/batch.py` ForwardMeta): a prefill (B sequences in consecutive rows,
positions start..start+T-1), a decode (one query per sequence at device rows and positions: what a CUDA graph
captures), or a flat forward (B = 1: the engine's mixed steps, its decode tokens as one decode and each prompt chunk
as a prefill; or static, every token a decode query of its row, `static_flat`). Per-step metadata (the blocks and
slots a forward's tokens take, a paged step's chunk plan) is derived once a forward by the first layer that needs it
(`meta.once`) and shared by the rest.
"""

from __future__ import annotations

import torch

from sluice.cache import KV_CACHE_KINDS
from sluice.cache.kv import KVCache


class AttentionBackend:
    """Attention over one KV cache (`self.cache`) for all the attention layers of a pool. What it supports and which
    kernels it runs are attributes decided in `__init__` from the cache (its device, dtype, layout)."""

    name = "?"
    static_flat = False  # whether flat forwards may take the static path (one CUDA graph each, `static`)
    native_decode = False  # a CPU decode step fused with the layer's RoPE (`rope_decode`)
    flat_axis = 2  # the token axis of a flat forward's tensors (`split_flat`): q [1, H, T, Dh]
    flat_contiguous = True  # a flat step's decode tokens copied contiguous for their decode step (its kernels')

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.decode_kernel = cache.device.type == "cuda"  # one query per sequence: the split-K kernel

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta,
                scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, T, D] with their k, v [B, Hkv, T, D] at meta's rows and positions: store k, v, return the
        attention output [B, Hq, T, D] (causal; with a window W, query p sees keys p-W+1..p), times
        sigmoid(gate [B, Hq, T, D]) if given. k = v = None: a decode step that stored them already
        (`append_buffers`)."""
        if meta.flat:
            return self.flat(layer, q, k, v, meta, scale, gate)
        if meta.decode and self.decode_kernel:
            return self.decode(layer, q, k, v, meta, scale, gate)
        if not meta.decode:
            o = self.prefill(layer, meta.row0, q, k, v, meta.start, scale)
        else:  # one row at a time, as a sequence alone takes it
            o = torch.cat([self.prefill(layer, row, q[i:i + 1], k[i:i + 1], v[i:i + 1], pos, scale)
                           for i, (row, pos) in enumerate(zip(meta.rows_host, meta.positions_host))])
        return o if gate is None else o * torch.sigmoid(gate)

    def flat(self, layer, q, k, v, meta, scale, gate):
        """A flat forward (B = 1, `engine/batch.py`): the decode tokens as one decode step, each prompt chunk as its
        own prefill (`split_flat`); the padding tokens' output is zero. Static (`static_flat`): every token stored,
        then each one attended as a decode query of its row at its position (the padding's output is then finite,
        not zero)."""
        if meta.static:
            def one(x):  # [1, H, T, Dh] -> [T, H, Dh]
                return None if x is None else x[0].transpose(0, 1)

            o = self.static(layer, one(q), one(k), one(v), meta, scale, one(gate))
            return o.transpose(0, 1)[None]
        return self.split_flat(torch.zeros_like(q), meta, (q, k, v, gate),
                               lambda part, q, k, v, gate: self.forward(layer, q, k, v, part, scale, gate))

    def split_flat(self, out: torch.Tensor, meta, tensors, attend) -> torch.Tensor:
        """What every backend's flat forward shares: the decode tokens attended as one decode step (`meta.decodes`,
        one query per sequence), each prompt chunk as a prefill of its own (`meta.parts`), each by
        `attend(meta, *tensors)` over the per-token `tensors` cut to its tokens along `flat_axis` (None stays None);
        every output written into `out` at its tokens, the padding's left as it was."""
        a = self.flat_axis
        D = meta.decode_tokens
        if D:  # [1, .., T, ..] -> [D, .., 1, ..]: one query per sequence, and back
            def one(x):
                if x is None:
                    return None
                x = x[0].narrow(a - 1, 0, D).movedim(a - 1, 0).unsqueeze(a)
                return x.contiguous() if self.flat_contiguous else x

            od = attend(meta.decodes, *(one(x) for x in tensors))
            out[0].narrow(a - 1, 0, D).copy_(od.select(a, 0).movedim(0, a - 1))
        for t0, t1, part in meta.parts:
            cut = [None if x is None else x.narrow(a, t0, t1 - t0) for x in tensors]
            out.narrow(a, t0, t1 - t0).copy_(attend(part, *cut))
        return out

    def prefill(self, layer: int, row0: int, q, k, v, start: int, scale: float) -> torch.Tensor:
        """The B sequences of rows row0.. (eager; every position start..start+T-1 new)."""
        raise NotImplementedError

    def decode(self, layer: int, q, k, v, meta, scale: float, gate=None) -> torch.Tensor:
        """One query per sequence on a GPU: the split-K kernel over the rows in place (and the gate in its merge)."""
        raise NotImplementedError

    def static(self, layer: int, q, k, v, meta, scale: float, gate=None) -> torch.Tensor:
        """A static flat forward's attention (`engine/batch.py`): q [T, Hq, D], k, v [T, Hkv, D], gate like q or
        None: token t stored at meta.positions[0, t] of row meta.token_rows[t], then attended over its row up to
        its position; [T, Hq, D]. Shapes and launches depend on T only."""
        raise NotImplementedError

    def append_buffers(self, layer: int, meta):
        """(k, v, positions, rows) for a decode step that writes its new key and value itself (the q/k norm + RoPE
        kernel), into k, v [P, Hkv, cap, D] at [rows[b], :, positions[b] % cap] (a paged cache's rows are blocks,
        its cap the page), then calls `forward` with k = v = None; None where the backend stores them itself."""


def make_attention(kind: str, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                   dtype: torch.dtype, device, window: int | None = None, page: int | None = None,
                   blocks: int | None = None) -> AttentionBackend:
    """The backend of KV cache kind `kind` over a cache it makes: paged (`page` positions a block, `blocks` of them)
    where the kind pages (`PAGEABLE`) and there is no window, else whole rows."""
    from sluice.attention.dense import DenseAttention
    from sluice.attention.turboquant import TurboQuantAttention

    backends = {"dense": DenseAttention, "turboquant4": TurboQuantAttention}
    if kind not in backends:
        raise ValueError(f"unknown KV cache kind {kind!r}; use one of {', '.join(KV_CACHE_KINDS)}")
    backend = backends[kind]
    cls = backend.cache_class
    paged = {} if page is None or window is not None or not cls.PAGEABLE else {"page": page, "blocks": blocks}
    return backend(cls(num_layers, rows, num_kv_heads, head_dim, capacity, dtype, device, window, **paged))
