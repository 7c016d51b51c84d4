"""KV caches: the TurboQuant codec, the dense and TurboQuant caches (whole and sliding-window rings) against
explicit attention, chunked prefill against token-by-token decode, and a sliding-window model against HF."""

import pytest
import torch
import torch.nn.functional as F

from sluice.attention import make_attention
from sluice.attention.dense import DenseAttention
from sluice.attention.turboquant import TurboQuantAttention
from sluice.cache.kv import DenseKVCache
from sluice.cache.turboquant import TurboQuantKVCache
from sluice.kernels.turboquant import reference as tq


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------------- codec


def test_codebook_is_max_1960():
    c = tq.lloyd_max_gaussian()
    assert c[8:] == pytest.approx((0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0691, 2.7326), abs=2e-4)
    assert c[:8] == pytest.approx(tuple(-x for x in reversed(c[8:])), abs=1e-9)
    assert tq.lloyd_max_distortion() == pytest.approx(0.0095, abs=1e-5)
    # the levels in use: on an int8 grid (exact for the GPU kernel), each within half a step of Lloyd-Max's
    ints = tq.int_levels()
    assert ints[15] == 127 and ints == tuple(-x for x in reversed(ints))
    assert max(abs(a - b) for a, b in zip(tq.codebook().tolist(), c)) <= tq.LEVEL_STEP / 2 + 1e-7


def test_codec_mse_and_cosine_on_gaussian_vectors():
    """Per-coordinate MSE 0.0095 +- 0.0005 of |x|^2 / d and mean cosine >= 0.995 at d = 128 (TurboQuant's
    4-bit figure); the stored scale keeps every norm exactly."""
    x = torch.randn(20000, 128, generator=torch.Generator().manual_seed(0)) * torch.rand(20000, 1) * 10
    codes, scale = tq.quantize(x)
    assert codes.dtype == torch.uint8 and codes.shape == (20000, 64) and scale.shape == (20000,)
    xh = tq.dequantize(codes, scale)
    mse = float((((x - xh) ** 2).sum(-1) / (x ** 2).sum(-1)).mean())
    assert abs(mse - 0.0095) <= 0.0005
    assert float(F.cosine_similarity(x, xh, dim=-1).mean()) >= 0.995
    assert torch.allclose(xh.norm(dim=-1), x.norm(dim=-1), rtol=1e-4)


