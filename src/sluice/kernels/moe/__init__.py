"""Sparse MoE block (softmax top-k router, stacked SwiGLU experts, weighted sum, gated shared expert).

`reference.py` is the torch oracle; `triton.py` holds the GPU kernels for stacked MLX-affine quantized experts.
"""

from __future__ import annotations

from sluice.quant.affine import QuantizedTensor


def triton_for(gate_up, down, top_k: int):
    """The Triton MoE kernels module when it runs these stacked experts (quantized, bits 2/4/8, on a CUDA device)
    with this top-k, else None (no Triton, dense or unsupported weights: the caller keeps its reference path)."""
    if not (isinstance(gate_up, QuantizedTensor) and gate_up.weight.is_cuda):
        return None
    try:
        from sluice.kernels.moe import triton as moe_triton
    except ImportError:
        return None
    return moe_triton if moe_triton.supports(gate_up, down, top_k) else None
