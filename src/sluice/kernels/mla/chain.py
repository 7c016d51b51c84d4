"""The DeepSeek decode chain's dispatch, without importing Triton: the fused kernels of `fused.py` where they run,
the torch paths (their oracles, what the layers computed before) elsewhere; and the GEMV launches
(`kernels/qmatmul/triton.py`) whose split-K partials the next fused kernel sums.

`applies(t)`: whether the DeepSeek layers take the fused kernels for tensor t: on CUDA (with Triton) unless
SLUICE_DEEPSEEK_KERNELS=0 (`kernels.mla.kernels`) or ENABLED is False (benchmarks: the chain off beside on); with
FORCE (tests, under TRITON_INTERPRET=1) for CPU tensors too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sluice.kernels.moe import ExpertOutputs

FORCE = False  # tests: the fused kernels for CPU tensors too (only under TRITON_INTERPRET=1)
ENABLED = True  # benchmarks: False runs the torch glue between the GEMVs on a GPU too (read when a step runs)


def applies(t: torch.Tensor) -> bool:
    from sluice.kernels.mla import kernels

    if not kernels():
        return False
    if not t.is_cuda:
        return _forced()
    if not ENABLED:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _forced() -> bool:
    return FORCE and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Partials:
    """A GEMV's output as its split-K partials y [S, M, N] (fp32; or [1, M, N] in the output's dtype when K was not
    split), not yet summed: the consumer sums them. `sum()` is what `qgemv` returns: y.sum(0) in `dtype`."""
    y: torch.Tensor
    dtype: torch.dtype

    def sum(self) -> torch.Tensor:
        return (self.y[0] if self.y.shape[0] == 1 else self.y.sum(0)).to(self.dtype)


def add_rms_norm(h: torch.Tensor, delta, norm, out32: bool = False):
    """(s, y, y32) of a residual add and a Llama RMSNorm module `norm` (`layers.linear.RMSNorm`): s = h + delta
    (h when delta is None; delta a tensor, `Partials` or `ExpertOutputs`), y = norm(s), y32 = y in fp32 or None.
    One launch where the fused kernels apply (y32 only there: elsewhere None, the caller casts), else the torch
    path, the same ops as `h + delta` and `norm(s)`."""
    if applies(h):
        from sluice.kernels.mla import fused

        return fused.add_rms_norm(h, delta, norm.weight, norm.eps, out32)
    if isinstance(delta, ExpertOutputs):
        delta = delta.combine().view(h.shape)
    elif isinstance(delta, Partials):
        delta = delta.sum().view(h.shape)
    s = h if delta is None else h + delta
    return s, norm(s), None


def gemv_weight(linear, x2: torch.Tensor):
    """linear's QuantizedTensor where the Triton GEMV runs x2 [M, K] through it (quantized, bits and group size it
    takes, M <= its rows, on CUDA), else None."""
    if not ((x2.is_cuda or _forced()) and getattr(linear, "quantized", False)):
        return None
    try:
        from sluice.kernels.qmatmul import triton as qmm
    except ImportError:
        return None
    qt = linear.qt
    if (qt.bits not in qmm.SUPPORTED_BITS or qt.group_size not in qmm.SUPPORTED_GROUPS
            or x2.shape[0] > qmm.GEMV_MAX_ROWS):
        return None
    return qt


def gemv_partials(linear, x2: torch.Tensor) -> torch.Tensor:
    """[S, M, N]: x2 [M, K] through `linear` as the GEMV's split-K partials where the Triton GEMV runs it (fp32; S =
    1 in x2's dtype when K is not split: `qgemv` without its sum), else [1, M, N] = linear(x2)."""
    qt = gemv_weight(linear, x2)
    if qt is None:
        return linear(x2)[None]
    from sluice.kernels.qmatmul import triton as qmm

    return qmm.qgemv_partials(x2, qt, dtype=x2.dtype)


def swiglu_gemv(mlp, x2: torch.Tensor, split: bool = True) -> torch.Tensor | None:
    """A SwiGLU MLP (`layers.moe.SwiGLU`) of a few rows in two GEMV launches: gate_up's split-K partials, then the
    down GEMV taking silu(gate) * up from them itself (`_gemv_kernel`'s RAW_X + SWIGLU, as the MoE's down does).
    Returns down's partials [S, M, H] (fp32; S = 1 in x2's dtype when not `split`), or None where that does not
    run (the caller then runs `mlp(x2)`): also for gate_up rows in slots (`SwiGLU.slots`), not [gate | up]."""
    from sluice.layers.linear import Linear

    if not isinstance(mlp.gate_up, Linear) or getattr(mlp, "slots", 1) != 1:
        return None
    gu, down = gemv_weight(mlp.gate_up, x2), gemv_weight(mlp.down, x2)
    if gu is None or down is None or down.in_features * 2 != gu.out_features:
        return None
    from sluice.kernels.qmatmul import triton as qmm

    if not qmm.raw_x_supported(down.bits, down.group_size):
        return None
    y = qmm.qgemv_partials(x2, gu)  # fp32 [S, M, 2I]
    M, N, K = x2.shape[0], down.out_features, down.in_features
    block_n, warps, _ = qmm.gemv_plan(N, K, down.bits, down.group_size, M, x2.device)
    split_k = qmm.gemv_split_k(N, K, down.bits, M, block_n, warps, x2.device) if split else 1
    used = qmm.gemv_used_splits(K, down.bits, split_k, warps)[0]
    out = torch.empty((used, M, N), dtype=x2.dtype if used == 1 else torch.float32, device=x2.device)
    qmm.gemv_launch(y, down.weight.view(torch.int32), down.scales, down.biases, out, None, M, N, K, down.bits,
                    down.group_size, split_k, block_n=block_n, num_warps=warps, raw_x=True, swiglu=True)
    return out