def test_rotation_is_orthonormal_and_packing_order():
    for d in (64, 128, 256):
        r = tq.rotation(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = tq.pack(codes)
    assert packed.tolist() == [[0xF1, 0x02]]  # byte i: coordinate i in the low nibble, i + d/2 in the high one
    assert torch.equal(tq.unpack(packed), codes)


def test_zero_vector_and_bad_head_dim():
    codes, scale = tq.quantize(torch.zeros(2, 64))
    assert torch.equal(tq.dequantize(codes, scale), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="power-of-two"):
        TurboQuantKVCache(1, 1, 1, 96, 16)


# ---------------------------------------------------------------------------------------------------- caches


def explicit_attention(q, k, v, qpos, kpos, scale, window=None):
    """q [B, Hq, T, D] at qpos, k, v [B, Hkv, S, D] at kpos: softmax over visible keys, fp64."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1).double(), v.repeat_interleave(G, 1).double()
    s = q.double() @ k.transpose(-1, -2) * scale
    vis = kpos[None, :] <= qpos[:, None]
    if window:
        vis &= kpos[None, :] > qpos[:, None] - window
    return torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v


def run_chunks(attention, q, k, v, chunks, scale):
    """Feed positions in chunks of the given sizes to a backend; the outputs concatenated."""
    outs, s = [], 0
    for n in chunks:
        outs.append(attention.prefill(0, 0, q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], s, scale))
        s += n
    return torch.cat(outs, 2)


def qkv(B=2, Hq=4, Hkv=2, T=40, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g) + 0.5,
            torch.randn(B, Hkv, T, D, generator=g))


@pytest.mark.parametrize("window", [None, 7, 16])
def test_dense_cache_whole_and_ring(window):
    q, k, v = qkv()
    T, scale = q.shape[2], 0.125
    ref = explicit_attention(q, k, v, torch.arange(T), torch.arange(T), scale, window)
    for chunks in ([T], [5, 11, 1, 1, 22], [1] * T):
        cache = DenseKVCache(1, 2, 2, 64, T, torch.float32, window=window)
        assert cache.capacity == (T if window is None else window)
        assert rel(run_chunks(DenseAttention(cache), q, k, v, chunks, scale), ref) < 1e-6


def turboquant_reference(q, k, v, scale, recent, window=None):
    """Key/value j for query p: exact if p - j < recent, else TurboQuant-dequantized."""
    kq, vq = tq.dequantize(*tq.quantize(k)), tq.dequantize(*tq.quantize(v))
    T = q.shape[2]
    G = q.shape[1] // k.shape[1]
    outs = []
    for p in range(T):
        ex = (p - torch.arange(T)) < recent
        kp = torch.where(ex[None, None, :, None], k, kq)
        vp = torch.where(ex[None, None, :, None], v, vq)
        outs.append(explicit_attention(q[:, :, p:p + 1], kp, vp, torch.tensor([p]), torch.arange(T), scale, window))
    assert G >= 1
    return torch.cat(outs, 2)


@pytest.mark.parametrize("window,recent", [(None, 8), (None, 1), (12, 8), (5, 8)])
def test_turboquant_cache_matches_its_definition_in_any_chunking(window, recent):
    q, k, v = qkv(T=30, seed=1)
    scale = 0.125
    ref = turboquant_reference(q, k, v, scale, recent, window)
    for chunks in ([30], [7, 1, 13, 9], [1] * 30):
        cache = TurboQuantKVCache(1, 2, 2, 64, 30, window=window, recent=recent)
        assert rel(run_chunks(TurboQuantAttention(cache), q, k, v, chunks, scale), ref) < 1e-5


def test_turboquant_cache_bytes_and_kinds():
    c = make_attention("turboquant4", 3, 1, 2, 128, 100, torch.bfloat16, "cpu").cache
    assert c.bytes_per_token() == 2 * 3 * 2 * (64 + 4)
    d = make_attention("dense", 3, 1, 2, 128, 100, torch.bfloat16, "cpu").cache
    assert d.bytes_per_token() / c.bytes_per_token() == pytest.approx(512 / 136)
    assert c.capacity == 128  # slots in blocks of 32 (the CUDA decode kernel reads 32 positions at a time)
    assert c.k_codes[0].numel() + 4 * c.k_scale[0].numel() == c.capacity * 2 * 68  # the layout holds what it says
    with pytest.raises(ValueError, match="unknown KV cache"):
        make_attention("fp8", 1, 1, 1, 64, 4, torch.float32, "cpu")


def test_cache_overflow_is_an_error():
    c = TurboQuantAttention(TurboQuantKVCache(1, 1, 1, 64, 4))
    q, k, v = qkv(B=1, Hq=1, Hkv=1, T=5)
    with pytest.raises(IndexError, match="holds 4"):
        c.prefill(0, 0, q, k, v, 0, 0.1)


# ---------------------------------------------------------------------------------------------------- models


def test_demo_model_with_turboquant_cache(demo_gguf_path):
    import sluice

    model = sluice.load(demo_gguf_path, kv_cache="turboquant4")
    ids = model.tokenizer.encode("The capital of France is")
    dense = sluice.load(demo_gguf_path)
    a, b = model.logits(ids)[0], dense.logits(ids)[0]
    assert torch.equal(a.argmax(-1), b.argmax(-1))  # 6 tokens: all within the exact recent window
    assert model.info()["kv_cache_bytes_per_token"] * 512 // 72 == dense.info()["kv_cache_bytes_per_token"]
    assert len(model.generate("Once upon a time", max_tokens=8, temperature=0)) > 0
    with pytest.raises(sluice.SluiceError, match="kv_cache"):
        sluice.load(demo_gguf_path, kv_cache="int3")


def test_mistral_sliding_window_matches_hf(tmp_path):
    """A Mistral model whose window (8) is shorter than the sequence: our ring cache against HF transformers."""
    from transformers import MistralConfig, MistralForCausalLM

    from helpers import save_hf_dir

    import sluice

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=8, rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = MistralForCausalLM(cfg).float().eval()
    path = save_hf_dir(hf, tmp_path / "mistral")
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    model = sluice.load(path, device="cpu")
    assert model.config.sliding_window == 8 and model.new_cache(30).kv.capacity == 8
    assert rel(model.logits(ids), ref) < 1e-4
    # decode steps through the ring equal the full forward
    cache = model.new_cache(30)
    model.forward(ids[:, :20], cache, 0, last_only=True)
    last = [model.forward(ids[:, t:t + 1], cache, t, last_only=True)[0, -1] for t in range(20, 30)]
    assert rel(torch.stack(last), ref[0, 20:]) < 1e-4
    tq_model = sluice.load(path, device="cpu", kv_cache="turboquant4")
    assert rel(tq_model.logits(ids), ref) < 1e-4  # window 8 < 64 recent positions: every visible one exact


def test_turboquant_needs_a_power_of_two_head_dim(tmp_path):
    import sluice
    from helpers import save_hf_dir, tiny_llama

    path = save_hf_dir(tiny_llama(seed=2, hidden_size=96, num_attention_heads=4, num_key_value_heads=2),
                       tmp_path / "d24")  # head dim 24
    with pytest.raises(sluice.SluiceError, match="power-of-two head dim"):
        sluice.load(path, device="cpu", kv_cache="turboquant4")
    assert sluice.load(path, device="cpu").generate([1, 2, 3], max_tokens=2, temperature=0) is not None


def test_turboquant_prefill_in_query_blocks():
    """A small score budget splits the chunk's queries into blocks: the same result."""
    q, k, v = qkv(T=30, seed=4)
    ref = turboquant_reference(q, k, v, 0.125, 8)
    cache = TurboQuantKVCache(1, 2, 2, 64, 30, recent=8)
    out = run_chunks(TurboQuantAttention(cache, score_elements=2 * 4 * 30 * 7), q, k, v, [30], 0.125)  # 7 queries

    assert rel(out, ref) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash path runs on a GPU")
def test_turboquant_prefill_on_the_gpu_matches_its_definition():
    """A bf16 GPU prefill (coded keys on SDPA's flash kernel, the exact ones banded, merged by log-sum-exps) at a
    real model's heads (16 query, 2 KV, head dim 256): chunks that start before, at and past the recent window."""
    q, k, v = qkv(B=1, Hq=16, Hkv=2, T=700, D=256, seed=5)
    ref = turboquant_reference(q, k, v, 0.0625, 64)
    for chunks in ([700], [40, 300, 1, 359]):
        cache = TurboQuantAttention(TurboQuantKVCache(1, 1, 2, 256, 700, torch.bfloat16, "cuda"))
        c = lambda x: x.to("cuda", torch.bfloat16)  # noqa: E731
        out = run_chunks(cache, c(q), c(k), c(v), chunks, 0.0625).float().cpu()
        assert rel(out, ref) < 2e-2


@pytest.mark.parametrize("window", [None, 20, 22])
def test_turboquant_cpu_decode_kernel_equals_the_torch_path(window):
    """One-token steps on the CPU go through the C kernel (codes read in place); the torch path gives the same."""
    from sluice.kernels.cpu import available

    if not available():
        pytest.skip("no C compiler: the torch path is the only one")
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, T = 2, 4, 2, 64, 100
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))
    outs = {}
    for native in (False, True):
        cache = TurboQuantAttention(TurboQuantKVCache(1, B, Hkv, D, T, torch.float32, "cpu", window=window,
                                                      recent=8))
        assert cache.cpu_kernel
        cache.cpu_kernel = native
        o = [cache.prefill(0, 0, q[:, :, :10], k[:, :, :10], v[:, :, :10], 0, 0.125)]
        for t in range(10, T):
            o.append(cache.prefill(0, 0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], t, 0.125))
        outs[native] = torch.cat(o, 2)
    assert float((outs[True] - outs[False]).norm() / outs[False].norm()) < 1e-5


