"""DeepSeek's group-limited top-k router in one Triton launch (`kernels/moe/group_route.py`) against the torch
routing of `layers/deepseek_moe.py` on fresh random logits: V3 (sigmoid, bias, groups by their two best), Moonlight
and Kimi-K2 (one group), V2 (softmax, groups by their best, scaled or normalised), V2-Lite (greedy), sizes that are
not powers of two; the same ids, the same weights within 1e-6; bad settings raise. Under the Triton interpreter on
the CPU; on a GPU at once."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels.moe import group_route as gr  # noqa: E402
from sluice.layers.deepseek_moe import Routing, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {  # E, top_k, Routing(scoring, method, n_group, topk_group, norm_topk_prob, scaling), bias
    "v3": (256, 8, Routing("sigmoid", "noaux_tc", 8, 4, True, 2.5), True),
    "v3-small": (64, 6, Routing("sigmoid", "noaux_tc", 8, 3, True, 1.5), True),
    "v3-no-bias": (64, 4, Routing("sigmoid", "noaux_tc", 4, 2, True, 1.0), False),
    "v3-unnormalised": (48, 4, Routing("sigmoid", "noaux_tc", 6, 2, False, 2.0), True),  # 6 groups of 8
    "moonlight": (64, 6, Routing("sigmoid", "noaux_tc", 1, 1, True, 2.446), True),
    "kimi-k2": (384, 8, Routing("sigmoid", "noaux_tc", 1, 1, True, 2.827), True),
    "v2": (160, 6, Routing("softmax", "group_limited_greedy", 8, 3, False, 16.0), False),
    "v2-normalised": (72, 5, Routing("softmax", "group_limited_greedy", 6, 2, True, 1.0), False),
    "v2-lite": (64, 6, Routing("softmax", "greedy", 1, 1, False, 1.0), False),
    "top-1": (40, 1, Routing("sigmoid", "noaux_tc", 4, 1, True, 2.0), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_router_equals_the_torch_routing(name):
    E, k, r, has_bias = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 1000 + E)
    T = 6
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if has_bias else None
    ref_ids, ref_w = route(logits, bias, k, r)
    d = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    ids, w = gr.group_topk(d(logits), d(bias), k, r.scoring, r.method, r.n_group, r.topk_group, r.norm_topk_prob,
                           r.scaling)
    ids, w = ids.cpu(), w.cpu()
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    # torch's topk(sorted=False) has an order of its own: compare per token in expert order
    order, ref_order = ids.long().sort(dim=1), ref_ids.long().sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    assert (w.gather(1, order.indices) - ref_w.gather(1, ref_order.indices)).abs().max() <= 1e-6
    # best first: by the choice score (the bias-corrected one for noaux_tc)
    scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(-1)
    choice = scores + bias if bias is not None else scores
    picked = choice.gather(1, ids.long())
    assert (picked[:, :-1] >= picked[:, 1:]).all()


def test_bf16_logits_route_as_their_fp32_values():
    E, k, r, _ = CASES["v3-small"]
    logits = (torch.randn(5, E, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    ids, w = gr.group_topk(logits.to(DEVICE), None, k, r.scoring, r.method, r.n_group, r.topk_group,
                           r.norm_topk_prob, r.scaling)
    ref_ids, ref_w = route(logits.float(), None, k, r)
    order, ref_order = ids.cpu().long().sort(dim=1), ref_ids.long().sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    assert (w.cpu().gather(1, order.indices) - ref_w.gather(1, ref_order.indices)).abs().max() <= 1e-6


@pytest.mark.parametrize("T,E,H", [(1, 64, 2048), (3, 256, 200)])
def test_router_partials_sum_to_the_logits_and_route_alike(T, E, H):
    """`router_partials`: x [T, H] @ W^T [E, H] (fp32) as split-K partials, which `group_topk` sums itself: the
    logits of the fp64 product within fp32 rounding, and the routing of those logits (Moonlight's width at batch 1,
    V3's expert count at a hidden size of no power of two)."""
    g = torch.Generator().manual_seed(T * E)
    x, w = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * H ** -0.5
    d = lambda t: t.to(DEVICE)  # noqa: E731
    parts = gr.router_partials(d(x), d(w)).cpu()
    assert parts.dim() == 3 and parts.shape[1:] == (T, E) and parts.shape[0] > 1
    logits = parts.sum(0)
    assert (logits.double() - x.double() @ w.double().T).abs().max() < 1e-4
    _, k, r, _ = CASES["v3"] if E == 256 else CASES["moonlight"]
    bias = torch.randn(E, generator=g) * 0.1
    ids, wts = gr.group_topk(d(parts), d(bias), k, r.scoring, r.method, r.n_group, r.topk_group, r.norm_topk_prob,
                             r.scaling)
    ref_ids, ref_w = gr.group_topk(d(logits), d(bias), k, r.scoring, r.method, r.n_group, r.topk_group,
                                   r.norm_topk_prob, r.scaling)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and (wts.cpu() - ref_w.cpu()).abs().max() <= 1e-6
    # the shared experts as two more slots a token: experts E and E + 1, weight 1, after the routed ones
    ids2, wts2 = gr.group_topk(d(parts), d(bias), k, r.scoring, r.method, r.n_group, r.topk_group,
                               r.norm_topk_prob, r.scaling, extra_slots=2)
    assert torch.equal(ids2.cpu(), torch.cat([ref_ids.cpu(), torch.tensor([E, E + 1]).int().expand(T, 2)], 1))
    assert torch.equal(wts2.cpu(), torch.cat([wts.cpu(), torch.ones(T, 2)], 1))
    with pytest.raises(ValueError, match="router"):
        gr.router_partials(d(x).double(), d(w))


def test_bad_settings_raise():
    z = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="scoring"):
        gr.group_topk(z, None, 4, "relu", "noaux_tc", 8, 4, True, 1.0)
    with pytest.raises(ValueError, match="groups"):
        gr.group_topk(z, None, 4, "sigmoid", "noaux_tc", 6, 2, True, 1.0)  # 64 experts in 6 groups
    with pytest.raises(ValueError, match="top_k"):
        gr.group_topk(z, None, 17, "sigmoid", "noaux_tc", 8, 4, True, 1.0)  # 16 kept experts
    with pytest.raises(ValueError, match="bias"):
        gr.group_topk(z, torch.zeros(32), 4, "sigmoid", "noaux_tc", 8, 4, True, 1.0)
    with pytest.raises(ValueError, match="logits"):
        gr.group_topk(torch.zeros(64), None, 4, "sigmoid", "noaux_tc", 8, 4, True, 1.0)
    with pytest.raises(ValueError, match="experts"):
        gr.group_topk(torch.zeros(1, 2048), None, 4, "sigmoid", "greedy", 1, 1, True, 1.0)
