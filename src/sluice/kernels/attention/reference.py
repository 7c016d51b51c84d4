"""Causal GQA attention of new queries against a cache (PyTorch SDPA; FlashAttention backend on GPU)."""

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] are the last T positions of the S cached positions in k, v [B, Hkv, S, D].

    Query t (absolute position S - T + t) sees keys 0 .. S - T + t. Hq must be a multiple of Hkv; query head h
    reads kv head h // (Hq / Hkv). A later chunk (T < S) is causal aligned to the bottom right, which on a GPU the
    flash backend runs as it is (`causal_lower_right`): a materialized mask would take cuDNN's backend on an H100,
    which builds a new plan on the host, a slow step, for every new key count (docs/perf-log.md, prefill). In half
    precision the flash kernel is called directly where q, k and v share a head dim (not MLA's decompressed K/V,
    whose backend imports `torch.nn.attention.bias` when it is made). On the CPU the mask is materialized:
    `torch.nn.attention.bias` imports torch._dynamo, seconds the first time (a chat's second turn resuming from the
    prefix cache waited for it).
    """
    T, S = q.shape[2], k.shape[2]
    if _flash(q, v):
        # every chunk on the flash kernel, causal to the bottom right as it is (T == S: plain causal; T == 1: every
        # key): for a later chunk what `causal_lower_right` runs without importing `torch.nn.attention.bias`, which
        # pulls in torch._dynamo (4.6 s: the first serving step that resumed a prompt from the prefix cache waited
        # for it); for a first chunk no SDPA dispatch, which may take cuDNN's backend (a plan built on the host for
        # every new length: a lead for the first wave's slow steps, docs/perf-log.md)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    if T == 1:
        mask, causal = None, False
    elif T == S:
        mask, causal = None, True
    elif not q.is_cuda:
        mask, causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T), False
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(T, S), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _flash(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the flash kernel takes these heads as they are: half precision on an Ampere or newer GPU, q, k and v
    of one head dim, a multiple of 8 up to 256 (SDPA pads other dims before calling it; this does not)."""
    from sluice.kernels.launch import capability

    D = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D == v.shape[-1] <= 256 and D % 8 == 0
            and capability(q.device.index or 0) >= (8, 0))
