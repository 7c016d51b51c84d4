"""sluice: run gated Mixture-of-Experts language models from quantized weights."""

from sluice.errors import SluiceError

__version__ = "0.1.0"


def load(path=None, device=None, dtype=None, **options):
    """Load a model (GGUF file, HF or MLX directory; None = the demo model). Options: keep_quantized (default
    True), kv_cache ("dense" or "turboquant4"). See `sluice.engine.loader.load`."""
    from sluice.engine.loader import load as _load

    return _load(path, device=device, dtype=dtype, **options)


__all__ = ["SluiceError", "load", "__version__"]
