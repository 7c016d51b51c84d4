"""sm_90's wgmma grouped expert GEMM (`kernels/moe/wgmma.py`, `w4_wgmma.cu`) against the dequantized reference on
fresh random data, on an H100/H200; its every variant compiles for sm_90a wherever NVRTC's library is found."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels import nvrtc  # noqa: E402
from sluice.kernels.moe import grouped as mg  # noqa: E402
from sluice.kernels.moe import reference  # noqa: E402
from sluice.kernels.moe import triton as mt  # noqa: E402
from sluice.kernels.moe import wgmma  # noqa: E402
from sluice.quant.affine import QuantizedTensor, quantize  # noqa: E402

sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and nvrtc.available()
                               and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU and NVRTC")


@pytest.mark.skipif(not nvrtc.compiler_found(), reason="NVRTC's library not found")
def test_every_variant_compiles_for_sm90a():
    for variant in wgmma.variants():
        assert nvrtc.compile_cubin(wgmma.source(variant[1]), "moe_w4_wgmma", wgmma._defines(*variant), "sm_90a")


def test_the_step_names_every_accumulator_register():
    text = wgmma.step_function(64)
    assert "m64n64k16" in text and '"+f"(d[31])' in text and '"+f"(d[32])' not in text and "%36" in text


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def stack(E, N, K, gs, g, dtype=torch.bfloat16):
    qt = quantize(torch.randn(E, N, K, generator=g) * 0.1, 4, gs)
    return QuantizedTensor(qt.weight.cuda(), qt.scales.to(dtype).cuda(), qt.biases.to(dtype).cuda(), 4, gs)


def deq(qt):
    """The weights exactly as the kernel makes them: s q + b rounded once to the scales' dtype."""
    return qt.dequantize(torch.float32).to(qt.scales.dtype).float()


@sm90
@pytest.mark.parametrize("swiglu,tn,gs,dtype,T,k,N", [
    (True, 64, 64, torch.bfloat16, 200, 3, 128), (False, 64, 64, torch.bfloat16, 200, 3, 128),
    (True, 128, 32, torch.float16, 300, 4, 64), (False, 128, 64, torch.bfloat16, 300, 4, 192),
    (True, 128, 64, torch.bfloat16, 40, 2, 96), (False, 64, 32, torch.float16, 500, 2, 64)])
def test_grouped_gemm_matches_the_dequantized_product(swiglu, tn, gs, dtype, T, k, N):
    """Every slot's row of c, tiles of tn rows (experts with more rows than a tile take several; some take none),
    one and two warpgroups a program (by the columns)."""
    g = torch.Generator().manual_seed(T * k + tn + N)
    E, K = 8, 384
    qt = stack(E, 2 * N if swiglu else N, K, gs, g, dtype)
    x = torch.randn(T, K, generator=g).to(dtype).cuda()
    ids = torch.randint(0, E - 1, (T, k), generator=g, dtype=torch.int32).cuda()  # expert E - 1: no rows
    table = mg.tile_table(ids, mt.expert_order(ids).to(torch.int32), E, tn)
    c = torch.full((T * k, N), float("nan"), dtype=dtype, device="cuda")
    wgmma.grouped_gemm(x, k, qt, c, table, swiglu, tn)
    w = deq(qt)[ids.long().view(-1)]  # [T*k, N or 2N, K]
    y = torch.einsum("sk,snk->sn", x.float().repeat_interleave(k, 0), w)
    ref = torch.nn.functional.silu(y[:, :N]) * y[:, N:] if swiglu else y
    assert not c.isnan().any()
    assert rel_err(c, ref) <= 1e-2


@sm90
def test_moe_prefill_takes_it_past_the_mma_rows(monkeypatch):
    """Experts averaging more rows than `MMA_MAX_ROWS` run through this kernel, and the layer matches the
    reference."""
    calls = []
    real = wgmma.grouped_gemm
    monkeypatch.setattr(wgmma, "grouped_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    E, H, I, k, T = 16, 256, 128, 4, 512
    gate_up, down = stack(E, 2 * I, H, 64, g), stack(E, H, I, 64, g)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    logits = torch.randn(T, E, generator=g).cuda()
    ids, weights = mt.route(logits, k, True)
    out = mt.moe_prefill(x, ids, weights, gate_up, down)
    assert len(calls) == 2
    ref = reference.moe_reference(x, logits, gate_up, down, k, True)
    assert rel_err(out, ref) <= 2e-2
