"""Linear and Embedding layers over dense or MLX-affine quantized weights.

Quantized weights stay packed in memory; `kernels.qmatmul` picks the implementation for the device.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sluice.kernels.norm.reference import rms_norm
from sluice.kernels import cpu as native
from sluice.kernels.norm import cpu as norm_cpu
from sluice.kernels.qmatmul import dequantize_rows, prepare, qmatmul
from sluice.quant.affine import QuantizedTensor


class _WeightHolder(nn.Module):
    """Holds a weight [N, K] either dense (`weight`) or quantized (`qweight`, `scales`, `biases`)."""

    def __init__(self, weight: torch.Tensor | QuantizedTensor):
        super().__init__()
        if isinstance(weight, QuantizedTensor):
            if weight.weight.dim() != 2:
                raise ValueError("a quantized Linear/Embedding weight must be 2-D")
            self.register_buffer("qweight", weight.weight.contiguous())
            self.register_buffer("scales", weight.scales.contiguous())
            self.register_buffer("biases", weight.biases.contiguous())
            self.bits, self.group_size = weight.bits, weight.group_size
            self.weight = None
        else:
            self.register_buffer("weight", weight.contiguous())
            self.qweight = self.scales = self.biases = None

    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    @property
    def qt(self) -> QuantizedTensor:
        # Built once per device/dtype move: the decode loop calls this ~100 times per token.
        qt = self.__dict__.get("_qt")
        if qt is None or qt.weight is not self.qweight:
            qt = self.__dict__["_qt"] = QuantizedTensor(self.qweight, self.scales, self.biases, self.bits,
                                                        self.group_size)
            self.__dict__["_prepared"] = prepare(qt)
        return qt

    def dequantize_(self, dtype: torch.dtype) -> None:
        """Hold the weight dense from now on (trades memory for dense-matmul speed where that wins)."""
        if self.quantized:
            dense = self.qt.dequantize(dtype)
            self.qweight = self.scales = self.biases = None
            self.__dict__.pop("_qt", None)
            self.__dict__.pop("weight", None)  # the plain `None` placeholder of a quantized holder
            self.register_buffer("weight", dense)

    @property
    def out_features(self) -> int:
        return (self.qweight if self.quantized else self.weight).shape[0]

    @property
    def in_features(self) -> int:
        return self.qt.in_features if self.quantized else self.weight.shape[1]


class Linear(_WeightHolder):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            qt = self.qt
            return qmatmul(x, qt, self.__dict__["_prepared"])
        return F.linear(x, self.weight.to(x.dtype))

    @staticmethod
    def concat(parts: list[Linear]) -> Linear | None:
        """One Linear whose output is the concatenation of `parts`' outputs (same input), or None when the
        parts are stored differently. Fewer, larger matmuls: one launch/call instead of several."""
        first = parts[0]
        if first.quantized:
            same = all(p.quantized and p.bits == first.bits and p.group_size == first.group_size
                       and p.scales.dtype == first.scales.dtype for p in parts)
            if not same:
                return None
            return Linear(QuantizedTensor(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                                          torch.cat([p.biases for p in parts]), first.bits, first.group_size))
        if any(p.quantized or p.weight.dtype != first.weight.dtype for p in parts):
            return None
        return Linear(torch.cat([p.weight for p in parts]))


class Concat(nn.Module):
    """Several Linears on the same input, outputs concatenated (when their storage differs and cannot fuse)."""

    def __init__(self, parts: list[Linear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def fuse_linears(parts: list[Linear]) -> nn.Module:
    """One module computing cat([p(x) for p in parts], -1): a single fused Linear when the weights are stored
    alike (one matmul instead of several), else a Concat."""
    return Linear.concat(parts) or Concat(parts)


class Embedding(_WeightHolder):
    """Token embedding; `as_linear()` shares the same storage for a tied output head."""

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.quantized:
            return dequantize_rows(self.qt, ids, dtype)
        return self.weight[ids].to(dtype)

    def as_linear(self) -> Linear:
        lin = Linear.__new__(Linear)
        nn.Module.__init__(lin)
        for name in ("qweight", "scales", "biases", "weight"):
            t = getattr(self, name)
            if t is None:
                setattr(lin, name, None)
            else:
                lin.register_buffer(name, t)
        if self.quantized:
            lin.bits, lin.group_size = self.bits, self.group_size
        return lin


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not x.is_cuda
                and x.is_contiguous() and native.available()):
            return norm_cpu.rms_norm(x, self.weight, self.eps)  # one call instead of ~6 torch ops
        return rms_norm(x, self.weight, self.eps)
