"""What one forward's layers know about its tokens: positions, cache rows, prefill or decode.

Two kinds of forward:
- prefill: B sequences in the consecutive cache rows row0 .. row0+B-1, each with T new tokens at positions
  start .. start+T-1 (eager, so host ints are fine); or, packed, the chunks of several sequences one after
  another as one sequence of tokens (`packed`: `parts` says which tokens are whose, and the layers that mix
  tokens, attention and Gated DeltaNet, take each part as its own prefill; everything token-wise, the projections
  and above all the MoE experts, runs once over all of them);
- decode: one new token for each of B sequences, sequence b in cache row rows[b] at position positions[b]. These are
  device tensors, so one captured CUDA graph serves every mix of rows and positions; `visible` (an upper bound on
  the keys any query sees, sizing the attention splits) is fixed per graph: the cache capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def on_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values as a tensor on `device` without waiting for it: a copy from pageable memory to a GPU first waits
    for everything queued there, which would undo the overlap of decode steps (`engine/engine.py`)."""
    t = values.to(dtype).contiguous() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class ForwardMeta:
    decode: bool
    positions: torch.Tensor  # int32 [B, T] (device): each token's position
    rows: torch.Tensor  # int32 [B] (device): each sequence's cache row
    visible: int  # the most keys any query of this forward sees
    row0: int = 0  # prefill: the first cache row (rows are row0 .. row0+B-1)
    start: int = 0  # prefill: the first new position
    rows_host: list[int] | None = None  # decode off the GPU: rows and positions as host ints (per-row CPU paths)
    positions_host: list[int] | None = None
    parts: list[tuple[int, int, ForwardMeta]] | None = None  # packed prefill: (first token, end, its own prefill)

    @classmethod
    def prefill(cls, row0: int, batch: int, start: int, tokens: int, device) -> ForwardMeta:
        positions = torch.arange(start, start + tokens).expand(batch, tokens)
        rows = torch.arange(row0, row0 + batch)
        return cls(False, on_device(positions, torch.int32, device), on_device(rows, torch.int32, device),
                   start + tokens, row0=row0, start=start)

    @classmethod
    def packed(cls, chunks: list[tuple[int, int, int]], device) -> ForwardMeta:
        """Prefill chunks (cache row, first position, tokens) of several sequences packed as one row of tokens."""
        parts, t0 = [], 0
        for row, start, n in chunks:
            parts.append((t0, t0 + n, cls.prefill(row, 1, start, n, device)))
            t0 += n
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in chunks])[None]
        return cls(False, on_device(positions, torch.int32, device),
                   on_device([row for row, _, _ in chunks], torch.int32, device),
                   max(start + n for _, start, n in chunks), row0=chunks[0][0], start=chunks[0][1], parts=parts)

    @property
    def last_tokens(self):
        """What indexes each sequence's last token along T: the last column, or (packed) each part's last."""
        if self.parts is None:
            return slice(-1, None)
        return torch.tensor([t1 - 1 for _, t1, _ in self.parts], device=self.positions.device)

    @classmethod
    def decode_host(cls, rows: list[int], positions: list[int], visible: int, device) -> ForwardMeta:
        """An eager decode step built from host lists (the CPU path, and eager CUDA steps)."""
        meta = cls(True, on_device(positions, torch.int32, device)[:, None], on_device(rows, torch.int32, device),
                   visible)
        meta.rows_host, meta.positions_host = list(rows), list(positions)
        return meta

    @property
    def batch(self) -> int:
        return self.rows.shape[0]

    @property
    def last_positions(self) -> torch.Tensor:
        """int32 [B]: the position of each sequence's newest token (the decode kernels' positions)."""
        return self.positions[:, -1]
