"""The GPU expert slot cache's bookkeeping (issue #27): `resolve` maps a step's routed expert ids to slots of a
per-layer cache, choosing least-recently-used victims for the misses, and `fill` copies the missed experts from
host memory into their slots. `reference.py` is the torch oracle (and the CPU path); `triton.py` runs both on the
device, so a decode step that streams experts stays inside its CUDA graph."""
