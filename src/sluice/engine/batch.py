"""What one forward's layers know about its tokens: positions, cache rows, and which tokens are whose.

Three kinds of forward:
- decode: one new token for each of B sequences, sequence b in cache row rows[b] at position positions[b]. These are
  device tensors, so one captured CUDA graph serves every mix of rows and positions; `visible` (an upper bound on
  the keys any query sees, sizing the attention splits) is fixed per graph: the cache capacity;
- flat (the engine's steps that prefill): ONE row of tokens [1, N]: first the next token of each of D decoding
  sequences, then the prompt chunks of S sequences back to back, then padding up to a captured size. The layers that
  mix tokens across positions (attention, Gated DeltaNet) take the decode tokens as a decode step (`decodes`) and
  each chunk as its own prefill (`parts`), or on a GPU all segments in one varlen launch (`cu_seqlens`,
  `seq_rows`); everything token-wise (projections, norms, and above all the MoE experts) runs once over all N;
- prefill: B sequences in the consecutive cache rows row0 .. row0+B-1, each with T new tokens at positions
  start .. start+T-1 (`Model.forward`, tests and tools; eager, host ints).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def on_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values as a tensor on `device` without waiting for it: a copy from pageable memory to a GPU first waits
    for everything queued there, which would undo the overlap of steps (`engine/engine.py`)."""
    t = values.to(dtype).contiguous() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class ForwardMeta:
    decode: bool
    positions: torch.Tensor  # [B, T] (device): each token's position
    rows: torch.Tensor  # decode: [B] each sequence's cache row; flat: [D + S] each segment's (device)
    visible: int  # the most keys any query of this forward sees
    row0: int = 0  # prefill: the first cache row (rows are row0 .. row0+B-1)
    start: int = 0  # prefill: the first new position
    rows_host: list[int] | None = None  # decode off the GPU: rows and positions as host ints (per-row CPU paths)
    positions_host: list[int] | None = None
    # flat: the decode tokens 0 .. D-1 (a decode step's meta, or None), the prefill chunks (first token, end, their
    # own prefill meta), the segments' token offsets [D + S + 1] (decode tokens are segments of one token), the
    # chunks' offsets [S + 1] relative to token D, the tokens whose logits come out (decodes, then each chunk's last)
    decodes: ForwardMeta | None = None
    parts: list[tuple[int, int, ForwardMeta]] | None = None
    cu_seqlens: torch.Tensor | None = None
    chunk_cu: torch.Tensor | None = None
    last: torch.Tensor | None = None
    tokens: int = 0  # flat: the real tokens (the rest of positions' row is padding)

    @classmethod
    def prefill(cls, row0: int, batch: int, start: int, tokens: int, device) -> ForwardMeta:
        positions = torch.arange(start, start + tokens).expand(batch, tokens)
        rows = torch.arange(row0, row0 + batch)
        return cls(False, on_device(positions, torch.int32, device), on_device(rows, torch.int32, device),
                   start + tokens, row0=row0, start=start)

    @classmethod
    def decode_host(cls, rows: list[int], positions: list[int], visible: int, device) -> ForwardMeta:
        """An eager decode step built from host lists (the CPU path, and eager CUDA steps)."""
        meta = cls(True, on_device(positions, torch.int32, device)[:, None], on_device(rows, torch.int32, device),
                   visible)
        meta.rows_host, meta.positions_host = list(rows), list(positions)
        return meta

    @property
    def flat(self) -> bool:
        return self.decodes is not None or self.parts is not None

    @property
    def decode_tokens(self) -> int:
        """Flat: how many of the first tokens are decode tokens (D)."""
        return 0 if self.decodes is None else self.decodes.batch

    @property
    def last_tokens(self):
        """What indexes each sequence's last token along T: the last column, or (flat) `last`."""
        return slice(-1, None) if self.last is None else self.last

    @property
    def batch(self) -> int:
        return self.rows.shape[0]

    @property
    def last_positions(self) -> torch.Tensor:
        """[B]: the position of each sequence's newest token (the decode kernels' positions)."""
        return self.positions[:, -1]

    def segments(self) -> list[tuple[int, int, int]]:
        """Flat: (first token, end, cache row) of every segment, the decode tokens' first (host ints)."""
        d = self.decodes
        out = [] if d is None else [(i, i + 1, r) for i, r in enumerate(d.rows_host)]
        return out + [(t0, t1, part.row0) for t0, t1, part in self.parts or ()]


