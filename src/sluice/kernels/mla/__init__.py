"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a cache of compressed latents: `reference.py`, the torch
oracle (both forms: K/V decompressed through kv_b_proj, and the absorbed one that attends the latents directly).
The GPU kernels (absorbed decode, split-K over the context, all heads of a token sharing each latent load) come
later, beside it."""
