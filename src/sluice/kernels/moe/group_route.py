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

`router_partials`: a decode step's router logits (fp32 x [T <= ROUTER_MAX_TOKENS, H] times the fp32 gate [E, H],
as HF keeps it) as split-K partials [S, T, E] in one launch, which `group_topk` sums (in place of cuBLAS's two
kernels for a GEMV: one launch fewer a layer, where a batch-1 step is a chain of short launches).
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
MAX_PARTIALS = 128  # split-K partials of the logits `group_topk` sums (all loaded at once)


ROUTER_MAX_TOKENS = 4  # tokens `router_partials` takes (a decode step's few; more go through cuBLAS)


@triton.jit
def _router_kernel(x_ptr, w_ptr, out_ptr, T, E, K, k_per_split, stride_xt, stride_we, stride_os, stride_ot,
                   TP: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BE experts, split): out[split, t, e] = sum over the split's k of x[t, k] * w[e, k] (fp32)."""
    launch.pdl_start(PDL)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    split = tl.program_id(1)
    t = tl.arange(0, TP)
    e_ok, t_ok = e < E, t < T
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((TP, BE), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < k_hi
        w = tl.load(w_ptr + e.to(tl.int64)[:, None] * stride_we + k[None, :], mask=e_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + split * stride_os + t[:, None] * stride_ot + e[None, :], acc,
             mask=t_ok[:, None] & e_ok[None, :])


def router_partials(x: torch.Tensor, weight: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Split-K partials [S, T, E] (fp32) of the router logits x @ weight^T: x fp32 [T <= ROUTER_MAX_TOKENS, H],
    weight fp32 [E, H], both with unit last strides, on one device. `splits` (default: about 128 programs)."""
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.stride(1) != 1 or weight.stride(1) != 1 or x.device != weight.device
            or not 1 <= x.shape[0] <= ROUTER_MAX_TOKENS):
        raise ValueError(f"deepseek router: fp32 x [1..{ROUTER_MAX_TOKENS}, H] and weight [E, H] with unit last "
                         f"strides on one device, got {x.dtype} {tuple(x.shape)} and {weight.dtype} "
                         f"{tuple(weight.shape)}")
    (T, K), E = x.shape, weight.shape[0]
    BE, BK = min(64, triton.next_power_of_2(E)), 32
    blocks = triton.cdiv(E, BE)
    if splits is None:
        splits = max(1, min(triton.cdiv(K, BK), 128 // blocks))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), BK) * BK
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty((splits, T, E), dtype=torch.float32, device=x.device)
    use_pdl = launch.pdl(x.device)
    _router_kernel[(blocks, splits)](x, weight, out, T, E, K, k_per_split, x.stride(0), weight.stride(0),
                                     out.stride(0), out.stride(1), TP=triton.next_power_of_2(T), BE=BE, BK=BK,
                                     PDL=use_pdl, launch_pdl=use_pdl, num_warps=4)
    return out


@triton.jit
def _group_route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, S, stride_ls, stride_lt, scaling,
                        SP: tl.constexpr, TOP_K: tl.constexpr, EXTRA: tl.constexpr, KP: tl.constexpr,
                        BLOCK_E: tl.constexpr,
                        SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, NGP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                        TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr,
                        ACCURATE: tl.constexpr, PDL: tl.constexpr):
    launch.pdl_start(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    if SP == 1:
        logit = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=0.0).to(tl.float32)
    else:  # split-K partials (`router_partials`), all loaded at once and summed
        sp = tl.arange(0, SP)
        logit = tl.sum(tl.load(logits_ptr + sp[:, None] * stride_ls + t.to(tl.int64) * stride_lt + offs[None, :],
                               mask=(sp < S)[:, None] & ok[None, :], other=0.0), axis=0)
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
    SLOTS: tl.constexpr = TOP_K + EXTRA
    if EXTRA > 0:  # the shared experts' slots: ids E.., weight 1
        extra = (offs_k >= TOP_K) & (offs_k < SLOTS)
        top_i = tl.where(extra, E + offs_k - TOP_K, top_i)
        top_w = tl.where(extra, 1.0, top_w)
    k_ok = offs_k < SLOTS
    tl.store(ids_ptr + t * SLOTS + offs_k, top_i, mask=k_ok)
    tl.store(w_ptr + t * SLOTS + offs_k, top_w, mask=k_ok)


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
               n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float, extra_slots: int = 0,
               num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float, unit last stride; or fp32 split-K partials [S, T, E] of them, summed here) and
    e_score_correction_bias [E] (or None) -> (ids int32 [T, top_k], weights fp32 [T, top_k]), best first:
    `layers.deepseek_moe.route` in one launch. extra_slots = n: n more slots a token, experts E..E+n-1 weighted 1
    (the shared experts as expert slots), [T, top_k + n]."""
    if (logits.dim() not in (2, 3) or not logits.is_floating_point() or logits.stride(-1) != 1
            or (logits.dim() == 3 and (logits.dtype != torch.float32 or logits.shape[0] > MAX_PARTIALS))):
        raise ValueError(f"deepseek route: logits must be a float [T, E] tensor (or fp32 partials [S <= "
                         f"{MAX_PARTIALS}, T, E]) with a unit last stride, got {logits.dtype} {tuple(logits.shape)}")
    parts = logits if logits.dim() == 3 else logits[None]
    S, T, E = parts.shape
    check(E, top_k, scoring, method, n_group, topk_group)
    use_bias = method == "noaux_tc" and bias is not None
    if use_bias and (bias.shape != (E,) or not bias.is_floating_point() or not bias.is_contiguous()
                     or bias.device != logits.device):
        raise ValueError(f"deepseek route: bias must be a contiguous float [{E}] tensor on {logits.device}, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    if not math.isfinite(scaling):
        raise ValueError(f"deepseek route: routed_scaling_factor must be finite, got {scaling}")
    if extra_slots < 0 or top_k + extra_slots > 2 * MAX_TOP_K:
        raise ValueError(f"deepseek route: 0..{2 * MAX_TOP_K - top_k} extra slots, got {extra_slots}")
    ids = torch.empty((T, top_k + extra_slots), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k + extra_slots), dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    grouped = method != "greedy" and n_group > 1
    normalise = norm_topk_prob and top_k > 1
    use_pdl = launch.pdl(logits.device)
    _group_route_kernel[(T,)](
        parts, bias if use_bias else parts, ids, weights, E, S, parts.stride(0), parts.stride(1), float(scaling),
        SP=triton.next_power_of_2(S) if S > 1 else 1, TOP_K=top_k, EXTRA=extra_slots,
        KP=triton.next_power_of_2(top_k + extra_slots),
        BLOCK_E=triton.next_power_of_2(E),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=use_bias, GROUPS=n_group if grouped else 1,
        NGP=triton.next_power_of_2(n_group) if grouped else 1, GROUP_SIZE=E // n_group if grouped else E,
        TOPK_GROUP=topk_group if grouped else 0, TOP2=method == "noaux_tc", NORM=normalise,
        SCALE=method == "noaux_tc" or not normalise, ACCURATE=not INTERPRET, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=num_warps)
    return ids, weights