class FlatBatch:
    """The host side of a flat forward: decode tokens (cache row, position) and prompt chunks (cache row, ids, first
    position), padded to n_pad tokens and r_pad logit rows, laid out as one int64 row that reaches the device in one
    copy:

        ids [n_pad] | positions [n_pad] | last [r_pad] | rows [D + S] | cu_seqlens [D + S + 1] | chunk_cu [S + 1]

    The first three sit at offsets fixed by (n_pad, r_pad): what a graph captured for that size reads."""

    def __init__(self, decodes: list[tuple[int, int]], chunks: list[tuple[int, list[int], int]], visible: int,
                 n_pad: int | None = None, r_pad: int | None = None):
        self.decodes, self.chunks, self.visible = decodes, chunks, visible
        self.D, self.S = len(decodes), len(chunks)
        self.n = self.D + sum(len(ids) for _, ids, _ in chunks)
        self.r = self.D + self.S
        self.n_pad, self.r_pad = n_pad or self.n, r_pad or self.r
        if self.n_pad < self.n or self.r_pad < self.r:
            raise ValueError(f"a flat batch of {self.n} tokens and {self.r} sequences does not fit {self.n_pad} "
                             f"tokens and {self.r_pad} rows")

    @staticmethod
    def size(n_pad: int, r_pad: int) -> int:
        """Elements of the row of any flat batch of up to n_pad tokens and r_pad sequences."""
        return 2 * n_pad + 4 * r_pad + 2

    def host(self, decode_ids: list[int] | None = None) -> torch.Tensor:
        """The int64 row (the decode tokens' ids from `decode_ids`; zeros when they come from the device)."""
        D, pad = self.D, self.n_pad - self.n
        ids = list(decode_ids) if decode_ids is not None else [0] * D
        positions = [p for _, p in self.decodes]
        rows = [r for r, _ in self.decodes]
        last, cu, chunk_cu = list(range(D)), list(range(D + 1)), [0]
        t = D
        for row, chunk, start in self.chunks:
            ids += chunk
            positions += range(start, start + len(chunk))
            rows.append(row)
            t += len(chunk)
            last.append(t - 1)
            cu.append(t)
            chunk_cu.append(t - D)
        return torch.tensor(ids + [0] * pad + positions + [0] * pad + last + [0] * (self.r_pad - self.r)
                            + rows + cu + chunk_cu, dtype=torch.int64)

    def place(self, buffer: torch.Tensor, decode_ids: list[int] | None = None) -> tuple[torch.Tensor, ForwardMeta]:
        """Copy the row to the start of `buffer` (int64, on the forward's device) without waiting for the device and
        return (ids [1, n_pad], meta) viewing it."""
        row = self.host(decode_ids)
        if buffer.is_cuda:
            row = row.pin_memory()
        buffer[:row.numel()].copy_(row, non_blocking=buffer.is_cuda)
        return self.view(buffer)

    def view(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ForwardMeta]:
        """(ids [1, n_pad], meta) as views of a buffer that holds the row."""
        D, S, n_pad, r_pad = self.D, self.S, self.n_pad, self.r_pad
        ids, positions = buffer[:n_pad][None], buffer[n_pad:2 * n_pad][None]
        o = 2 * n_pad
        last = buffer[o:o + r_pad]
        o += r_pad
        rows, cu, chunk_cu = (buffer[o:o + D + S], buffer[o + D + S:o + 2 * (D + S) + 1],
                              buffer[o + 2 * (D + S) + 1:o + 2 * (D + S) + S + 2])
        decodes = None
        if D:
            decodes = ForwardMeta(True, positions[0, :D, None], rows[:D], self.visible,
                                  rows_host=[r for r, _ in self.decodes], positions_host=[p for _, p in self.decodes])
        parts, t = [], D
        for i, (row, chunk, start) in enumerate(self.chunks):
            n = len(chunk)
            parts.append((t, t + n, ForwardMeta(False, positions[:, t:t + n], rows[D + i:D + i + 1], start + n,
                                                row0=row, start=start)))
            t += n
        return ids, ForwardMeta(False, positions, rows, self.visible, decodes=decodes, parts=parts, cu_seqlens=cu,
                                chunk_cu=chunk_cu, last=last, tokens=self.n)
