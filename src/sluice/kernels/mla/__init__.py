"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a cache of compressed latents: `reference.py`, the torch
oracle (both forms: K/V decompressed through kv_b_proj, and the absorbed one that attends the latents directly).
`triton.py`: the GPU decode kernel (absorbed, split-K over the context, the heads of a block sharing each latent
load)."""


def kernels() -> bool:
    """Whether DeepSeek models take the Triton kernels on a GPU (the MLA decode of `triton.py`, the router of
    `kernels/moe/group_route.py`): yes (checked on an H200: their tests, `benchmarks/mla_gpu.py`'s real shapes,
    tests/test_deepseek.py::test_on_a_gpu), unless SLUICE_DEEPSEEK_KERNELS=0 (the torch paths, to compare)."""
    import os

    return os.environ.get("SLUICE_DEEPSEEK_KERNELS") != "0"
