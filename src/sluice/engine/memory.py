"""The memory plan: what a model's engine holds on its device, decided in one place (`ModelRunner.plan_pool`) from
one budget, and printed by `sluice info` and the server's `/health`.

The budget is `gpu_memory` (`sluice.load(gpu_memory=)`, `--gpu-memory`) where given, else the memory free when the
pool is planned. Out of it come, in order: the weights (resident ones and expert slots, decided at load by
`experts/placement.py`, which leaves `placement.CACHE_RESERVE` for what follows), a reserve for activations and CUDA
graphs (measured by a profile step, `ModelRunner.activation_reserve`), the cache rows (recurrent states and each row's
seen-token mask), then the KV cache: whole rows, or a paged cache's blocks (enough for every running row at its
longest, fewer where the budget is short, more for cached prefixes where memory is plentiful), and the prefix cache's
snapshot slots (a tenth of the KV bytes at most, `engine/prefix.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# what a GPU keeps for activations and CUDA graphs is measured (`ModelRunner.activation_reserve`: a profile step's
# peak, twice, and this margin for cuBLAS workspaces and the decode graphs); this, where the profile step fails (a fixed
# 1 GiB proved too small: docs/perf-log.md, 2026-11-28 paged KV runs 2 and 3).
GRAPH_MARGIN = 512 << 20
ACTIVATION_RESERVE = 4 << 30


@dataclass
class MemoryPlan:
    device: str
    budget: int | None  # bytes the user gave (gpu_memory), or None: what was free
    free: int  # bytes left within the budget (or free) once the caches are made
    weights: int | None  # bytes the device held before the caches (the weights, expert slots), on a GPU
    reserve: int  # bytes kept for activations and graphs
    running: int  # rows a step holds
    spare: int  # rows beyond them that only hold cached prefixes
    capacity: int  # positions a row may hold
    kv_kind: str
    page: int | None  # positions a KV block (None: whole rows)
    blocks: int | None  # KV blocks
    kv_positions: int  # positions the KV cache holds in all
    kv_bytes: int
    row_bytes: int  # the rows' recurrent states and seen-token masks, in all
    snapshot_bytes: int = 0  # the prefix cache's snapshot slots (set when its cache is made)

    @property
    def total(self) -> int:
        return (self.weights or 0) + self.reserve + self.kv_bytes + self.row_bytes + self.snapshot_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def lines(self) -> list[str]:
        g = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        kv = (f"{self.blocks} blocks of {self.page} positions ({self.kv_positions} positions)" if self.page
              else f"{self.running + self.spare} rows of {self.capacity} positions")
        budget = g(self.budget) if self.budget is not None else "the free memory"
        parts = [("weights and expert slots", self.weights, ""),
                 ("activations and graphs", self.reserve, " (reserved: a profile step's peak, twice, + a margin)"
                  if self.reserve else ""),
                 (f"KV cache ({self.kv_kind})", self.kv_bytes, f": {kv}"),
                 ("rows", self.row_bytes, f": {self.running} running + {self.spare} for cached prefixes, up to "
                  f"{self.capacity} positions each"),
                 ("prefix snapshots", self.snapshot_bytes, ""),
                 ("total", self.total, f" ({g(self.free)} left)")]
        return [f"device {self.device}, budget {budget}"] + \
            [f"  {name:26s}{g(n):>10s}{what}" for name, n, what in parts if n is not None]
