"""Attention over a TurboQuant 4-bit KV cache (`cache/turboquant.py` `TurboQuantKVCache`), in the rotated domain: q
is rotated once, the output rotated back once. A query at position p reads key/value j exactly (the ring of the
newest `recent` positions) when p - j < recent, from the codes otherwise.

Prefill: two attentions merged by their log-sum-exps, the banded exact one (`_recent_attention`) and the lagged one
over the coded keys (`_lagged_attention`: SDPA's flash kernel on a GPU in half precision, else explicit scores in
blocks); on CUDA without a window the chunk is stored first in one launch and the codes read back in place. Decode on
a GPU: quantize-on-append (`decode_step_prep`), then the split-K kernel on the codes and the ring (CUDA C where it
applies, else Triton); on the CPU with an fp32 ring, one C call appends and attends over the codes in place
(`cpu_kernel`; it reads rows, so a paged cache takes the torch path). A paged cache's codes are read and written in
place through the device table; the torch paths gather a row's blocks through it (no host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.attention import AttentionBackend
from sluice.cache.turboquant import TurboQuantKVCache
from sluice.kernels.turboquant import reference as tq

SCORE_ELEMENTS = 1 << 26  # prefill attention off the flash kernel: fp32 scores held at once (256 MB)


class TurboQuantAttention(AttentionBackend):
    name = "turboquant4"
    cache_class = TurboQuantKVCache

    def __init__(self, cache: TurboQuantKVCache, score_elements: int = SCORE_ELEMENTS):
        from sluice.kernels.cpu import available

        super().__init__(cache)
        self.score_elements = score_elements  # prefill off the flash kernel: fp32 scores held at once
        # the GPU kernel needs at least 16 bytes of codes per vector (head dim >= 32); smaller heads take torch
        self.decode_kernel = self.decode_kernel and cache.head_dim >= 32
        # the CPU's C kernel: whole rows, an fp32 ring (the torch path dequantizes the whole history every step)
        self.cpu_kernel = (cache.table is None and cache.device.type == "cpu" and cache.k_recent.dtype == torch.float32
                           and cache.head_dim <= 512 and available())

    def prefill(self, layer: int, row0: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                scale: float) -> torch.Tensor:
        c = self.cache
        if q.shape[2] == 1 and self.cpu_kernel:
            return self._decode_cpu(layer, row0, q, k, v, start, scale)
        B = q.shape[0]
        rows = slice(row0, row0 + B)
        layers = [t[layer] for t in (c.k_codes, c.v_codes, c.k_scale, c.v_scale, c.k_recent,
                                     c.v_recent)]
        # the rows' codes and scales (paged: all the blocks, and the rows' table rows), their rings
        table = None if c.table is None else c.table.device
        k_codes, v_codes, k_scale, v_scale = (t[rows] if table is None else t for t in layers[:4])
        k_recent, v_recent = (t[rows] for t in layers[4:])
        T = q.shape[2]
        end = start + T
        first = c.first_visible(start)
        # on a GPU the attention reads bf16/fp16 keys on SDPA's flash kernel; in fp32 SDPA has no fused kernel for
        # head dim 256
        fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
        dt = q.dtype if fused else torch.float32
        # query p reads key j exactly when p - j < recent (the ring's positions before the chunk, then the chunk's
        # own), from the codes when p - j >= recent: two attentions, merged by their log-sum-exps
        e0 = max(first, start - c.recent + 1)
        ring = torch.arange(e0, start, device=q.device) % c.recent
        ke, ve = k_recent.index_select(2, ring).float(), v_recent.index_select(2, ring).float()  # before any store
        last = end - c.recent  # coded keys: positions first .. last - 1, the ones the chunk's last query reads
        coded = last > first and (c.window is None or c.window > c.recent)
        # on CUDA without a window the chunk is stored first, in one launch (`append_chunk`: codes, scales, ring,
        # q rotated), and every coded key read back from the slots; a window's ring may still hold, in the slots
        # the chunk takes, keys its first queries see: there (and off CUDA) the store comes last
        stored_first = q.is_cuda and c.window is None and 16 <= c.head_dim <= 256
        yk, yv = _rotate(k), _rotate(v)  # the chunk rotated once: its exact copies (and below, its codes)
        if stored_first:
            from sluice.kernels.turboquant.triton import append_chunk

            c.slots(start, end)  # the capacity check
            qr = append_chunk(q, k, v, *layers, row0, start, table=table)
        else:
            (kc, ks), (vc, vs) = tq.quantize_rotated(yk), tq.quantize_rotated(yv)
            qr = _rotate(q)
        ke, ve = torch.cat([ke, yk], dim=2), torch.cat([ve, yv], dim=2)
        o, lse = _recent_attention(qr, ke, ve, scale, start, e0, min(c.recent, c.window or c.recent))
        if coded:
            tab = None if table is None else table[rows]
            if stored_first:
                kq = self._coded(k_codes, k_scale, first, last - first, dt, table=tab)
                vq = self._coded(v_codes, v_scale, first, last - first, dt, table=tab)
            else:  # stored before the chunk, then the chunk's own
                old, new = min(start, last) - first, max(0, last - start)
                kq = self._coded(k_codes, k_scale, first, old, dt, (kc[:, :, :new], ks[:, :, :new]), tab)
                vq = self._coded(v_codes, v_scale, first, old, dt, (vc[:, :, :new], vs[:, :, :new]), tab)
            oc, lc = _lagged_attention(qr.to(dt), kq, vq, scale, start, first, c.recent, c.window,
                                       self.score_elements, fused)
            total = torch.logaddexp(lse, lc)
            o = o * (lse - total).exp()[..., None] + oc * (lc - total).exp()[..., None]
        if not stored_first:  # codes of the chunk (its last `capacity` positions), exact copies of its last `recent`
            if table is not None:  # at their (block, slot), from the device table
                p = c.slots(start, end, q.device)
                blk, slot = table[rows, p // c.table.page].long(), p % c.table.page  # [B, T], [T]
                k_codes[blk, :, slot] = kc.transpose(1, 2)
                v_codes[blk, :, slot // 4, :, slot % 4] = vc.transpose(1, 2)
                k_scale[blk, :, slot] = ks.transpose(1, 2)
                v_scale[blk, :, slot] = vs.transpose(1, 2)
            else:
                slots = c.slots(end - min(T, c.capacity), end, q.device)
                keep = len(slots)
                k_codes.index_copy_(2, slots, kc[:, :, T - keep:])
                v_codes[:, :, slots // 4, :, slots % 4] = vc[:, :, T - keep:].permute(2, 0, 1, 3)
                k_scale.index_copy_(2, slots, ks[:, :, T - keep:])
                v_scale.index_copy_(2, slots, vs[:, :, T - keep:])
            r = min(T, c.recent)
            ring = torch.arange(end - r, end, device=q.device) % c.recent
            k_recent.index_copy_(2, ring, ke[:, :, -r:].to(k_recent.dtype))
            v_recent.index_copy_(2, ring, ve[:, :, -r:].to(v_recent.dtype))
        return _rotate(o, inverse=True).to(q.dtype)

    def _coded(self, codes: torch.Tensor, scales: torch.Tensor, first: int, n: int, dtype: torch.dtype,
               chunk: tuple[torch.Tensor, torch.Tensor] | None = None,
               table: torch.Tensor | None = None) -> torch.Tensor:
        """The coded keys (or values) of positions first .. first + n - 1, stored (keys, or values interleaved),
        then those of `chunk` (its codes and scales, not stored yet), as vectors [B, Hkv, n + chunk's, D] in the
        rotated domain. Paged: codes and scales are the blocks, `table` the B rows' table rows (device). On CUDA
        the stored ones come from one Triton launch reading the slots in place, into a buffer of whole 4,096s of
        positions: the allocator reuses it as a long prompt's chunks see more keys (a new size each chunk made it
        allocate)."""
        c = self.cache
        B = codes.shape[0] if table is None else table.shape[0]
        Hkv = codes.shape[1]
        D = 2 * codes.shape[3]
        new = 0 if chunk is None else chunk[0].shape[2]
        if codes.is_cuda:
            from sluice.kernels.turboquant.triton import dequantize

            size = -(-(n + new) // 4096) * 4096
            out = torch.empty((B, Hkv, size, D), dtype=dtype, device=codes.device)[:, :, :n + new]
            dequantize(codes, scales, first, n, dtype, out=out[:, :, :n], table=table)
        else:
            slots = c.slots(first, first + n)
            if table is not None:  # the blocks holding them, gathered as rows from the first one's start
                lo, page = first // c.table.page, c.table.page
                hi = c.table.blocks_for(first + n) if n else lo
                codes, scales = _gather_blocks(codes, table, lo, hi), _gather_blocks(scales, table, lo, hi)
                slots = slots - lo * page
            picked = codes.index_select(2, slots) if codes.dim() == 4 else _value_codes(codes, slots)
            out = torch.empty((B, Hkv, n + new, D), dtype=dtype, device=codes.device)
            out[:, :, :n] = tq.dequantize_rotated(picked, scales.index_select(2, slots))
        if new:
            out[:, :, n:] = tq.dequantize_rotated(*chunk)
        return out

    def decode(self, layer, q, k, v, meta, scale, gate=None):
        """One query per sequence: quantize-on-append, then the split-K kernel on the codes and the ring, the rows
        read in place."""
        from sluice.kernels.attention.triton import decode_attention
        from sluice.kernels.turboquant.triton import decode_step_prep

        c = self.cache
        pos, rows = meta.last_positions, meta.rows
        caches = (c.k_codes[layer], c.v_codes[layer], c.k_scale[layer], c.v_scale[layer],
                  c.k_recent[layer], c.v_recent[layer])
        table = None if c.table is None else c.table.device
        qr = decode_step_prep(q[:, :, 0], k[:, :, 0], v[:, :, 0], *caches, pos, rows=rows, table=table)
        o = decode_attention(qr, caches[0], caches[1], pos, scale, min(meta.visible, c.capacity), c.window,
                             k_scale=caches[2], v_scale=caches[3], k_recent=caches[4], v_recent=caches[5],
                             unrotate=True, rows=rows, out_dtype=q.dtype,  # (qr is fp32)
                             gate=None if gate is None else gate[:, :, 0], table=table)
        return o[:, :, None]

    def _decode_cpu(self, layer, row0, q, k, v, start, scale):
        """One C call for one position of the sequences in rows row0..: append the new K and V, attend, rotations
        included."""
        from sluice.kernels.attention.cpu import turboquant_decode_step

        c = self.cache
        c.slots(start, start + 1)  # the capacity check
        rows = slice(row0, row0 + q.shape[0])
        o = turboquant_decode_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], c.k_codes[layer][rows],
                                   c.k_scale[layer][rows], c.v_codes[layer][rows], c.v_scale[layer][rows],
                                   c.k_recent[layer][rows], c.v_recent[layer][rows], c.first_visible(start),
                                   start, c.window is not None, scale)
        return o[:, :, None].to(q.dtype)


def _rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x rotated (or rotated back) over its last dim, fp32: on CUDA the Triton Walsh-Hadamard kernel (an fp32 matmul
    by R runs on CUDA cores there), else the reference."""
    if x.is_cuda and 16 <= x.shape[-1] <= 256:
        from sluice.kernels.turboquant.triton import rotate

        return rotate(x, inverse)
    return tq.unrotate(x) if inverse else tq.rotate(x)


