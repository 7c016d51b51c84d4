"""The KV cache of a model's full-attention layers, by kind: the one place that knows every kind (`cache/kv.py`'s
dense cache, `cache/turboquant.py`'s TurboQuant cache), so neither of those imports the other."""

from __future__ import annotations

import torch

from sluice.cache import KV_CACHE_KINDS
from sluice.cache.kv import DenseKVCache, KVCache
from sluice.cache.turboquant import TurboQuantKVCache


def make_kv_cache(kind: str, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                  dtype: torch.dtype, device, window: int | None = None, page: int | None = None,
                  blocks: int | None = None) -> KVCache:
    """A KV cache of kind `kind`: paged (`page` positions a block, `blocks` of them) where the kind pages
    (`PAGEABLE`) and there is no window, else whole rows."""
    if kind == "dense":
        cls = DenseKVCache
    elif kind == "turboquant4":
        cls = TurboQuantKVCache
    else:
        raise ValueError(f"unknown KV cache kind {kind!r}; use one of {', '.join(KV_CACHE_KINDS)}")
    paged = {} if page is None or window is not None or not getattr(cls, "PAGEABLE", False) else \
        {"page": page, "blocks": blocks}
    return cls(num_layers, rows, num_kv_heads, head_dim, capacity, dtype, device, window, **paged)
