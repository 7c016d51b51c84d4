"""Sparse MoE block (softmax top-k router, stacked SwiGLU experts, weighted sum, gated shared expert).

`reference.py` is the torch oracle; `triton.py` holds the GPU kernels for stacked MLX-affine quantized experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.quant.affine import QuantizedTensor


@dataclass
class ExpertOutputs:
    """An MoE block's output before its weighted sum: y [S, T*k, H] (S split-K partials of the expert outputs, slot
    t*k + j token t's j-th expert), weights fp32 [T, k], and the shared expert's output [T, H] and gate logit [T]
    (or None). `combine()` sums it; `norm.triton.add_rms_norm` sums it inside its own launch."""
    y: torch.Tensor
    weights: torch.Tensor
    dtype: torch.dtype
    shared_out: torch.Tensor | None = None
    shared_gate_logit: torch.Tensor | None = None

    def combine(self) -> torch.Tensor:
        from sluice.kernels.moe.triton import combine

        return combine(self.y, self.weights, self.dtype, self.shared_out, self.shared_gate_logit)

    def args(self) -> tuple:
        """(y, weights, shared (or y), gate, S, stride_ys, stride_ym, stride_sh, stride_g, TOP_K, HAS_SHARED): what
        a kernel calling `expert_sum` passes."""
        has_shared = self.shared_out is not None
        shared = self.shared_out if has_shared else self.y
        gate = self.shared_gate_logit.reshape(-1) if has_shared else self.weights
        return (self.y, self.weights, shared, gate, self.y.shape[0], self.y.stride(0), self.y.stride(1),
                shared.stride(0) if has_shared else 0, gate.stride(0), self.weights.shape[1], has_shared)


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

