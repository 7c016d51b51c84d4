"""`sluice.load`: open a checkpoint (GGUF file, HF or MLX directory), build the architecture's model on its device,
and wrap it in a `Model` with its engine settings."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sluice.config import EngineConfig
from sluice.engine.model import Model
from sluice.errors import InvalidOptionError, ModelFileError, UnsupportedError


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidOptionError(f"device={device!r} is not a device; use 'cpu' or 'cuda'.") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError("device 'cuda' was asked for but PyTorch sees no CUDA GPU; use --device cpu.")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"device {device!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise InvalidOptionError(f"dtype={dtype!r} is not supported; use float32, bfloat16 or float16.")


def open_source(path):
    """The checkpoint reader for a path: a GGUFFile or an HFDirectory."""
    from sluice.formats.gguf import GGUFFile
    from sluice.formats.hf import HFDirectory

    p = Path(path).expanduser()
    if p.is_dir():
        return HFDirectory(p)
    if p.is_file():
        return GGUFFile(p)
    raise ModelFileError(f"{p}: no such file or directory. Pass a .gguf file or a model directory "
                         "(config.json + *.safetensors + tokenizer.json), or omit --model for the demo model.")


class _LoadProgress:
    """Wraps a checkpoint reader: a progress line on a terminal while tensors are read (nothing otherwise)."""

    def __init__(self, src, total: int):
        self.src, self.total, self.done = src, max(total, 1), 0
        self.show = sys.stderr.isatty()

    def __getattr__(self, name):
        return getattr(self.src, name)

    def tensor(self, name: str):
        t = self.src.tensor(name)
        self.done += 1
        if self.show and (self.done % 16 == 0 or self.done >= self.total):
            print(f"\rloading {min(self.done, self.total)}/{self.total} tensors", end="", file=sys.stderr, flush=True)
        return t

    def finish(self):
        if self.show:
            print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)


ENGINE_OPTIONS = ("max_batch", "max_seq_len", "prefill_chunk", "graphs", "graph_batch_sizes")


def load(path=None, device=None, dtype=None, keep_quantized: bool = True, kv_cache: str = "dense",
         **options) -> Model:
    """Load a GGUF file or an HF/MLX directory (None: the demo model). Quantized weights stay packed unless
    keep_quantized=False, which dequantizes them once to `dtype` (more memory; dense matmuls). kv_cache:
    "dense" (K/V in `dtype`) or "turboquant4" (4-bit codes of the rotated vectors + a scale each: ~3.8x smaller).
    Engine options (`sluice.config.EngineConfig`): max_batch, max_seq_len, prefill_chunk, graphs,
    graph_batch_sizes."""
    from sluice.formats.tokenizer import Tokenizer
    from sluice.models import architecture_module

    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise InvalidOptionError(f"unknown load option(s): {', '.join(unknown)}.")
    config = EngineConfig(kv_cache=kv_cache, **options)
    if path is None:
        from sluice.formats.demo import demo_model_path

        path = demo_model_path()
    dev = _resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    src = open_source(path)
    if src.format == "gguf":
        arch = architecture_module(src.architecture)
        tokenizer = Tokenizer.from_gguf(src.fields)
        reader = _LoadProgress(src, len(src.tensors))
        module = arch.build_from_gguf(reader, dt)
    else:
        arch = architecture_module(src.config.get("model_type", "<missing model_type>"))
        tokenizer = Tokenizer.from_hf_dir(src.path)
        reader = _LoadProgress(src, sum(1 for n in src.names() if not n.endswith((".scales", ".biases"))))
        module = arch.build_from_hf(reader, dt)
    reader.finish()
    if not keep_quantized:
        for mod in module.modules():
            if hasattr(mod, "dequantize_"):
                mod.dequantize_(dt)
        if module.cfg.tie_word_embeddings:  # share the one dense copy again
            module.lm_head = module.embed.as_linear()
    try:  # a cache kind the model cannot use is the user's error, said before any generation
        module.check_cache_kind(kv_cache)
    except ValueError as e:
        raise UnsupportedError(f"kv_cache={kv_cache!r}: {e}; use kv_cache='dense'.") from e
    module.eval().to(dev)
    return Model(module, tokenizer, Path(path), src.format, dev, dt, config)
