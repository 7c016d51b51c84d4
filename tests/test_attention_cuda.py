"""The CUDA C TurboQuant decode kernel (kernels/attention/cuda.py, NVRTC) against fp64 attention over the
dequantized cache with the newest positions exact, and against the Triton kernel: GPU only (CI has none; there the
Triton kernel, which does the same math, runs under the interpreter)."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels import nvrtc  # noqa: E402
from sluice.kernels.attention import cuda as tq_cuda  # noqa: E402
from sluice.kernels.attention import triton as at  # noqa: E402
from sluice.kernels.turboquant import reference as tq  # noqa: E402
from helpers import attention_reference as reference, rel  # noqa: E402

pytestmark = pytest.mark.skipif(not nvrtc.available(), reason="needs an NVIDIA GPU and NVRTC")


def build(B, Hkv, D, hist, cap, recent, pos, ring_dtype, g):
    """A cache as the TurboQuant cache holds it after position pos[b] of random history (keys with a mean, so the
    scores have structure), and the fp64 reference's keys and values per sequence."""
    k = torch.randn(B, Hkv, hist, D, generator=g) * 1.5 + 0.4
    v = torch.randn(B, Hkv, hist, D, generator=g) * torch.rand(B, Hkv, hist, 1, generator=g) * 3
    kc, ks = tq.quantize(k)
    vc, vs = tq.quantize(v)
    codes_k = torch.zeros(B, Hkv, cap, D // 2, dtype=torch.uint8)
    codes_v, scale_k, scale_v = codes_k.clone(), torch.zeros(B, Hkv, cap), torch.zeros(B, Hkv, cap)
    ring_k, ring_v = torch.zeros(B, Hkv, recent, D), torch.zeros(B, Hkv, recent, D)
    for b in range(B):
        for j in range(int(pos[b]) + 1):
            s = j % cap
            codes_k[b, :, s], codes_v[b, :, s] = kc[b, :, j], vc[b, :, j]
            scale_k[b, :, s], scale_v[b, :, s] = ks[b, :, j], vs[b, :, j]
            ring_k[b, :, j % recent], ring_v[b, :, j % recent] = tq.rotate(k[b, :, j]), tq.rotate(v[b, :, j])
    d = lambda x: x.cuda()  # noqa: E731
    cache = dict(k_scale=d(scale_k), v_scale=d(scale_v), k_recent=d(ring_k.to(ring_dtype)),
                 v_recent=d(ring_v.to(ring_dtype)))
    return d(codes_k), d(tq.interleave(codes_v)), cache, (k, v, kc, ks, vc, vs)


@pytest.mark.parametrize("Hq,Hkv,D", [(16, 2, 256), (32, 8, 128), (9, 3, 64), (4, 1, 128)])
@pytest.mark.parametrize("window", [None, 160])
@pytest.mark.parametrize("ring_dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_equals_attention_over_the_dequantized_cache(Hq, Hkv, D, window, ring_dtype):
    g = torch.Generator().manual_seed(Hq + D + (window or 0))
    B, recent, hist = 3, 64, 600
    cap = 192 if window else 608
    pos = torch.tensor([599, 40, 333])  # entry 1: every position in the ring; with a window the ring wraps
    kcodes, vcodes, cache, (k, v, kc, ks, vc, vs) = build(B, Hkv, D, hist, cap, recent, pos, ring_dtype, g)
    q = torch.randn(B, Hq, D, generator=g)
    qr = tq.rotate(q)
    scale = D ** -0.5
    args = (qr.cuda(), kcodes, vcodes, pos.cuda().int(), scale)
    assert tq_cuda.applies(args[0], kcodes, vcodes, cache["k_scale"], cache["v_scale"], cache["k_recent"],
                           cache["v_recent"], args[3])
    visible = min(600, window or 600)
    outs = {}
    for splits in (None, 1, 3):
        outs[splits] = at.decode_attention(*args, visible, window=window, splits=splits, **cache).cpu()
    kq, vq = tq.dequantize_rotated(kc, ks), tq.dequantize_rotated(vc, vs)
    for b in range(B):
        p = int(pos[b])
        lo = 0 if window is None else max(0, p - window + 1)
        j = torch.arange(lo, p + 1)
        exact = (p - j < recent)[None, :, None]
        ring = lambda x: tq.rotate(x[b][:, lo:p + 1]).to(ring_dtype).float()  # noqa: E731
        keys = torch.where(exact, ring(k), kq[b][:, lo:p + 1])
        vals = torch.where(exact, ring(v), vq[b][:, lo:p + 1])
        ref = reference(qr[b], keys, vals, scale)
        for splits, o in outs.items():
            err = rel(o[b], ref)
            assert err < 5e-3, (splits, b, err)
    # the same partials as the Triton kernel, through the same merge
    tq_cuda.ENABLED = False
    try:
        triton_out = at.decode_attention(*args, visible, window=window, **cache).cpu()
    finally:
        tq_cuda.ENABLED = True
    assert rel(outs[None], triton_out) < 5e-3


def test_cuda_kernel_unrotates_and_is_captured_by_a_graph():
    """unrotate through the merge; the launch recorded by a CUDA graph replays with new inputs."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, recent, cap = 2, 16, 2, 256, 64, 4096
    pos = torch.tensor([4095, 1000])
    kcodes, vcodes, cache, _ = build(B, Hkv, D, 4096, cap, recent, pos, torch.bfloat16, g)
    q = tq.rotate(torch.randn(B, Hq, D, generator=g)).cuda()
    posd = pos.cuda()  # int64 positions (the caches pass int32): the kernel reads either
    run = lambda: at.decode_attention(q, kcodes, vcodes, posd, 0.0625, 4096, unrotate=True, **cache)  # noqa: E731
    first = run()
    plain = at.decode_attention(q, kcodes, vcodes, posd, 0.0625, 4096, **cache)
    assert rel(first.cpu(), tq.unrotate(plain.cpu())) < 1e-4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q.copy_(tq.rotate(torch.randn(B, Hq, D, generator=g)).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out.cpu(), run().cpu()) < 1e-6
