"""Attention decode step through the native CPU kernels: RoPE, cache write and GQA attention in one call
(replaces ~20 small torch ops per layer per token)."""

import torch

from sluice.kernels.cpu import check_buffer, lib


def decode_step(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """qkv [Hq + 2 Hkv, D] fp32 contiguous (one token); cos, sin [rot]; k_cache, v_cache [Hkv, cap, D] fp32
    contiguous. Writes rope(k), v at `pos` and returns the attention output [Hq * D]."""
    Hkv, cap, D = k_cache.shape
    Hq = qkv.shape[0] - 2 * Hkv
    rot = cos.shape[-1]
    if (D > 512 or Hkv <= 0 or Hq <= 0 or Hq % Hkv or not 0 <= pos < cap or qkv.shape[-1] != D or rot > D or rot % 2
            or tuple(v_cache.shape) != (Hkv, cap, D)):
        raise ValueError(f"attn decode: unsupported shape (Hq={Hq}, Hkv={Hkv}, D={D}, rot={rot}, pos={pos}, "
                         f"cap={cap})")
    for name, t, n in (("qkv", qkv, (Hq + 2 * Hkv) * D), ("cos", cos, rot), ("sin", sin, rot),
                       ("k_cache", k_cache, Hkv * cap * D), ("v_cache", v_cache, Hkv * cap * D)):
        check_buffer(name, t, torch.float32, n)
    out = torch.empty(Hq * D, dtype=torch.float32)
    lib().attn_decode(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      Hq, Hkv, D, cos.shape[-1], cap, pos, scale, out.data_ptr())
    return out


def turboquant_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_codes: torch.Tensor,
                           k_scale: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, k_ring: torch.Tensor,
                           v_ring: torch.Tensor, first: int, pos: int, ring: bool, scale: float) -> torch.Tensor:
    """A TurboQuant decode step of B sequences in one call (`cache/turboquant.py`, codec in
    `kernels/turboquant/reference.py`): quantize the new k, v [B, Hkv, D] into their slot (pos, or pos % cap when
    `ring`) and the exact ring [B, Hkv, R, D] (slot pos % R), then attend q [B, Hq, D] over positions first..pos
    from the key codes [B, Hkv, cap, D/2], value codes [B, Hkv, cap/4, D/2, 4] (`reference.interleave`) and scales
    [B, Hkv, cap] (the R newest exact). Rotations by a fast Walsh-Hadamard transform. fp32 / uint8 caches,
    contiguous, written in place; returns [B, Hq, D] fp32."""
    B, Hq, D = q.shape
    Hkv, cap = k_codes.shape[1], k_codes.shape[2]
    R = k_ring.shape[2]
    caches = (k_codes, k_scale, v_codes, v_scale, k_ring, v_ring)
    if (D > 512 or D < 2 or D & (D - 1) or Hkv <= 0 or Hq % Hkv or cap <= 0 or cap % 4 or R <= 0
            or tuple(k_codes.shape) != (B, Hkv, cap, D // 2) or tuple(v_codes.shape) != (B, Hkv, cap // 4, D // 2, 4)
            or tuple(k.shape) != (B, Hkv, D) or tuple(v.shape) != (B, Hkv, D)
            or not 0 <= first <= pos or (not ring and pos >= cap)):
        raise ValueError(f"TurboQuant CPU decode: unsupported shapes (Hq={Hq}, Hkv={Hkv}, D={D}, cap={cap}, "
                         f"first={first}, pos={pos}) or cache layout")
    for name, t, dtype, n in (("k_codes", k_codes, torch.uint8, B * Hkv * cap * D // 2),
                              ("k_scale", k_scale, torch.float32, B * Hkv * cap),
                              ("v_codes", v_codes, torch.uint8, B * Hkv * cap * D // 2),
                              ("v_scale", v_scale, torch.float32, B * Hkv * cap),
                              ("k_ring", k_ring, torch.float32, B * Hkv * R * D),
                              ("v_ring", v_ring, torch.float32, B * Hkv * R * D)):
        check_buffer(name, t, dtype, n)
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    lib().tq_decode_steps(q.data_ptr(), k.data_ptr(), v.data_ptr(), *(t.data_ptr() for t in _tq_tables(D)),
                          *(t.data_ptr() for t in caches), B, Hq, Hkv, D, cap, k_ring.shape[2], first, pos, int(ring),
                          scale, out.data_ptr())
    return out


_TQ_TABLES: dict = {}


def _tq_tables(D: int):
    """(signs [D], levels [16], boundaries [15]) fp32 contiguous, made once per head dim."""
    if D not in _TQ_TABLES:
        from sluice.kernels.turboquant import reference as tq

        _TQ_TABLES[D] = tuple(t.float().contiguous() for t in (tq.signs(D), tq.codebook(), tq.boundaries()))
    return _TQ_TABLES[D]
