"""Causal GQA attention of new queries against a cache (PyTorch SDPA; FlashAttention backend on GPU)."""

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] are the last T positions of the S cached positions in k, v [B, Hkv, S, D].

    Query t (absolute position S - T + t) sees keys 0 .. S - T + t. Hq must be a multiple of Hkv; query head h
    reads kv head h // (Hq / Hkv). A later chunk (T < S) is causal aligned to the bottom right, which the flash
    backend runs as it is: a materialized mask would take cuDNN's backend on an H100, which builds a new plan
    on the host, a slow step, for every new key count (docs/perf-log.md, prefill).
    """
    T, S = q.shape[2], k.shape[2]
    if T == 1:
        mask, causal = None, False
    elif T == S:
        mask, causal = None, True
    else:  # (imported here: torch.nn.attention.bias imports torch._dynamo, seconds at every start)
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(T, S), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
