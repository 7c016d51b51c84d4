"""Sparse MoE block of Qwen3-Next / Qwen3.5: softmax top-k router, SwiGLU experts, sigmoid-gated shared expert.

Expert weights are stacked: gate_up [E, 2I, H] (gate rows first), down [E, H, I]; dense or QuantizedTensor.
On CUDA with quantized experts (bits 2/4/8) the Triton kernels of `kernels.moe` run the block without a host
sync; elsewhere the reference path, a loop over the experts that were hit.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sluice.kernels.moe import ExpertOutputs, triton_for
from sluice.kernels.qmatmul import qmatmul
from sluice.layers.linear import Linear, fuse_linears
from sluice.quant.affine import QuantizedTensor


def _expert_matmul(x: torch.Tensor, w, e: int) -> torch.Tensor:
    if isinstance(w, QuantizedTensor):
        return qmatmul(x, QuantizedTensor(w.weight[e], w.scales[e], w.biases[e], w.bits, w.group_size))
    return F.linear(x, w[e].to(x.dtype))


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x), gate and up fused in `gate_up`: its output [gate | up] (`intermediate` columns
    each), or with `slots` = n > 1 in slot order [g0 | u0 | g1 | u1 | ...] (intermediate / n columns each; h in the
    original column order, so down is unchanged): a shared MLP that the MoE decode GEMVs read as n expert slots
    (`kernels.moe.triton.shared_slots`)."""

    def __init__(self, gate_up: nn.Module, down: Linear, intermediate: int, slots: int = 1):
        super().__init__()
        self.gate_up, self.down, self.intermediate, self.slots = gate_up, down, intermediate, slots

    def forward(self, x):
        if self.slots == 1:
            g, u = self.gate_up(x).split(self.intermediate, dim=-1)
            return self.down(F.silu(g) * u)
        gu = self.gate_up(x).unflatten(-1, (self.slots, 2, self.intermediate // self.slots))
        return self.down((F.silu(gu[..., 0, :]) * gu[..., 1, :]).flatten(-2))


def _row_block(w, a: int, b: int):
    """Rows a..b-1 of a [N, K] weight (dense or quantized)."""
    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(w.weight[a:b], w.scales[a:b], w.biases[a:b], w.bits, w.group_size)
    return w[a:b]


def swiglu(gate, up, down, tp=None, slots: int = 1) -> SwiGLU:
    """A SwiGLU MLP of gate, up [I, H] and down [H, I] weights (dense or quantized); with `tp` (`sluice.parallel`)
    this rank's slice of I: gate and up column-parallel, down row-parallel (its output a partial sum the caller
    sums over the ranks). slots = n > 1 (not with tp; I a multiple of n): gate_up's rows in slot order
    [g0 | u0 | g1 | u1 | ...] (`SwiGLU`), a row permutation of [gate | up] (memory alike; a checkpoint is never
    written from it)."""
    if tp is not None:
        if slots != 1:
            raise ValueError("swiglu: slots are not for a tensor-parallel MLP")
        what = "the MLP's intermediate size"
        gate, up, down = tp.col(gate, what), tp.col(up, what), tp.row(down, what)
    I = gate.shape[0]
    if I % slots:
        raise ValueError(f"swiglu: intermediate size {I} is not a multiple of {slots} slots")
    n = I // slots
    parts = [Linear(_row_block(w, i * n, (i + 1) * n)) for i in range(slots) for w in (gate, up)]
    return SwiGLU(fuse_linears(parts), Linear(down), I, slots)


class SparseMoE(nn.Module):
    def __init__(self, router: Linear, gate_up, down, top_k: int, norm_topk_prob: bool,
                 shared: SwiGLU | None, shared_gate: Linear | None):
        super().__init__()
        self.num_experts = router.out_features  # routed experts (this rank may hold a range of them: `hold`)
        # the router and the shared expert's gate read the same x: one matmul, [E logits | shared gate logit]
        self.gates = router if shared_gate is None else fuse_linears([router, shared_gate])
        self.shared = shared
        self.gate_up, self.down = gate_up, down  # stacked experts (tensor or QuantizedTensor)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.expert_cache = None
        self.held: tuple[int, int] | None = None  # expert parallel: (first, count) of the experts stacked here

    def hold(self, first: int, count: int) -> None:
        """Expert parallel (`sluice.parallel`): the stacked experts are experts first..first+count-1, then one
        expert of zeros (`count`), which every expert routed elsewhere runs as (its output exactly 0: this rank's
        part of the block's sum, the others' summed by the all-reduce after it)."""
        self.held = (first, count)

    @property
    def live(self) -> int | None:
        """The stacked experts a prefill computes: this rank's own under expert parallelism (the zero expert's
        slots output zeros without a tile), else all (None)."""
        return None if self.held is None else self.held[1]

    @property
    def capturable(self) -> bool:
        """Whether a decode step through this block can be captured in a CUDA graph: not the reference path on a
        GPU, whose loop over the hit experts reads them back to the host."""
        w = self.gate_up.weight if isinstance(self.gate_up, QuantizedTensor) else self.gate_up
        return not w.is_cuda or triton_for(self.gate_up, self.down, self.top_k) is not None

    def stream_from(self, cache) -> None:
        """Run the routed experts from an `experts.cache.ExpertCache` (its device slots stand in for the stacked
        experts; every step maps its routed ids to slots first)."""
        self.expert_cache = cache
        self.gate_up, self.down = cache.gate_up, cache.down

    def _experts_for(self, ids: torch.Tensor):
        """(gate_up, down, ids) a step routed to ids runs on: the stacked experts, or the expert cache's; expert
        parallel, ids mapped to this rank's stack (an expert held elsewhere to the zero expert, the shared expert's
        slot ids E + i past the stack, to count + 1 + i)."""
        if self.held is not None:
            first, count = self.held
            E = self.num_experts
            local = ids - first
            local = torch.where((local >= 0) & (local < count), local, count)
            return self.gate_up, self.down, torch.where(ids >= E, ids + (count + 1 - E), local).to(ids.dtype)
        if self.expert_cache is None:
            return self.gate_up, self.down, ids
        return self.expert_cache.for_step(ids, self.top_k)

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
        out = self.unsummed(x)
        return out.combine().view(x.shape) if isinstance(out, ExpertOutputs) else out

    def unsummed(self, x: torch.Tensor):
        """The block's output for x [..., H]: on the Triton path the experts' outputs before their weighted sum
        (`ExpertOutputs`, [tokens, H] once summed), for a caller whose next kernel adds them to the residual stream
        itself (`kernels.norm.add_rms_norm_fp32_scale`); elsewhere the output tensor, x's shape."""
        x2 = x.reshape(-1, x.shape[-1])
        kernels = triton_for(self.gate_up, self.down, self.top_k) if x.is_cuda else None
        if kernels is None:
            return self._forward_reference(x2).view(x.shape)
        return self._forward_triton(x2, kernels)

    def _shared_as_expert(self, kernels):
        """The shared expert's (gate_up, down) `ExtraExperts` (`kernels.shared_slots`) when stored like one routed
        expert, or (a `SwiGLU` of `slots` = n) like n of them: then decode runs it as n more expert slots of the
        routed launches (ids E..E+n-1), else None."""
        sh = self.shared
        if sh is None or not (isinstance(sh.gate_up, Linear) and sh.gate_up.quantized and sh.down.quantized):
            return None
        if self.top_k + sh.slots > 2 * kernels.MAX_TOP_K:
            return None  # more slots a token than the routing writes (`group_route.group_topk`'s bound)
        return kernels.shared_slots(self.gate_up, self.down, sh.gate_up.qt, sh.down.qt, sh.slots)

    def _decode_slots(self, x2: torch.Tensor, kernels, one_slot: bool):
        """The shared expert's `ExtraExperts` when the batch x2 runs through `kernels.moe_decode` with it as expert
        slots (`_shared_as_expert`, `kernels.slot_decode`; `one_slot`: only a shared expert of one slot), else None
        (a prefill: the shared expert runs as its own MLP)."""
        if one_slot and getattr(self.shared, "slots", 1) != 1:
            return None
        extras = self._shared_as_expert(kernels)
        if extras is None or not kernels.slot_decode(x2, self.top_k, self.num_experts, self.gate_up, self.down,
                                                     extras):
            return None
        return extras

    def _route_with_shared_slot(self, x2: torch.Tensor, kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode routing: (ids, weights) [T, k + 1], slot k the shared expert weighted by its gate. A quantized
        router's split-K partials go to the router kernel unsummed (two launches fewer)."""
        E, g, qmm = self.num_experts, self.gates, kernels.qmm
        if (isinstance(g, Linear) and g.quantized and g.bits in qmm.SUPPORTED_BITS
                and g.group_size in qmm.SUPPORTED_GROUPS):
            logits = qmm.qgemv_partials(x2, g.qt)
        else:
            logits = g(x2)
        return kernels.route(logits[..., :E], self.top_k, self.norm_topk_prob, logits[..., E])

    def _forward_triton(self, x2: torch.Tensor, kernels) -> torch.Tensor:
        shared_expert = self._decode_slots(x2, kernels, one_slot=True)  # (its router adds one gated slot)
        if shared_expert is not None:  # decode: the shared expert is slot k of every token (the router's, gated)
            ids, weights = self._route_with_shared_slot(x2, kernels)
            gate_up, down, ids = self._experts_for(ids)
            return kernels.moe_decode(x2, ids, weights, gate_up, down, shared_expert=shared_expert, summed=False,
                                      experts=self.num_experts)
        E = self.num_experts
        logits = self.gates(x2)
        gate_logit = logits[:, E] if self.shared is not None else None
        ids, weights = kernels.route(logits[:, :E], self.top_k, self.norm_topk_prob)
        gate_up, down, ids = self._experts_for(ids)
        shared_out = self.shared(x2) if self.shared is not None else None
        return kernels.moe(x2, ids, weights, gate_up, down, shared_out, gate_logit, summed=False, live=self.live,
                           experts=self.num_experts)

    def _forward_reference(self, x2: torch.Tensor) -> torch.Tensor:
        logits = self.gates(x2)
        probs = torch.softmax(logits[:, :self.num_experts].float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = self._experts_reference(x2, top_i, top_w)
        if self.shared is not None:
            out = out + torch.sigmoid(logits[:, self.num_experts:]) * self.shared(x2)
        return out

    def _experts_reference(self, x2: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """sum_j top_w[t, j] * expert top_i[t, j](x2[t]) [T, H] in x2's dtype: a loop over the hit experts."""
        gate_up, down, where = self._experts_for(top_i.to(torch.int32))  # where: top_i, or the experts' slots
        out = torch.zeros_like(x2)
        for e in top_i.unique().tolist():  # in expert order, wherever the experts are: the same sums
            tok, slot = (top_i == e).nonzero(as_tuple=True)
            w = int(where[tok[0], slot[0]])
            if self.held is not None and w == self.held[1]:  # held by another rank
                continue
            xe = x2[tok]
            g, u = _expert_matmul(xe, gate_up, w).chunk(2, dim=-1)
            h = _expert_matmul(F.silu(g) * u, down, w)
            out.index_add_(0, tok, (h * top_w[tok, slot, None]).to(x2.dtype))
        return out
