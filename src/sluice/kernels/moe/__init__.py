"""Sparse MoE block (softmax top-k router, stacked SwiGLU experts, weighted sum, gated shared expert).

`reference.py` is the torch oracle; `triton.py` holds the GPU kernels for stacked MLX-affine quantized experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.kernels.launch import INTERPRET
from sluice.quant.affine import QuantizedTensor


def check_device(*tensors) -> None:
    """Every tensor on one device, a CUDA one (or the Triton interpreter): else a clear error before a launch."""
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError("moe: all tensors must be on the same device")
    if not (dev.type == "cuda" or INTERPRET):
        raise ValueError("moe: tensors must be on a CUDA device (or set TRITON_INTERPRET=1)")


def check_shared(T: int, H: int, shared_out: torch.Tensor | None, shared_gate_logit: torch.Tensor | None) -> None:
    """The shared expert's output [T, H] (unit column stride) and gate logit [T] or [T, 1], both or neither."""
    if (shared_out is None) != (shared_gate_logit is None):
        raise ValueError("moe: shared_out and shared_gate_logit come together")
    if shared_out is None:
        return
    if tuple(shared_out.shape) != (T, H) or shared_out.stride(1) != 1 or not shared_out.is_floating_point():
        raise ValueError(f"moe: shared_out must be a float [{T}, {H}] tensor with unit column stride, got "
                         f"{tuple(shared_out.shape)}")
    if tuple(shared_gate_logit.shape) not in ((T,), (T, 1)) or not shared_gate_logit.is_floating_point():
        raise ValueError(f"moe: shared_gate_logit must be a float [{T}] or [{T}, 1] tensor, got "
                         f"{tuple(shared_gate_logit.shape)}")


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

    def __post_init__(self):
        """The layout the kernels that sum it read without bounds checks."""
        w, y = self.weights, self.y
        if w.dim() != 2 or w.dtype != torch.float32 or not w.is_contiguous():
            raise ValueError(f"moe expert outputs: weights must be contiguous fp32 [T, k], got {w.dtype} "
                             f"{tuple(w.shape)}")
        T, k = w.shape
        if y.dim() != 3 or y.shape[1] != T * k or y.stride(2) != 1 or not y.is_floating_point():
            raise ValueError(f"moe expert outputs: y must be float [S, {T * k}, H] with unit column stride, got "
                             f"{y.dtype} {tuple(y.shape)}")
        check_shared(T, y.shape[2], self.shared_out, self.shared_gate_logit)
        if any(t.device != y.device for t in (w, self.shared_out, self.shared_gate_logit) if t is not None):
            raise ValueError("moe expert outputs: all tensors must be on one device")

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

