"""DeepSeekMoE (V2/V3): a router of sigmoid (V3) or softmax (V2) scores with group-limited top-k, routed SwiGLU
experts stacked as `SparseMoE` stacks them, and shared experts (one plain MLP, always on, no gate).

Routing (`route`, HF `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter` and DeepSeek's own modeling code):
* "noaux_tc" (V3): selection on scores + e_score_correction_bias; the groups ranked by the sum of their two best
  biased scores, the experts of all but `topk_group` groups masked; the weights are the unbiased scores of the
  chosen experts, normalised when `norm_topk_prob` (and top-k > 1), times `routed_scaling_factor`;
* "group_limited_greedy" (V2): groups ranked by their best score; "greedy": plain top-k; the weights are the scores
  times `routed_scaling_factor` (or, with `norm_topk_prob`, normalised instead, as DeepSeek-V2's code does).

The experts run where `SparseMoE`'s run: on CUDA with quantized experts the `kernels/moe` Triton launches (fed the
ids and weights computed here in torch, so no host sync: a decode step can be captured; in decode the shared experts
ride as one more slot when stored like a routed expert, or n more when n times as wide (`n_shared_experts` = n: the
loader lays their gate_up out in slots, `layers.moe.swiglu`), else the reference loop over the hit experts. Streamed
experts (`experts/`) work unchanged. On CUDA `route` runs as one Triton launch (`kernels/moe/group_route.py`: the
same ids, best first, the same weights to an ulp), and a decode step's fp32 router GEMV as one more, whose split-K
partials that launch sums (`router_partials`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.kernels.mla import chain, kernels as mla_kernels
from sluice.kernels.moe import ExpertOutputs
from sluice.kernels.moe import triton_for
from sluice.layers.linear import Linear
from sluice.layers.moe import SparseMoE, SwiGLU


@dataclass(frozen=True)
class Routing:
    scoring: str  # "sigmoid" | "softmax"
    method: str  # "noaux_tc" | "group_limited_greedy" | "greedy"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], weights fp32 [T, k]) of router logits [T, E] (fp32)."""
    T, E = logits.shape
    scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias.float() if (r.method == "noaux_tc" and bias is not None) else scores
    if r.method != "greedy" and r.n_group > 1:
        grouped = choice.view(T, r.n_group, E // r.n_group)
        if r.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(r.topk_group, dim=-1, sorted=False).indices, True)
        keep = keep[:, :, None].expand(T, r.n_group, E // r.n_group).reshape(T, E)
        choice = choice.masked_fill(~keep, float("-inf") if r.method == "noaux_tc" else 0.0)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    normalise = r.norm_topk_prob and top_k > 1
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if r.method == "noaux_tc" or not normalise:
        weights = weights * r.scaling
    return ids.to(torch.int32), weights.float()


def moe_kernels(moe: SparseMoE, x: torch.Tensor):
    """The Triton MoE kernels for this block's experts when x is on CUDA and they run them, else None."""
    return triton_for(moe.gate_up, moe.down, moe.top_k) if x.is_cuda else None


class DeepseekMoE(SparseMoE):
    def __init__(self, router: Linear, bias: torch.Tensor | None, gate_up, down, top_k: int, routing: Routing,
                 shared: SwiGLU | None):
        super().__init__(router, gate_up, down, top_k, routing.norm_topk_prob, shared, None)
        self.routing = routing
        self.register_buffer("correction_bias", None if bias is None else bias.float())
        # the shared experts' "gate logit" where their output rides in `ExpertOutputs`: sigmoid(+inf) = 1 exactly
        self.register_buffer("shared_gate", torch.full((1,), float("inf")), persistent=False)
        # decode with the shared experts as n expert slots: ids E..E+n-1, weights 1, appended to every token's
        n = 0 if shared is None else shared.slots
        E = self.num_experts
        self.register_buffer("shared_ids", torch.arange(E, E + n, dtype=torch.int32), persistent=False)
        self.register_buffer("shared_ones", torch.ones(n, dtype=torch.float32), persistent=False)

    def route(self, x2: torch.Tensor, x32: torch.Tensor | None = None,
              extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, weights) [T, k + extra] of tokens x2 [T, H]; the router's logits in fp32 (as HF keeps the gate).
        x32: x2 in fp32 where the norm before gave it (one cast fewer). extra = n: the shared experts' n slots
        after the routed ones (ids E..E+n-1, weight 1)."""
        g, r = self.gates, self.routing
        kernel = None
        if x2.is_cuda and mla_kernels():  # the routing in one Triton launch, where its sizes fit
            from sluice.kernels.moe import group_route

            if group_route.supports(g.out_features, self.top_k, r.scoring, r.method, r.n_group, r.topk_group):
                kernel = group_route
        if not g.quantized:
            x = x2.float() if x32 is None else x32.reshape(x2.shape)
            if kernel is not None and 1 <= x.shape[0] <= kernel.ROUTER_MAX_TOKENS and g.weight.dtype == torch.float32:
                logits = kernel.router_partials(x.contiguous(), g.weight)  # a decode step: one launch, not two
            else:
                logits = F.linear(x, g.weight.float())
        else:
            logits = g(x2).float()
        if kernel is not None:
            return kernel.group_topk(logits, self.correction_bias, self.top_k, r.scoring, r.method, r.n_group,
                                     r.topk_group, r.norm_topk_prob, r.scaling, extra_slots=extra)
        ids, weights = route(logits, self.correction_bias, self.top_k, r)
        if extra:
            T = ids.shape[0]
            ids = torch.cat([ids, self.shared_ids[:extra].expand(T, extra)], dim=1)
            weights = torch.cat([weights, self.shared_ones[:extra].expand(T, extra)], dim=1)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.unsummed(x)
        return out.combine().view(x.shape) if isinstance(out, ExpertOutputs) else out

    def unsummed(self, x: torch.Tensor, x32: torch.Tensor | None = None):
        """The block's output for x [..., H]: on the Triton path the experts' outputs before their weighted sum
        (`ExpertOutputs`, the shared experts' output riding in it with weight 1), which the next residual add +
        norm sums (`kernels.mla.fused.add_rms_norm`); elsewhere the output tensor, x's shape."""
        x2 = x.reshape(-1, x.shape[-1])
        kernels = moe_kernels(self, x)
        if kernels is None:
            ids, weights = self.route(x2, x32)
            out = self._experts_reference(x2, ids, weights)
            if self.shared is not None:
                out = out + self.shared(x2)
            return out.view(x.shape)
        T = x2.shape[0]
        shared_expert = self._decode_slots(x2, kernels, one_slot=False)
        if shared_expert is not None:  # decode: the shared experts are slots k..k+n-1 of every token, weight 1
            ids, weights = self.route(x2, x32, extra=shared_expert[0].n)
            gate_up, down, ids = self._experts_for(ids)
            return kernels.moe_decode(x2, ids, weights, gate_up, down, shared_expert=shared_expert, summed=False,
                                      experts=self.num_experts)
        ids, weights = self.route(x2, x32)
        shared_out = gate = None
        if self.shared is not None:
            shared_out = self._shared_out(x2)
            gate = self.shared_gate.expand(T)
        gate_up, down, ids = self._experts_for(ids)
        return kernels.moe(x2, ids, weights, gate_up, down, shared_out, gate, summed=False, live=self.live,
                           experts=self.num_experts)

    def _shared_out(self, x2: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, H]: in two GEMV launches where they run (`chain.swiglu_gemv`: a decode
        step of a few tokens, gate_up not in slots), else the SwiGLU module."""
        if chain.applies(x2):
            y = chain.swiglu_gemv(self.shared, x2, split=False)
            if y is not None:
                return y[0]
        return self.shared(x2)
