"""The CUDA grouped expert GEMM (`kernels/moe/mma.py`, `w4_mma.cu`) against the dequantized reference on fresh
random data, on a GPU; its every variant compiles for sm_90 wherever NVRTC's library is found (no GPU needed)."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels import nvrtc  # noqa: E402
from sluice.kernels.moe import grouped as mg  # noqa: E402
from sluice.kernels.moe import mma  # noqa: E402
from sluice.kernels.moe import reference  # noqa: E402
from sluice.kernels.moe import triton as mt  # noqa: E402
from sluice.quant.affine import QuantizedTensor, quantize  # noqa: E402

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and nvrtc.available()), reason="needs an NVIDIA GPU and NVRTC")


@pytest.mark.skipif(not nvrtc.compiler_found(), reason="NVRTC's library not found")
def test_every_variant_compiles_for_sm90():
    src = mma.SOURCE.read_text()
    for variant in mma.variants():
        assert nvrtc.compile_cubin(src, "moe_w4_mma", mma._defines(*variant), "sm_90")


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def stack(E, N, K, gs, g, dtype=torch.bfloat16):
    qt = quantize(torch.randn(E, N, K, generator=g) * 0.1, 4, gs)
    return QuantizedTensor(qt.weight.cuda(), qt.scales.to(dtype).cuda(), qt.biases.to(dtype).cuda(), 4, gs)


def deq(qt):
    """The weights exactly as the kernel makes them: s q + b rounded once to the scales' dtype."""
    return qt.dequantize(torch.float32).to(qt.scales.dtype).float()


@gpu
@pytest.mark.parametrize("swiglu,tm,gs,dtype,T,k", [
    (True, 8, 64, torch.bfloat16, 5, 3), (False, 8, 64, torch.bfloat16, 5, 3),
    (True, 16, 32, torch.float16, 40, 4), (False, 32, 32, torch.bfloat16, 64, 4),
    (True, 32, 64, torch.bfloat16, 300, 2), (False, 8, 32, torch.float16, 64, 6)])
def test_grouped_gemm_matches_the_dequantized_product(swiglu, tm, gs, dtype, T, k):
    """Every slot's row of c, tiles of tm rows (experts with more rows than a tile take several; many take none)."""
    g = torch.Generator().manual_seed(T * k + tm)
    E, K, N = 8, 256, 128
    qt = stack(E, 2 * N if swiglu else N, K, gs, g, dtype)
    x = torch.randn(T, K, generator=g).to(dtype).cuda()
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32).cuda()
    table = mg.tile_table(ids, mt.expert_order(ids), E, tm)
    c = torch.full((T * k, N), float("nan"), dtype=dtype, device="cuda")
    mma.grouped_gemm(x, k, qt, c, table, swiglu, tm)
    w = deq(qt)[ids.long().view(-1)]  # [T*k, N or 2N, K]
    y = torch.einsum("sk,snk->sn", x.float().repeat_interleave(k, 0), w)
    ref = torch.nn.functional.silu(y[:, :N]) * y[:, N:] if swiglu else y
    assert not c.isnan().any()
    assert rel_err(c, ref) <= 1e-2


@gpu
@pytest.mark.parametrize("T,n", [(3, 1), (16, 1), (64, 2)])
def test_decode_with_shared_slots_matches_the_gemvs_and_the_reference(T, n):
    """moe_decode through the tensor-core kernel (a shared MLP as n slots, ids E..) equals the reference and the
    expert GEMVs' result at a real-ish shape."""
    g = torch.Generator().manual_seed(T + n)
    E, H, I, k = 16, 256, 128, 4
    gate_up, down = stack(E, 2 * I, H, 64, g), stack(E, H, I, 64, g)
    sh_gu, sh_down = stack(1, 2 * n * I, H, 64, g), stack(1, H, n * I, 64, g)
    sh_gu, sh_down = (QuantizedTensor(q.weight[0], q.scales[0], q.biases[0], 4, 64) for q in (sh_gu, sh_down))
    extras = mt.shared_slots(gate_up, down, sh_gu, sh_down, n)
    assert extras is not None and mma.applies(torch.empty(1, H, dtype=torch.bfloat16, device="cuda"), gate_up, down,
                                              extras)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    logits = 2 * torch.randn(T, E, generator=g).cuda()
    ids, weights = mt.route(logits, k, True)
    ids = torch.cat([ids, torch.arange(E, E + n, dtype=torch.int32, device="cuda").expand(T, n)], 1)
    weights = torch.cat([weights, torch.ones(T, n, device="cuda")], 1)
    out = mt.moe_decode(x, ids, weights, gate_up, down, shared_expert=extras)
    gemv = mt.moe_decode(x, ids, weights, gate_up, down, shared_expert=extras, expert_order=True)  # (the GEMVs)
    gu = x.float() @ deq(sh_gu).T  # rows [g0 | u0 | g1 | u1 ..]
    parts = gu.view(T, n, 2, I)
    h = (torch.nn.functional.silu(parts[:, :, 0]) * parts[:, :, 1]).reshape(T, n * I)
    shared_out = h @ deq(sh_down).T
    ref = reference.moe_reference(x, logits, gate_up, down, k, True, shared_out,
                                  torch.full((T, 1), float("inf"), device="cuda"))
    assert rel_err(out, ref) <= 1e-2
    assert rel_err(out, gemv) <= 1e-2