@pytest.mark.parametrize("kind,static", [("dense", False), ("turboquant4", False), ("dense", True)])
def test_flat_step_attention_matches_each_sequence_alone(kind, static):
    """A flat step (`engine/batch.py`): the decode tokens through the split-K decode kernel (the GPU's path, here
    under the Triton interpreter), each prompt chunk as a prefill, or (static) every token stored and then taken as a
    decode query; each sequence's output as it gets alone (one row at a time, the torch paths), the padding's zero
    (static: its keys in the pad row only), the caches the same."""
    pytest.importorskip("triton")
    from sluice.engine.batch import FlatBatch

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: on a GPU, else the interpreter
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D = 4, 2, 32
    decodes, chunks = [(0, 20), (2, 7)], [(1, [0] * 6, 0), (3, [0] * 9, 30)]
    batch = FlatBatch(decodes, chunks, 64, n_pad=24, r_pad=6, static=static, pad_row=4)
    q, gate = torch.randn(1, Hq, 24, D, generator=g).to(dev), torch.randn(1, Hq, 24, D, generator=g).to(dev)
    k, v = torch.randn(1, Hkv, 24, D, generator=g).to(dev), torch.randn(1, Hkv, 24, D, generator=g).to(dev)
    out = {}
    for kernel in (True, False):
        attention = make_attention(kind, 1, 5, Hkv, D, 64, torch.float32, dev)
        cache = attention.cache
        for name, t in vars(cache).items():  # the same history in every row
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(4)).to(dev))
        attention.decode_kernel = kernel
        if kind == "turboquant4":  # the C decode kernel stands in for the torch path on the CPU: keep to torch
            attention.cpu_kernel = False
        batch.static = static and kernel
        _, meta = batch.place(torch.zeros(FlatBatch.size(24, 6), dtype=torch.long, device=dev))
        out[kernel] = attention.forward(0, q, k, v, meta, D ** -0.5, gate), cache
    (o, cache), (ref, ref_cache) = out[True], out[False]
    assert static or not o[:, :, batch.n:].any()
    tol = dict(atol=2e-3, rtol=1e-3) if dev == "cpu" else dict(atol=3e-2, rtol=3e-2)  # a GPU: bf16 tensor cores
    assert torch.allclose(o[:, :, :batch.n], ref[:, :, :batch.n], **tol)
    for name, t in vars(cache).items():
        if isinstance(t, torch.Tensor):
            other = vars(ref_cache)[name]
            assert torch.allclose(t[:, :4].float(), other[:, :4].float(), atol=1e-4), name