def _gather_blocks(x: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Blocks x [N, Hkv, page, ...] (or the values' [N, Hkv, page/4, ...]) of table columns lo .. hi - 1 of the B
    rows of `table` (device), laid out as rows: [B, Hkv, (hi - lo) page, ...], position lo * page first."""
    idx = table[:, lo:hi].long()
    picked = x.index_select(0, idx.flatten()).unflatten(0, tuple(idx.shape))  # [B, hi - lo, Hkv, page, ...]
    return picked.transpose(1, 2).flatten(2, 3)


def _value_codes(v_codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The value codes [B, Hkv, cap/4, D/2, 4] of `slots` as [B, Hkv, n, D/2] (out of their interleaved layout)."""
    return v_codes[:, :, slots // 4, :, slots % 4].permute(1, 2, 0, 3)


def _recent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q0: int, k0: int,
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Banded attention, fp32: q [B, Hq, T, D] at positions q0.., k, v [B, Hkv, S, D] at positions k0 .. q0 + T - 1;
    query p sees key j when p - width < j <= p (itself always). Returns the output [B, Hq, T, D] and the log-sum-exp
    of the scaled scores [B, Hq, T].

    Queries go in blocks of `width`, each against the 2 * width keys that end with it: a few masked scores per query
    whatever the chunk's length. The G query heads of a KV head ride along as rows of one block."""
    B, Hq, T, D = q.shape
    Hkv, G, w = k.shape[1], Hq // k.shape[1], width
    n = -(-T // w)  # blocks
    lo = q0 - w  # the position of the first key of block 0's window
    drop = max(0, lo - k0)  # keys no query here can see
    pad = (k0 + drop - lo, n * w - T)  # keys before the first / after the last position, zeros (masked or unused)
    win = lambda x: F.pad(x[:, :, drop:].float(), (0, 0) + pad).unfold(2, 2 * w, w)  # noqa: E731 [B, Hkv, n, D, 2w]
    qb = F.pad(q.float(), (0, 0, 0, n * w - T)).reshape(B, Hkv, G, n, w, D).transpose(2, 3).reshape(B, Hkv, n,
                                                                                                      G * w, D)
    s = (qb @ win(k)) * scale  # [B, Hkv, n, G * w, 2w]
    t = torch.arange(w, device=q.device).repeat(G)[:, None]  # a row's query: position lo + w * (block + 1) + t
    c = torch.arange(2 * w, device=q.device)[None, :]  # a column's key: position lo + w * block + c
    seen = (c <= t + w) & (c > t)
    kpos = lo + w * torch.arange(n, device=q.device)[:, None, None] + c
    s = s.masked_fill(~(seen & (kpos >= k0 + drop)), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]) @ win(v).transpose(-1, -2)  # [B, Hkv, n, G * w, D]
    back = lambda x: x.reshape(B, Hkv, n, G, w, -1).transpose(2, 3).reshape(B, Hq, n * w, -1)[:, :, :T]  # noqa: E731
    return back(o), back(lse[..., None])[..., 0]


def _lagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q0: int, k0: int, lag: int,
                      window: int | None, score_elements: int, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D] at positions q0.., k, v [B, Hkv, S, D] at positions k0 .. q0 + T - 1 - lag; query p sees key j
    when j <= p - lag (and j > p - window). Returns the output [B, Hq, T, D] fp32 and the log-sum-exp of the scaled
    scores [B, Hq, T] (-inf, output 0, for a query that sees none).

    The queries from the first that sees a key on are causal to the keys' bottom right: with `fused` (a GPU, half
    precision, no window) one flash attention, which gives its log-sum-exp; else explicit scores in blocks of
    queries under score_elements."""
    B, Hq, T, D = q.shape
    S, G = k.shape[2], Hq // k.shape[1]
    r0 = max(0, k0 + lag - q0)  # queries before r0 see no key
    o = q.new_zeros(B, Hq, T, D, dtype=torch.float32)
    lse = q.new_full((B, Hq, T), float("-inf"), dtype=torch.float32)
    if fused and window is None:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q[:, :, r0:], k, v, 0.0, True, False, scale=scale)
        o[:, :, r0:], lse[:, :, r0:] = out[0].float(), out[1][..., :T - r0]
        return o, lse
    kpos = torch.arange(k0, k0 + S, device=q.device)[None, :]
    step = max(1, score_elements // (B * Hq * S))
    for t0 in range(r0, T, step):
        t1 = min(T, t0 + step)
        qpos = torch.arange(q0 + t0, q0 + t1, device=q.device).repeat(G)[:, None]
        seen = kpos <= qpos - lag
        if window is not None:
            seen &= kpos > qpos - window
        qb = q[:, :, t0:t1].float().reshape(B, -1, G * (t1 - t0), D)
        s = (qb @ k.float().transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
        piece = torch.logsumexp(s, dim=-1)
        ob = torch.exp(s - piece[..., None]) @ v.float()
        o[:, :, t0:t1] = ob.reshape(B, Hq, t1 - t0, D)
        lse[:, :, t0:t1] = piece.reshape(B, Hq, t1 - t0)
    return o, lse
