"""What one forward's layers know about its tokens: positions, cache rows, and which tokens are whose.

Three kinds of forward:
- decode: one new token for each of B sequences, sequence b in cache row rows[b] at position positions[b]. These are
  device tensors, so one captured CUDA graph serves every mix of rows and positions; `visible` (an upper bound on
  the keys any query sees, sizing the attention splits) is fixed per graph: the cache capacity;
- flat (the engine's steps that prefill): ONE row of tokens [1, N]: first the next token of each of D decoding
  sequences, then the prompt chunks of S sequences back to back, then padding up to a captured size. The layers that
  mix tokens across positions (attention, Gated DeltaNet) take the decode tokens as a decode step (`decodes`) and
  each chunk as its own prefill (`parts`), or on a GPU all segments in one varlen launch (`cu_seqlens`, `rows`);
  everything token-wise (projections, norms, and above all the MoE experts) runs once over all N. A `static` flat
  forward's mixers read only device tensors of shapes fixed by (N, rows): per token its cache row and, for a decode
  token, its recurrent-state row (`token_rows`, `decode_index`), every segment table padded to `rows` entries; so
  one CUDA graph holds the whole forward (its attention stores every token, then takes each as one decode query);
- prefill: B sequences in the consecutive cache rows row0 .. row0+B-1, each with T new tokens at positions
  start .. start+T-1 (`Model.forward`, tests and tools; eager, host ints).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    rows: torch.Tensor  # decode: [B] each sequence's cache row; flat: [R] each segment's (device)
    visible: int  # the most keys any query of this forward sees
    row0: int = 0  # prefill: the first cache row (rows are row0 .. row0+B-1)
    start: int = 0  # prefill: the first new position
    rows_host: list[int] | None = None  # decode off the GPU: rows and positions as host ints (per-row CPU paths)
    positions_host: list[int] | None = None
    # flat: the decode tokens 0 .. D-1 (a decode step's meta, or None), the prefill chunks (first token, end, their
    # own prefill meta), the segments' token offsets [R + 1] (decode tokens are segments of one token; R = r_pad,
    # the entries past D + S repeat the end: empty segments, whose `rows` are -1), the chunks' token offsets and
    # rows [R + 1], [R] (likewise), the tokens whose logits come out (decodes, then each chunk's last)
    decodes: ForwardMeta | None = None
    parts: list[tuple[int, int, ForwardMeta]] | None = None
    cu_seqlens: torch.Tensor | None = None
    chunk_cu: torch.Tensor | None = None
    chunk_rows: torch.Tensor | None = None
    last: torch.Tensor | None = None
    tokens: int = 0  # flat: the real tokens (the rest of positions' row is padding)
    static: bool = False  # flat: the mixers take the static path (above)
    token_rows: torch.Tensor | None = None  # flat [N]: each token's cache row (padding: the batch's pad_row)
    decode_index: torch.Tensor | None = None  # flat [N]: a decode token's row, -1 for the others
    _made: dict = field(default_factory=dict, repr=False)  # `once`

    def once(self, key, make):
        """make(), computed by the first layer that asks and shared by the rest of this forward (tables the mixers
        derive on the device from the meta's tensors). Every forward gets its own meta: a graph that captured the
        computation recomputes it on each replay."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

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
    def chunks(self) -> int:
        """Flat: how many prompt chunks follow the decode tokens (S)."""
        return len(self.parts or ())

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
    position), padded to n_pad tokens and r_pad sequences, laid out as one int64 row that reaches the device in one
    copy, every part at an offset fixed by (n_pad, r_pad), which is what a graph captured for that size reads:

        ids [n] | positions [n] | last [r] | token_rows [n] | decode_index [n] | rows [r] | cu_seqlens [r + 1]
        | chunk_rows [r] | chunk_cu [r + 1]          (n = n_pad, r = r_pad; `ForwardMeta` says what each holds)

    static: the forward's mixers take the static path (`ForwardMeta.static`); pad_row: the cache row the padding
    tokens' keys and values go to there (the pool's scratch row)."""

    def __init__(self, decodes: list[tuple[int, int]], chunks: list[tuple[int, list[int], int]], visible: int,
                 n_pad: int | None = None, r_pad: int | None = None, static: bool = False, pad_row: int = -1):
        self.decodes, self.chunks, self.visible = decodes, chunks, visible
        self.static, self.pad_row = static, pad_row
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
        return 4 * n_pad + 5 * r_pad + 2

    def host(self, decode_ids: list[int] | None = None) -> torch.Tensor:
        """The int64 row (the decode tokens' ids from `decode_ids`; zeros when they come from the device)."""
        D, n, pad, rpad = self.D, self.n, self.n_pad - self.n, self.r_pad - self.r
        ids = list(decode_ids) if decode_ids is not None else [0] * D
        positions = [p for _, p in self.decodes]
        rows = [r for r, _ in self.decodes]
        token_rows, decode_index = list(rows), list(rows)
        last, cu, chunk_rows, chunk_cu = list(range(D)), list(range(D + 1)), [], [D]
        t = D
        for row, chunk, start in self.chunks:
            ids += chunk
            positions += range(start, start + len(chunk))
            rows.append(row)
            chunk_rows.append(row)
            token_rows += [row] * len(chunk)
            t += len(chunk)
            last.append(t - 1)
            cu.append(t)
            chunk_cu.append(t)
        decode_index += [-1] * (n - D + pad)
        return torch.tensor(ids + [0] * pad + positions + [0] * pad + last + [0] * rpad
                            + token_rows + [self.pad_row] * pad + decode_index + rows + [-1] * rpad
                            + cu + [n] * rpad + chunk_rows + [-1] * (self.r_pad - self.S)
                            + chunk_cu + [n] * (self.r_pad - self.S), dtype=torch.int64)

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
        D, n, r = self.D, self.n_pad, self.r_pad
        parts = []
        o = 0
        for size in (n, n, r, n, n, r, r + 1, r, r + 1):
            parts.append(buffer[o:o + size])
            o += size
        ids, positions, last, token_rows, decode_index, rows, cu, chunk_rows, chunk_cu = parts
        ids, positions = ids[None], positions[None]
        decodes = None
        if D:
            decodes = ForwardMeta(True, positions[0, :D, None], rows[:D], self.visible,
                                  rows_host=[row for row, _ in self.decodes],
                                  positions_host=[p for _, p in self.decodes])
        chunk_metas, t = [], D
        for i, (row, chunk, start) in enumerate(self.chunks):
            k = len(chunk)
            chunk_metas.append((t, t + k, ForwardMeta(False, positions[:, t:t + k], rows[D + i:D + i + 1], start + k,
                                                      row0=row, start=start)))
            t += k
        return ids, ForwardMeta(False, positions, rows, self.visible, decodes=decodes, parts=chunk_metas,
                                cu_seqlens=cu, chunk_cu=chunk_cu, chunk_rows=chunk_rows, last=last, tokens=self.n,
                                static=self.static, token_rows=token_rows, decode_index=decode_index)
