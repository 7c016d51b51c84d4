"""Sparse MoE block of Qwen3-Next / Qwen3.5: softmax top-k router, SwiGLU experts, sigmoid-gated shared expert.

This is the reference path (a loop over the experts that were hit); the GPU kernels replace it (issue #4).
Expert weights are stacked: gate_up [E, 2I, H] (gate rows first), down [E, H, I]; dense or QuantizedTensor.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sluice.kernels.qmatmul import qmatmul
from sluice.layers.linear import Linear
from sluice.quant.affine import QuantizedTensor


def _expert_matmul(x: torch.Tensor, w, e: int) -> torch.Tensor:
    if isinstance(w, QuantizedTensor):
        return qmatmul(x, QuantizedTensor(w.weight[e], w.scales[e], w.biases[e], w.bits, w.group_size))
    return F.linear(x, w[e].to(x.dtype))


class SwiGLU(nn.Module):
    def __init__(self, gate_up: nn.Module, down: Linear, intermediate: int):
        super().__init__()
        self.gate_up, self.down, self.intermediate = gate_up, down, intermediate

    def forward(self, x):
        g, u = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(g) * u)


class SparseMoE(nn.Module):
    def __init__(self, router: Linear, gate_up, down, top_k: int, norm_topk_prob: bool,
                 shared: SwiGLU | None, shared_gate: Linear | None):
        super().__init__()
        self.router, self.shared, self.shared_gate = router, shared, shared_gate
        self.gate_up, self.down = gate_up, down  # stacked experts (tensor or QuantizedTensor)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.num_experts = (gate_up.weight if isinstance(gate_up, QuantizedTensor) else gate_up).shape[0]

    def _apply(self, fn, recurse=True):  # move the stacked expert weights with the module
        super()._apply(fn, recurse)

        def move(w):
            if isinstance(w, QuantizedTensor):
                return QuantizedTensor(fn(w.weight), fn(w.scales), fn(w.biases), w.bits, w.group_size)
            return fn(w)

        self.gate_up, self.down = move(self.gate_up), move(self.down)
        return self

    def dequantize_(self, dtype: torch.dtype) -> None:
        self.gate_up, self.down = (w.dequantize(dtype) if isinstance(w, QuantizedTensor) else w
                                   for w in (self.gate_up, self.down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x2).float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(x2)
        for e in top_i.unique().tolist():
            tok, slot = (top_i == e).nonzero(as_tuple=True)
            xe = x2[tok]
            g, u = _expert_matmul(xe, self.gate_up, e).chunk(2, dim=-1)
            h = _expert_matmul(F.silu(g) * u, self.down, e)
            out.index_add_(0, tok, (h * top_w[tok, slot, None]).to(x2.dtype))
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x2)) * self.shared(x2)
        return out.view(shape)
