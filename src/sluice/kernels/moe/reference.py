"""Torch reference of the sparse MoE block: the oracle for the GPU kernels. Plain fp32 math, one expert at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.quant.affine import QuantizedTensor


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]): softmax in fp32, top-k, and
    optionally the top-k weights renormalised to sum to 1."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _expert(w, e: int) -> torch.Tensor:
    """Expert e of stacked weights [E, N, K] (dense or QuantizedTensor), dequantized to fp32 [N, K]."""
    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(w.weight[e], w.scales[e], w.biases[e], w.bits, w.group_size).dequantize(torch.float32)
    return w[e].float()


def moe_reference(x: torch.Tensor, router_logits: torch.Tensor, gate_up, down, top_k: int, norm_topk_prob: bool,
                  shared_out: torch.Tensor | None = None, shared_gate_logit: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """out [T, H] fp32 = sum over each token's top-k experts of weight * down(silu(gate) * up), plus
    sigmoid(shared_gate_logit) * shared_out when given. gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
    weights, ids = route(router_logits, top_k, norm_topk_prob)
    x = x.float()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = (x[tok] @ _expert(gate_up, e).T).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ _expert(down, e).T
        out.index_add_(0, tok, y * weights[tok, slot, None])
    if shared_out is not None:
        out += torch.sigmoid(shared_gate_logit.float().reshape(-1, 1)) * shared_out.float()
    return out