@gpu
def test_prefill_takes_the_kernel_up_to_its_rows_and_matches():
    g = torch.Generator().manual_seed(7)
    E, H, I, k, T = 8, 256, 128, 2, 96  # 24 rows an expert
    gate_up, down = stack(E, 2 * I, H, 64, g), stack(E, H, I, 64, g)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    logits = torch.randn(T, E, generator=g).cuda()
    ref = reference.moe_reference(x, logits, gate_up, down, k, True)
    ids, weights = mt.route(logits, k, True)
    out = mt.moe_prefill(x, ids, weights, gate_up, down)
    triton_out = mt.moe_prefill(x, ids, weights, gate_up, down, block_m=16)  # (a tile config: the Triton GEMMs)
    assert rel_err(out, ref) <= 1e-2 and rel_err(triton_out, ref) <= 1e-2


def test_applies_refuses_what_it_cannot_read():
    g = torch.Generator().manual_seed(1)
    gate_up = quantize(torch.randn(4, 128, 128, generator=g), 4, 64)
    down = quantize(torch.randn(4, 128, 64, generator=g), 4, 64)  # K = 64: not a multiple of 128
    x = torch.empty(1, 128, dtype=torch.bfloat16)
    assert not mma.applies(x, gate_up, down)  # (and on the CPU never)


@gpu
def test_a_quantized_model_decodes_a_batch_through_the_kernel_as_on_the_cpu(tmp_path, monkeypatch):
    """A 4-bit Qwen3-Next at shapes the kernel takes (hidden and expert intermediate 128), bf16 on the GPU: a batch
    of four decodes through the tensor-core kernel (the shared expert as a slot) and prefills through it too; its
    logits match the same checkpoint's on the CPU (fp32)."""
    from test_qwen3_next import qwen3_next, save

    import sluice
    from sluice.formats.convert import convert

    calls = []
    real = mma.grouped_gemm
    monkeypatch.setattr(mma, "grouped_gemm", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    over = dict(hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8,
                num_experts_per_tok=2, num_attention_heads=4, head_dim=32)
    hf = qwen3_next(seed=3, **over).to(torch.bfloat16)  # bf16 scales, as MLX stores a bf16 model's
    q = convert(save(hf, tmp_path / "hf"), tmp_path / "q4", bits=4, group_size=64, quiet=True)
    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(4))
    out = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        model = sluice.load(q, device=device, dtype=dtype)
        cache = model.new_cache(24, rows=4)
        model.forward(ids[:, :16], cache, 0, last_only=True)
        out[device] = torch.stack([model.forward(ids[:, t:t + 1], cache, t, last_only=True)[:, -1].float().cpu()
                                   for t in range(16, 24)])
    assert calls, "the GPU forward never took the CUDA kernel"
    assert rel_err(out["cuda"], out["cpu"]) < 3e-2


@gpu
@pytest.mark.parametrize("M,N,K,gs,dtype,tm,splits,mt", [
    (5, 192, 256, 64, torch.bfloat16, None, None, None), (16, 128, 512, 32, torch.float16, None, 2, None),
    (12, 64, 512, 64, torch.bfloat16, None, None, None),
    (40, 256, 384, 64, torch.bfloat16, None, None, None), (64, 128, 1024, 64, torch.bfloat16, 64, 4, 2),
    (100, 64, 256, 64, torch.bfloat16, 64, 1, 1), (33, 64, 128, 32, torch.bfloat16, 8, 1, 1),
    (24, 512, 1024, 64, torch.bfloat16, 32, 3, 4), (70, 256, 512, 64, torch.float16, 16, 4, 4),
    (9, 128, 768, 32, torch.bfloat16, 16, 6, 2), (16, 192, 512, 64, torch.bfloat16, None, None, None),
    (20, 320, 1024, 64, torch.bfloat16, 32, 4, 4), (40, 320, 1024, 64, torch.bfloat16, 16, 4, 2)])
