"""TurboQuant 4-bit KV cache: each K and V vector stored as 4-bit Lloyd-Max codes of its randomised-Hadamard
rotation plus one fp32 scale (`kernels/turboquant/reference.py`): D/2 + 4 bytes instead of 2 D in bf16 (3.76x
fewer at D = 128). Attention runs in the rotated domain: q is rotated once, the output rotated back once.

The most recent RECENT positions are also kept exact (rotated, in the model's dtype, a ring of RECENT slots): a
query at position p reads key/value j exactly when p - j < RECENT, from the codes otherwise. This is KIVI's
"residual window": measured on the demo model (SmolLM2-135M, 3 KV heads of 64), 4-bit K and V cost +7.2%
perplexity and 88% top-1 agreement; with the 16 / 32 / 64 / 128 most recent positions exact, +1.3 / +1.0 / +0.5 /
+0.3% and 94 / 96 / 97 / 97% (docs/ACCURACY.md). The rule depends on the query's position only, so prefill in
chunks and token-by-token decode give the same result. The fixed cost: 64 positions in the model's dtype.

Paged (`page`, `blocks`; `cache/blocks.py`): the codes and scales live in blocks of `page` positions, [layers,
blocks + 1, Hkv, page, ...] (the last block scratch), a row's position p in block table[row, p // page] at slot
p % page; the exact ring stays one per row. Kernels read and write the blocks in place through the device table; the
torch paths gather a row's blocks through it (no host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.cache.blocks import BlockTable
from sluice.cache.kv import KVCache
from sluice.kernels.turboquant import reference as tq

RECENT = 64
SCORE_ELEMENTS = 1 << 26  # prefill attention off the flash kernel: fp32 scores held at once (256 MB)


class TurboQuantKVCache(KVCache):
    PAGEABLE = True

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", window: int | None = None,
                 page: int | None = None, blocks: int | None = None, recent: int = RECENT,
                 score_elements: int = SCORE_ELEMENTS):
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"the TurboQuant KV cache needs a power-of-two head dim, this model has {head_dim}")
        super().__init__(num_layers, rows, num_kv_heads, head_dim, capacity, window)
        self.capacity = -(-self.capacity // 32) * 32  # slots in 32s: the values interleave four positions, the CUDA
        # decode kernel (kernels/attention/cuda.py) reads blocks of 32
        self.recent = recent
        self.score_elements = score_elements  # prefill off the flash kernel: fp32 scores held at once
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

    def use_decode_kernel(self, x: torch.Tensor) -> bool:
        """The kernel needs at least 16 bytes of codes per vector (head dim >= 32); smaller heads use the torch path."""
        return super().use_decode_kernel(x) and self.head_dim >= 32

    def prefill(self, layer: int, row0: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                scale: float) -> torch.Tensor:
        if q.shape[2] == 1 and self._use_cpu_kernel(q):
            return self._decode_cpu(layer, row0, q, k, v, start, scale)
        B = q.shape[0]
        rows = slice(row0, row0 + B)
        layers = [t[layer] for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.k_recent,
                                     self.v_recent)]
        # the rows' codes and scales (paged: all the blocks, and the rows' table rows), their rings
        table = None if self.table is None else self.table.device
        k_codes, v_codes, k_scale, v_scale = (t[rows] if table is None else t for t in layers[:4])
        k_recent, v_recent = (t[rows] for t in layers[4:])
        T = q.shape[2]
        end = start + T
        first = self.first_visible(start)
        # on a GPU the attention reads bf16/fp16 keys on SDPA's flash kernel; in fp32 SDPA has no fused kernel for
        # head dim 256
        fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
        dt = q.dtype if fused else torch.float32
        # query p reads key j exactly when p - j < recent (the ring's positions before the chunk, then the chunk's
        # own), from the codes when p - j >= recent: two attentions, merged by their log-sum-exps
        e0 = max(first, start - self.recent + 1)
        ring = torch.arange(e0, start, device=q.device) % self.recent
        ke, ve = k_recent.index_select(2, ring).float(), v_recent.index_select(2, ring).float()  # before any store
        last = end - self.recent  # coded keys: positions first .. last - 1, the ones the chunk's last query reads
        coded = last > first and (self.window is None or self.window > self.recent)
        # on CUDA without a window the chunk is stored first, in one launch (`append_chunk`: codes, scales, ring,
        # q rotated), and every coded key read back from the slots; a window's ring may still hold, in the slots
        # the chunk takes, keys its first queries see: there (and off CUDA) the store comes last
        stored_first = q.is_cuda and self.window is None and 16 <= self.head_dim <= 256
        yk, yv = _rotate(k), _rotate(v)  # the chunk rotated once: its exact copies (and below, its codes)
        if stored_first:
            from sluice.kernels.turboquant.triton import append_chunk

            self.slots(start, end)  # the capacity check
            qr = append_chunk(q, k, v, *layers, row0, start, table=table)
        else:
            (kc, ks), (vc, vs) = tq.quantize_rotated(yk), tq.quantize_rotated(yv)
            qr = _rotate(q)
        ke, ve = torch.cat([ke, yk], dim=2), torch.cat([ve, yv], dim=2)
        o, lse = _recent_attention(qr, ke, ve, scale, start, e0, min(self.recent, self.window or self.recent))
        if coded:
            tab = None if table is None else table[rows]
            if stored_first:
                kq = self._coded(k_codes, k_scale, first, last - first, dt, table=tab)
                vq = self._coded(v_codes, v_scale, first, last - first, dt, table=tab)
            else:  # stored before the chunk, then the chunk's own
                old, new = min(start, last) - first, max(0, last - start)
                kq = self._coded(k_codes, k_scale, first, old, dt, (kc[:, :, :new], ks[:, :, :new]), tab)
                vq = self._coded(v_codes, v_scale, first, old, dt, (vc[:, :, :new], vs[:, :, :new]), tab)
            oc, lc = _lagged_attention(qr.to(dt), kq, vq, scale, start, first, self.recent, self.window,
                                       self.score_elements, fused)
            total = torch.logaddexp(lse, lc)
            o = o * (lse - total).exp()[..., None] + oc * (lc - total).exp()[..., None]
        if not stored_first:  # codes of the chunk (its last `capacity` positions), exact copies of its last `recent`
            if table is not None:  # at their (block, slot), from the device table
                p = self.slots(start, end, q.device)
                blk, slot = table[rows, p // self.table.page].long(), p % self.table.page  # [B, T], [T]
                k_codes[blk, :, slot] = kc.transpose(1, 2)
                v_codes[blk, :, slot // 4, :, slot % 4] = vc.transpose(1, 2)
                k_scale[blk, :, slot] = ks.transpose(1, 2)
                v_scale[blk, :, slot] = vs.transpose(1, 2)
            else:
                slots = self.slots(end - min(T, self.capacity), end, q.device)
                keep = len(slots)
                k_codes.index_copy_(2, slots, kc[:, :, T - keep:])
                v_codes[:, :, slots // 4, :, slots % 4] = vc[:, :, T - keep:].permute(2, 0, 1, 3)
                k_scale.index_copy_(2, slots, ks[:, :, T - keep:])
                v_scale.index_copy_(2, slots, vs[:, :, T - keep:])
            r = min(T, self.recent)
            ring = torch.arange(end - r, end, device=q.device) % self.recent
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
            slots = self.slots(first, first + n)
            if table is not None:  # the blocks holding them, gathered as rows from the first one's start
                lo, page = first // self.table.page, self.table.page
                hi = self.table.blocks_for(first + n) if n else lo
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

        pos, rows = meta.last_positions, meta.rows
        caches = (self.k_codes[layer], self.v_codes[layer], self.k_scale[layer], self.v_scale[layer],
                  self.k_recent[layer], self.v_recent[layer])
        table = None if self.table is None else self.table.device
        qr = decode_step_prep(q[:, :, 0], k[:, :, 0], v[:, :, 0], *caches, pos, rows=rows, table=table)
        o = decode_attention(qr, caches[0], caches[1], pos, scale, min(meta.visible, self.capacity), self.window,
                             k_scale=caches[2], v_scale=caches[3], k_recent=caches[4], v_recent=caches[5],
                             unrotate=True, rows=rows, out_dtype=q.dtype,  # (qr is fp32)
                             gate=None if gate is None else gate[:, :, 0], table=table)
        return o[:, :, None]

    def _use_cpu_kernel(self, q: torch.Tensor) -> bool:
        """One query per sequence on the CPU with an fp32 ring and the native kernels built: the C kernel reads
        the codes in place (the torch path dequantizes the whole history at every step). It reads rows: a paged
        cache takes the torch path."""
        from sluice.kernels.cpu import available

        return (self.table is None and q.device.type == "cpu" and q.shape[2] == 1
                and self.k_recent[0].dtype == torch.float32 and self.head_dim <= 512 and available())

    def _decode_cpu(self, layer, row0, q, k, v, start, scale):
        """One C call for one position of the sequences in rows row0..: append the new K and V, attend, rotations
        included."""
        from sluice.kernels.attention.cpu import turboquant_decode_step

        self.slots(start, start + 1)  # the capacity check
        rows = slice(row0, row0 + q.shape[0])
        o = turboquant_decode_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], self.k_codes[layer][rows],
                                   self.k_scale[layer][rows], self.v_codes[layer][rows], self.v_scale[layer][rows],
                                   self.k_recent[layer][rows], self.v_recent[layer][rows], self.first_visible(start),
                                   start, self.window is not None, scale)
        return o[:, :, None].to(q.dtype)

    def bytes_per_token(self) -> int:
        """Bytes per position of one sequence across layers (the `recent` exact positions are `fixed_bytes`)."""
        return 2 * self.num_layers * self.num_kv_heads * tq.bytes_per_vector(self.head_dim)

    def fixed_bytes(self) -> int:
        r = self.k_recent[0, 0]
        return 2 * self.num_layers * r.numel() * r.element_size()


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
