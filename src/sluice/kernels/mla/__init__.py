"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a cache of compressed latents: `reference.py`, the torch
oracle (both forms: K/V decompressed through kv_b_proj, and the absorbed one that attends the latents directly).
`triton.py`: the GPU decode kernel (absorbed, split-K over the context, the heads of a block sharing each latent
load)."""
