"""`sluice convert`: an HF checkpoint directory -> an MLX-format quantized directory that mlx-lm's loader
accepts (same tensor names, shapes, dtypes and config keys as mlx-lm's `convert`).

The architecture's `mlx_plan(hf_dir)` lists the post-sanitize parameters under their MLX names, each with a
loader (experts stacked, conv1d channels-last, norms with +1 baked, ...); each weight of a linear or embedding
layer (2-D, or 3-D stacked experts) whose input width is a multiple of the group size is quantized with the MLX
algorithm (`quant.affine.quantize`); router and shared-expert gates at 8 bits, as mlx-community does. The output is
written to a temporary directory beside the destination and renamed at the end, so an interrupted conversion
leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from sluice.errors import InvalidOptionError, ModelFileError

SHARD_BYTES = 4 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")


def stacked_experts(hf, layer: str, out: str, intermediate: int, experts: int) -> list:
    """An `mlx_plan`'s entries for one MoE layer's routed experts (HF names under `layer`, "...mlp."), stacked as
    mlx-lm writes them (`out` + "{gate,up,down}_proj.weight"): from transformers' fused gate_up_proj / down_proj
    tensors, or from one tensor per expert as the released checkpoints hold them."""
    I = intermediate
    if hf.has(layer + "experts.gate_up_proj"):
        return [(out + "gate_proj.weight", lambda: hf.tensor(layer + "experts.gate_up_proj")[:, :I]),
                (out + "up_proj.weight", lambda: hf.tensor(layer + "experts.gate_up_proj")[:, I:]),
                (out + "down_proj.weight", lambda: hf.tensor(layer + "experts.down_proj"))]
    return [(out + f"{proj}.weight", lambda proj=proj: torch.stack(
        [hf.tensor(f"{layer}experts.{e}.{proj}.weight") for e in range(experts)]))
        for proj in ("gate_proj", "up_proj", "down_proj")]


def _progress(i: int, n: int, quiet: bool):
    """A progress bar on a terminal; one line at the end otherwise (logs stay readable)."""
    if quiet or (not sys.stderr.isatty() and i != n):
        return
    width = 30
    done = width * i // max(n, 1)
    print(f"\rconverting [{'#' * done}{'.' * (width - done)}] {i}/{n} tensors", end="", file=sys.stderr, flush=True)
    if i == n:
        print(file=sys.stderr)


def convert(src: str | Path, dst: str | Path, bits: int = 4, group_size: int = 64, quiet: bool = False) -> Path:
    from safetensors.torch import save_file

    from sluice.formats.hf import HFDirectory
    from sluice.models import architecture_module
    from sluice.quant.affine import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, quantize

    if bits not in SUPPORTED_BITS:
        raise InvalidOptionError(f"--bits {bits}: use one of {', '.join(map(str, SUPPORTED_BITS))}.")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InvalidOptionError(f"--group-size {group_size}: use one of "
                                 f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}.")
    dst = Path(dst)
    if dst.exists():
        raise InvalidOptionError(f"{dst} already exists; choose a new output directory.")
    hf = HFDirectory(src)
    if hf.is_mlx:
        raise ModelFileError(f"{src} is already an MLX-format checkpoint.")
    arch = architecture_module(hf.config.get("model_type", "<missing model_type>"))
    if not hasattr(arch, "mlx_plan"):
        raise InvalidOptionError(f"converting {hf.config['model_type']} checkpoints is not supported yet.")

    plan = arch.mlx_plan(hf)
    qconfig = {"group_size": group_size, "bits": bits, "mode": "affine"}
    out: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = 0
    for i, (name, load) in enumerate(plan):
        t = load()
        module = name.removesuffix(".weight")
        override = arch.mlx_quant_override(module)  # False: left dense (a router mlx-lm does not quantize)
        b, gs = (override["bits"], override["group_size"]) if override else (bits, group_size)
        if (name.endswith(".weight") and t.dim() >= 2 and "conv1d" not in module and t.shape[-1] % gs == 0
                and override is not False):
            if override:
                qconfig[module] = dict(override)
            qt = quantize(t, bits=b, group_size=gs)
            parts = {name: qt.weight, module + ".scales": qt.scales, module + ".biases": qt.biases}
        else:
            parts = {name: t.contiguous()}
        for k, v in parts.items():
            out[k] = v
            size += v.nbytes
        if size >= SHARD_BYTES:
            shards.append(out)
            out, size = {}, 0
        _progress(i + 1, len(plan), quiet)
    shards.append(out)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "mlx"})
            weight_map.update({n: fname for n in shard})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": sum(v.nbytes for s in shards for v in s.values())},
                 "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        config = dict(hf.config)
        config["quantization"] = qconfig
        config["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in _TOKENIZER_FILES:
            if (hf.path / f).is_file():
                shutil.copy2(hf.path / f, tmp / f)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
