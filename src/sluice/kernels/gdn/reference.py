"""Gated delta rule (Gated DeltaNet linear attention): the torch oracles, recurrent and chunked.

Shapes (HF / FLA convention): q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; state [B, Hv, K, V].
Value head h reads key head h // (Hv / Hk) (grouped value attention). Per value head and token t:

    S   = S * exp(g_t)                      g_t <= 0: log-space decay
    v'  = beta_t * (v_t - S^T k_t)          delta rule
    S   = S + k_t v'^T
    o_t = S^T (scale * q_t)                 scale = K ** -0.5

Computed in fp32, or fp64 when the inputs are fp64. Outputs are in that compute dtype; the caller casts.
"""

from __future__ import annotations

import torch

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps on the sum, as HF and FLA)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """Heads-first compute-dtype tensors: q, k [B, Hv, T, K] (repeated to the value heads), v [B, Hv, T, V],
    g, beta [B, Hv, T], state [B, Hv, K, V]."""
    B, T, Hk, K = k.shape
    Hv, V = v.shape[-2:]
    if q.shape != k.shape or v.shape[:2] != (B, T) or g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"gated delta rule: inconsistent shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                         f"v{tuple(v.shape)} g{tuple(g.shape)} beta{tuple(beta.shape)}")
    if Hv % Hk:
        raise ValueError(f"gated delta rule: {Hv} value heads is not a multiple of {Hk} key heads")
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dt).transpose(1, 2) for x in (q, k, v, g, beta))
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (K ** -0.5 if scale is None else scale)
    if initial_state is None:
        state = torch.zeros(B, Hv, K, V, dtype=dt, device=v.device)
    else:
        if initial_state.shape != (B, Hv, K, V):
            raise ValueError(f"gated delta rule: initial state {tuple(initial_state.shape)}, expected "
                             f"{(B, Hv, K, V)}")
        state = initial_state.to(dt).clone()
    return q, k, v, g, beta, state


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm=False):
    """Token by token. Returns (o [B, T, Hv, V], final state [B, Hv, K, V]); both in the compute dtype."""
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    o = torch.empty_like(v)
    for t in range(v.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        kv_mem = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        o[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    return o.transpose(1, 2), S


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm=False,
                           chunk_size: int = CHUNK):
    """Chunk-parallel form (WY representation), mathematically equal to the recurrent one.

    Within a chunk with inclusive gate cumsum G (reset at each chunk) and entering state S:
        A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)  for i > j, else 0
        T = (I + A)^-1                               (unit lower triangular)
        u = T (beta * V),   w = T (beta * exp(G) * K)
        v_new = u - w S
        o = (q * exp(G)) S + tril_incl((q k^T) * exp(G_i - G_j)) v_new
        S' = exp(G_last) S + (K * exp(G_last - G))^T v_new
    Every exponent is a difference of cumsums that is <= 0 where it is used (never exp(a) * exp(-b)).
    A ragged last chunk is zero-padded: k = v = beta = g = 0 rows change neither outputs nor state.
    """
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    B, H, T, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, H, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)

    G = g.cumsum(-1)  # [B, H, n, C]
    diff = G[..., :, None] - G[..., None, :]  # G_i - G_j
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay_strict = torch.where(strict, diff, float("-inf")).exp()  # masked before exp: no overflow above
    decay_incl = torch.where(incl, diff, float("-inf")).exp()

    A = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay_strict
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * G.exp()[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :V], sol[..., V:]
    qk = (q @ k.transpose(-1, -2)) * decay_incl
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]

    o = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ S
        o[:, :, c] = q_decayed[:, :, c] @ S + qk[:, :, c] @ v_new
        S = G[:, :, c, -1, None, None].exp() * S + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    o = o.reshape(B, H, n * C, V)[:, :, :T]
    return o.transpose(1, 2), S
