"""sluice: run gated Mixture-of-Experts language models from quantized weights."""

import os

# OpenMP worker threads spin while they wait for work (libgomp's default). Beside another busy process on the same
# cores they steal its time and it steals theirs: on 2 cores demo decode slowed several-fold (docs/perf-log.md).
# Waiting threads that sleep keep a shared machine usable. libgomp reads this once, when torch loads it (sluice's
# native kernels share torch's copy), so it is set here, before anything of sluice imports torch (the CLI, and any
# program that imports sluice first); the user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from sluice.errors import SluiceError  # noqa: E402

__version__ = "0.1.0"


def load(path=None, device=None, dtype=None, **options):
    """Load a model (GGUF file, HF or MLX directory; None = the demo model). Options: keep_quantized (default
    True), kv_cache ("dense" or "turboquant4"). See `sluice.engine.loader.load`."""
    from sluice.engine.loader import load as _load

    return _load(path, device=device, dtype=dtype, **options)


__all__ = ["SluiceError", "load", "__version__"]
