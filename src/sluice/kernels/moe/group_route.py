"""DeepSeek's router in one Triton launch: group-limited top-k over sigmoid (V3) or softmax (V2) scores.

One program per token, all E experts in registers (E <= 1024), the same steps as the torch routing of
`layers/deepseek_moe.py` (`route`, the oracle), in fp32:
* scores = sigmoid(logits) (on a GPU expf and a correctly rounded division, as torch's CUDA sigmoid computes it) or
  softmax(logits); choice = scores + e_score_correction_bias ("noaux_tc" with a bias), else the scores;
* grouped ("noaux_tc" / "group_limited_greedy" with n_group > 1): each group's score is the sum of its two best
  choices (noaux_tc: torch's topk(2).values.sum) or its best (V2); the topk_group best groups are kept, the other
  experts' choices set to -inf (noaux_tc) or 0 (V2), as torch masks them;
* the top_k best choices (ties to the lower index; groups likewise), best first; weights the unbiased scores of the
  chosen, normalised (w / (sum + 1e-20)) when norm_topk_prob and top_k > 1, times routed_scaling_factor for
  noaux_tc or when not normalised.
The ids equal torch's as sets (torch's topk(sorted=False) order is its own; here best first), the weights within
an ulp or so. No host reads: a decode step can be captured.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from sluice.kernels import launch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_EXPERTS = 1024
MAX_TOP_K = 16
METHODS = ("noaux_tc", "group_limited_greedy", "greedy")


@triton.jit
def _group_route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_lt, scaling,
                        TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, NGP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                        TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr,
                        ACCURATE: tl.constexpr, PDL: tl.constexpr):
    launch.pdl_start(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logit = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=0.0).to(tl.float32)
    if SIGMOID:
        if ACCURATE:  # expf: torch's CUDA sigmoid, 1 / (1 + exp(-x))
            scores = _div(tl.full((BLOCK_E,), 1.0, tl.float32), 1.0 + libdevice_exp(-logit), ACCURATE)
        else:
            scores = 1.0 / (1.0 + tl.exp(-logit))
    else:
        x = tl.where(ok, logit, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=0))
        scores = _div(p, tl.sum(p, axis=0), ACCURATE)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if GROUPS > 1:
        gi = tl.arange(0, NGP)
        member = ((offs // GROUP_SIZE)[None, :] == gi[:, None]) & ok[None, :]  # [NGP, BLOCK_E]
        grid = tl.where(member, choice[None, :], float("-inf"))
        best = tl.max(grid, axis=1)
        if TOP2:  # the sum of the two best: the best once (its lowest index), then the best of the rest
            first = tl.min(tl.where(member & (grid == best[:, None]), offs[None, :], BLOCK_E), axis=1)
            second = tl.max(tl.where(offs[None, :] == first[:, None], float("-inf"), grid), axis=1)
            gscore = best + second
        else:
            gscore = best
        gscore = tl.where(gi < GROUPS, gscore, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(gscore, axis=0)
            g = tl.min(tl.where((gscore == top) & ~keep & (gi < GROUPS), gi, NGP), axis=0)
            keep = keep | (gi == g)
            gscore = tl.where(gi == g, float("-inf"), gscore)
        kept = tl.max((member & keep[:, None]).to(tl.int32), axis=0) > 0  # [BLOCK_E]
        masked = float("-inf") if TOP2 else 0.0
        choice = tl.where(kept | ~ok, choice, masked)
    offs_k = tl.arange(0, KP)
    top_w = tl.zeros((KP,), dtype=tl.float32)
    top_i = tl.zeros((KP,), dtype=tl.int32)
    taken = offs < 0
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.where(taken, float("-inf"), choice), axis=0)
        idx = tl.min(tl.where((choice == top) & ~taken & ok, offs, BLOCK_E), axis=0)
        taken = taken | (offs == idx)
        top_i = tl.where(offs_k == j, idx, top_i)
        top_w = tl.where(offs_k == j, tl.sum(tl.where(offs == idx, scores, 0.0), axis=0), top_w)
    if NORM:
        top_w = _div(top_w, tl.sum(top_w, axis=0) + 1e-20, ACCURATE)
    if SCALE:
        top_w = top_w * scaling
    k_ok = offs_k < TOP_K
    tl.store(ids_ptr + t * TOP_K + offs_k, top_i, mask=k_ok)
    tl.store(w_ptr + t * TOP_K + offs_k, top_w, mask=k_ok)


@triton.jit
def _div(a, b, ACCURATE: tl.constexpr):
    """a / b correctly rounded, as torch divides (Triton's fp32 `/` is an approximate division on a GPU)."""
    if ACCURATE:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def libdevice_exp(x):
    """CUDA's expf (what torch's kernels call), not Triton's exp2-based approximation."""
    return tl.extra.cuda.libdevice.exp(x)


def check(E: int, top_k: int, scoring: str, method: str, n_group: int, topk_group: int) -> None:
    """ValueError unless `group_topk` can route E experts this way."""
    if scoring not in ("sigmoid", "softmax") or method not in METHODS:
        raise ValueError(f"deepseek route: scoring must be sigmoid or softmax and method one of {METHODS}, got "
                         f"{scoring!r}, {method!r}")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"deepseek route: 1..{MAX_EXPERTS} experts, got {E}")
    grouped = method != "greedy" and n_group > 1
    if grouped and (E % n_group or not 1 <= topk_group <= n_group or (method == "noaux_tc" and E // n_group < 2)):
        raise ValueError(f"deepseek route: {E} experts in {n_group} groups (two or more each for noaux_tc), "
                         f"topk_group {topk_group} within them")
    kept = topk_group * (E // n_group) if grouped else E
    if not 1 <= top_k <= min(MAX_TOP_K, kept):
        raise ValueError(f"deepseek route: top_k must be in 1..{min(MAX_TOP_K, kept)} (the kept groups' experts), "
                         f"got {top_k}")


def supports(E: int, top_k: int, scoring: str, method: str, n_group: int, topk_group: int) -> bool:
    try:
        check(E, top_k, scoring, method, n_group, topk_group)
    except ValueError:
        return False
    return True


def group_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, method: str,
               n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
               num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float, unit last stride) and e_score_correction_bias [E] (or None) -> (ids int32
    [T, top_k], weights fp32 [T, top_k]), best first: `layers.deepseek_moe.route` in one launch."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(-1) != 1:
        raise ValueError(f"deepseek route: logits must be a float [T, E] tensor with a unit last stride, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    T, E = logits.shape
    check(E, top_k, scoring, method, n_group, topk_group)
    use_bias = method == "noaux_tc" and bias is not None
    if use_bias and (bias.shape != (E,) or not bias.is_floating_point() or not bias.is_contiguous()
                     or bias.device != logits.device):
        raise ValueError(f"deepseek route: bias must be a contiguous float [{E}] tensor on {logits.device}, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    if not math.isfinite(scaling):
        raise ValueError(f"deepseek route: routed_scaling_factor must be finite, got {scaling}")
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    grouped = method != "greedy" and n_group > 1
    normalise = norm_topk_prob and top_k > 1
    use_pdl = launch.pdl(logits.device)
    _group_route_kernel[(T,)](
        logits, bias if use_bias else logits, ids, weights, E, logits.stride(0), float(scaling),
        TOP_K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=use_bias, GROUPS=n_group if grouped else 1,
        NGP=triton.next_power_of_2(n_group) if grouped else 1, GROUP_SIZE=E // n_group if grouped else E,
        TOPK_GROUP=topk_group if grouped else 0, TOP2=method == "noaux_tc", NORM=normalise,
        SCALE=method == "noaux_tc" or not normalise, ACCURATE=not INTERPRET, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=num_warps)
    return ids, weights
