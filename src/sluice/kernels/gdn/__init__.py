"""Gated delta rule (Gated DeltaNet): `reference.py` holds the torch oracles (recurrent and chunked), `triton.py`
the GPU kernels (fused recurrent decode, chunk-parallel prefill)."""

from __future__ import annotations

import torch


def triton_for(x: torch.Tensor, head_dims: tuple[int, int]):
    """The Triton kernels module when it runs this layer (x on a CUDA device, head dims supported), else None."""
    if not x.is_cuda:
        return None
    try:
        from sluice.kernels.gdn import triton as gdn_triton
    except ImportError:
        return None
    return gdn_triton if max(head_dims) <= gdn_triton.MAX_HEAD_DIM else None
