"""Whole models on a CUDA GPU (Triton kernels for quantized weights) against sluice's CPU path in fp32 (which
tests/test_llama.py and tests/test_qwen3_next.py hold to HF transformers; the GPU machine's own transformers
may be older). Skipped without a GPU; run on the GPU machine."""

import pytest
import torch

import sluice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_llama_and_qwen3_next_on_gpu(tmp_path, dtype, tol):
    from helpers import save_hf_dir, tiny_llama
    from test_qwen3_next import qwen3_next, save

    from sluice.formats.convert import convert

    ids = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(3))
    for name, hf in (("llama", tiny_llama(seed=1)), ("qwen3_next", qwen3_next(seed=2))):
        src = save_hf_dir(hf, tmp_path / name) if name == "llama" else save(hf, tmp_path / name)
        ref = sluice.load(src, device="cpu").logits(ids)
        gpu = sluice.load(src, device="cuda", dtype=dtype)
        assert rel_err(gpu.logits(ids), ref) < tol, name
        assert gpu.generate([5, 17, 42], max_tokens=8, temperature=0) is not None
    # a quantized checkpoint runs through the Triton kernels; compare with the same checkpoint on the CPU
    q = convert(tmp_path / "qwen3_next", tmp_path / "q4", bits=4, group_size=32, quiet=True)
    cpu_logits = sluice.load(q, device="cpu").logits(ids)
    gpu_logits = sluice.load(q, device="cuda", dtype=dtype).logits(ids)
    assert rel_err(gpu_logits, cpu_logits) < tol


@pytest.mark.parametrize("kind", ["dense", "turboquant4"])
def test_decode_steps_on_gpu_match_the_cpu_cache(tmp_path, kind):
    """Prefill 80 tokens, then decode 12 one at a time: on CUDA the steps go through the Triton decode kernels
    (and, for TurboQuant, quantize-on-append); the CPU runs the torch reference of the same cache kind. 80 > 64
    recent positions, so the TurboQuant steps read packed codes."""
    from helpers import save_hf_dir, tiny_llama
    from test_qwen3_next import qwen3_next, save

    ids = torch.randint(0, 300, (1, 92), generator=torch.Generator().manual_seed(4))
    for name, hf in (("llama", tiny_llama(seed=1)), ("qwen3_next", qwen3_next(seed=2))):
        src = save_hf_dir(hf, tmp_path / name) if name == "llama" else save(hf, tmp_path / name)
        steps = {}
        for device in ("cpu", "cuda"):
            model = sluice.load(src, device=device, dtype="float32", kv_cache=kind)
            cache = model.new_cache(92)
            model.forward(ids[:, :80], cache, 0, last_only=True)
            steps[device] = torch.stack([model.forward(ids[:, t:t + 1], cache, t, last_only=True)[0, -1].cpu()
                                         for t in range(80, 92)])
        # the GPU decode kernel multiplies on bf16 tensor cores
        assert rel_err(steps["cuda"], steps["cpu"]) < 2e-2, (name, kind)


def test_quantized_moe_decode_steps_on_gpu(tmp_path):
    """A 4-bit Qwen3-Next whose shared expert is stored like a routed one: its decode steps on CUDA take the
    multi-launch MoE decode (the shared expert as one more slot) and match the same checkpoint's steps on the
    CPU."""
    from test_qwen3_next import qwen3_next, save

    from sluice.formats.convert import convert

    q = convert(save(qwen3_next(seed=5, shared_expert_intermediate_size=32), tmp_path / "hf"), tmp_path / "q4",
                bits=4, group_size=32, quiet=True)
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(6))
    steps = {}
    for device in ("cpu", "cuda"):
        model = sluice.load(q, device=device, dtype="float32")
        cache = model.new_cache(30)
        model.forward(ids[:, :20], cache, 0, last_only=True)
        steps[device] = torch.stack([model.forward(ids[:, t:t + 1], cache, t, last_only=True)[0, -1].cpu()
                                     for t in range(20, 30)])
    assert rel_err(steps["cuda"], steps["cpu"]) < 2e-2


def test_fused_decode_gives_the_cpu_reference_tokens(tmp_path):
    """The GPU step's fused kernels (residual add + norm, q/k norm + RoPE, issue #28) against the unfused torch
    path on the CPU: a small random Qwen3-Next in fp32, greedy, through the engine (graphs on the GPU)."""
    from test_qwen3_next import qwen3_next, save

    src = save(qwen3_next(seed=5), tmp_path / "q")
    prompts = [[5, 17, 42, 7], [200, 3], [9, 9, 9, 1, 4]]
    kw = dict(max_tokens=16, temperature=0)
    cpu = sluice.load(src, device="cpu", max_batch=4).generate_batch(prompts, **kw)
    gpu = sluice.load(src, device="cuda", dtype="float32", max_batch=4).generate_batch(prompts, **kw)
    assert gpu == cpu