def test_dense_matches_the_dequantized_product(M, N, K, gs, dtype, tm, splits, mt):
    """A dense projection: the rows in tiles (several where M is past the tile), each warp mt weight row sets (the
    last program's warps past N idle: 192 and 320 columns), K split (the last split sums the partials; run twice: the
    counters are set back for the next launch)."""
    from sluice.kernels.qmatmul import gemm

    g = torch.Generator().manual_seed(M + N)
    qt = stack(1, N, K, gs, g, dtype)
    qt = QuantizedTensor(qt.weight[0], qt.scales[0], qt.biases[0], 4, gs)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    assert mma.dense_applies(x, qt)
    ref = x.float() @ deq(qt).T
    for _ in range(2):
        assert rel_err(mma.dense(x, qt, tm, splits, mt), ref) <= 1e-2
    assert rel_err(gemm.qmatmul(x, qt), ref) <= 1e-2
    assert not mma._split_counters(x.device).any()


@gpu
def test_qmatmul_takes_the_dense_kernel_at_5_to_16_rows(monkeypatch):
    from sluice.kernels.qmatmul import gemm

    calls = []
    real = mma.dense
    monkeypatch.setattr(mma, "dense", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    qt = stack(1, 256, 512, 64, g)
    qt = QuantizedTensor(qt.weight[0], qt.scales[0], qt.biases[0], 4, 64)
    for M in (4, 5, 16, 17):
        x = torch.randn(M, 512, generator=g).bfloat16().cuda()
        assert rel_err(gemm.qmatmul(x, qt), x.float() @ deq(qt).T) <= 1e-2
    assert calls == [5, 16]


def test_dense_plan_refuses_columns_that_are_not_whole_warps():
    with pytest.raises(ValueError):
        mma.dense_plan(16, 64 * 3, 1024, 132, mt=8)  # a warp of 128 columns half past N
    assert mma.dense_plan(16, 12352, 2048, 132)[:5] == (16, 2, 1, 97, 3)  # Qwen3-Next's qkvz + ba: half a program idle


def test_wide_programs_only_where_their_shared_memory_fits():
    """8 warps for tiles of 16+ rows, unless a program's shared memory would pass the GPU's limit (99 KB on
    sm_86 / 89 / 120: SwiGLU's 32-row tiles need 112-120 KB at 8 warps), or the columns are not whole programs."""
    sm89, sm90 = 101376, 232448
    assert mma.warps_for(True, 16, 64, 1024, sm89) == mma.WIDE_WARPS
    assert mma.warps_for(True, 32, 64, 1024, sm89) == mma.WARPS
    assert mma.warps_for(True, 16, 32, 1024, sm89) == mma.WARPS  # 102,400 bytes
    assert mma.warps_for(False, 8, 64, 1024, sm89) == mma.WARPS  # 8-row tiles: 4 warps
    assert mma.warps_for(False, 16, 64, 64 * 3, sm89) == mma.WARPS  # 192 columns: not whole 8-warp programs
    assert mma.warps_for(True, 32, 32, 1024, sm90) == mma.WIDE_WARPS


@gpu
def test_options_for_the_gemvs_or_the_triton_gemms_keep_those_paths(monkeypatch):
    """moe_decode with GEMV options (rows, warps, expert order) and moe_prefill with tile configs run the paths
    asked for, not the CUDA kernel (a benchmark of those paths must measure them)."""
    calls = []
    real = mma.grouped_gemm
    monkeypatch.setattr(mma, "grouped_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(2)
    E, H, I, k, T = 16, 256, 128, 4, 16
    gate_up, down = stack(E, 2 * I, H, 64, g), stack(E, H, I, 64, g)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    ids, weights = mt.route(torch.randn(T, E, generator=g).cuda(), k, True)
    mt.moe_decode(x, ids, weights, gate_up, down, expert_order=False)
    mt.moe_decode(x, ids, weights, gate_up, down, num_warps=2)
    mt.moe_prefill(x, ids, weights, gate_up, down, block_m=16)
    assert not calls
    mt.moe_decode(x, ids, weights, gate_up, down)
    assert calls


@gpu
def test_dense_copies_rows_that_are_not_16_byte_aligned():
    g = torch.Generator().manual_seed(3)
    qt = stack(1, 128, 256, 64, g)
    qt = QuantizedTensor(qt.weight[0], qt.scales[0], qt.biases[0], 4, 64)
    flat = torch.randn(6 * 256 + 1, generator=g).bfloat16().cuda()
    x = flat[1:].view(6, 256)  # contiguous, 2 bytes past an aligned address
    assert x.is_contiguous() and x.data_ptr() % 16
    assert rel_err(mma.dense(x, qt), x.float() @ deq(qt).T) <= 1e-2
