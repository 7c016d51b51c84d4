"""RMSNorm variants (torch oracles). Llama: normalise in fp32, cast back, then scale by the weight."""

import torch


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalized(x, eps).to(x.dtype)


def rms_norm_fp32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next / Qwen3.5 RMSNorm: normalise and scale in fp32, then cast (`weight` is the effective scale,
    i.e. 1 + w for HF's zero-centred norms; MLX/GGUF checkpoints store 1 + w already)."""
    return (_normalized(x, eps) * weight.float()).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm (HF Qwen3NextRMSNormGated): w * rmsnorm(x), cast, then * silu(z) in fp32."""
    h = weight * _normalized(x, eps).to(x.dtype)
    return (h * torch.nn.functional.silu(z.float())).to(x.dtype)
