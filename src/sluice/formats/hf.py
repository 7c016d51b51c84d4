"""HF-style model directories: config.json + *.safetensors (dense, or MLX-quantized weight/scales/biases).

Tensors are read lazily from the memory-mapped safetensors files; nothing is loaded until asked for.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from sluice.errors import ModelFileError


def _read_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header so a damaged file fails here with a clear message."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelFileError(f"{path}: truncated safetensors file (no header). Download it again.")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise ModelFileError(f"{path}: corrupt safetensors header length. Download it again.")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(f"{path}: corrupt safetensors header ({e}). Download it again.") from e
    data_len = size - 8 - n
    for name, info in header.items():
        if name != "__metadata__" and info["data_offsets"][1] > data_len:
            raise ModelFileError(f"{path}: truncated safetensors file (tensor '{name}' ends past the end of "
                                 "the file). Download it again.")
    return header


class HFDirectory:
    format = "hf"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ModelFileError(f"{self.path}: no config.json. A model directory needs config.json, "
                                 "*.safetensors and tokenizer.json (as on the HF hub); or pass a .gguf file.")
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ModelFileError(f"{cfg}: not valid JSON ({e}).") from e
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{self.path}: no *.safetensors files. sluice reads safetensors only "
                                 "(never pickled .bin checkpoints); convert the weights to safetensors.")
        self._where: dict[str, Path] = {}
        formats = set()
        for f in files:
            header = _read_header(f)
            formats.add((header.get("__metadata__") or {}).get("format"))
            for name in header:
                if name != "__metadata__":
                    self._where[name] = f
        # mlx-lm writes {"format": "mlx"}; its checkpoints hold post-sanitize parameters (e.g. norms with +1 baked)
        self.is_mlx = "mlx" in formats or "quantization" in self.config
        self._handles = {}

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self):
        return self._where.keys()

    def _raw(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._where.get(name)
        if f is None:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing from the checkpoint.")
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return h.get_tensor(name)

    def quantization(self, module: str):
        """(bits, group_size) for an MLX-quantized module, from config.json's `quantization` block."""
        q = self.config.get("quantization") or self.config.get("quantization_config") or {}
        spec = q.get(module, q)
        if spec is False:
            return None
        return spec.get("bits"), spec.get("group_size")

    def tensor(self, name: str):
        """Dense tensor, or a QuantizedTensor when `name` is an MLX-quantized `<module>.weight`."""
        from sluice.quant.affine import QuantizedTensor

        module = name.removesuffix(".weight")
        if name.endswith(".weight") and self.has(module + ".scales"):
            w, s, b = self._raw(name), self._raw(module + ".scales"), self._raw(module + ".biases")
            if w.dtype != torch.uint32:
                raise ModelFileError(f"{self.path}: quantized tensor '{name}' should be uint32, found {w.dtype}.")
            bits, gs = self.quantization(module) or (None, None)
            # The shapes decide; config.json must agree with them.
            gs_shape = None
            for bits_try in (bits,) if bits else (4, 8, 2, 3, 6):
                in_features = w.shape[-1] * 32 // bits_try
                if in_features % s.shape[-1] == 0 and (gs is None or in_features // s.shape[-1] == gs):
                    bits, gs_shape = bits_try, in_features // s.shape[-1]
                    break
            if gs_shape is None:
                raise ModelFileError(f"{self.path}: '{name}' has shape {tuple(w.shape)} and scales "
                                     f"{tuple(s.shape)}, which disagree with config.json's quantization "
                                     f"(bits={bits}, group_size={gs}).")
            qt = QuantizedTensor(w, s, b, bits, gs_shape)
            qt.validate(name)
            return qt
        return self._raw(name)
