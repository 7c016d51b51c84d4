"""A prefill chunk of a fixed number of tokens, replayed from CUDA graphs: the chunks of a long prompt that joins
running decodes (`EngineConfig.decode_prefill_chunk`), whose eager launches cost more host time than their kernels
take on the GPU (docs/PERF.md, prefill).

All of a chunk's forward can be captured but its attention over the cache: the keys a chunk sees grow with its start,
and with them the attention's shapes. So the forward is captured in pieces cut at each attention call (vLLM's
piecewise graphs): a piece runs up to an attention layer's q, k, v; the cache's `attend` runs eagerly on them, for
this chunk's row and start, into a buffer the next piece reads; and so on to the logits. Everything else reads its
row and positions from device buffers the replay fills first, so one capture serves every sequence and start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.batch import ForwardMeta


@dataclass
class _Attention:
    """One eager attention call between two pieces: its inputs (the earlier piece's outputs), the later piece's
    input buffer."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    gate: torch.Tensor | None
    out: torch.Tensor


class _CutAtAttention:
    """The cache pool as the captured forward sees it: `attend` ends the piece being captured and starts the next."""

    def __init__(self, pool, graph: ChunkGraph):
        self._pool, self._graph = pool, graph

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def attend(self, layer, q, k, v, meta, scale, gate=None):
        return self._graph._cut(layer, q, k, v, meta, scale, gate)


class ChunkGraph:
    """The prefill forward of `tokens` prompt tokens of one sequence (its logits at the last one), captured."""

    def __init__(self, module, pool, tokens: int, dtype: torch.dtype, device: torch.device):
        self.module, self.pool, self.tokens, self.dtype, self.device = module, pool, tokens, dtype, device
        self.ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, tokens, dtype=torch.int32, device=device)
        self.rows = torch.zeros(1, dtype=torch.int32, device=device)
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_Attention] = []
        self._memory = torch.cuda.graph_pool_handle()  # the pieces' own: their buffers live from piece to piece
        self._capture()

    def run(self, row: int, start: int, ids: list[int]) -> torch.Tensor:
        """Prefill ids (`tokens` of them) at positions start.. of the sequence in cache row `row`: the logits
        [1, 1, vocab] of the last (the graph's buffer: read it before the next run)."""
        self._fill(row, start, ids)
        meta = self._meta(row, start)
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.calls):
                c = self.calls[i]
                c.out.copy_(self.pool.attend(c.layer, c.q, c.k, c.v, meta, c.scale, c.gate))
        return self.logits

    def _meta(self, row: int, start: int) -> ForwardMeta:
        return ForwardMeta(False, self.positions, self.rows, start + self.tokens, row0=row, start=start)

    def _fill(self, row: int, start: int, ids: list[int]) -> None:
        """The buffers the pieces read: ids, positions, row (pinned copies that do not wait for the GPU)."""
        host = torch.tensor([ids, list(range(start, start + self.tokens))], dtype=torch.long).pin_memory()
        self.ids.copy_(host[:1], non_blocking=True)
        self.positions.copy_(host[1:], non_blocking=True)
        self.rows.fill_(row)

    def _capture(self) -> None:
        """Two eager forwards on the pool's scratch row (every kernel compiled), then the pieces."""
        row = self.pool.scratch_row
        meta = self._meta(row, 0)
        self._fill(row, 0, [0] * self.tokens)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.module(self.ids, self.pool, meta, self.dtype, last_only=True)
            torch.cuda.synchronize(self.device)
            self._begin()
            self.logits = self.module(self.ids, _CutAtAttention(self.pool, self), meta, self.dtype, last_only=True)
            self.pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.pool.reset_scratch()

    def _begin(self) -> None:
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(pool=self._memory)

    def _cut(self, layer, q, k, v, meta, scale, gate) -> torch.Tensor:
        """At an attention call while capturing: end this piece, run the attention once (its output sizes the next
        piece's input buffer), begin the next piece reading that buffer."""
        self.pieces[-1].capture_end()
        out = self.pool.attend(layer, q, k, v, meta, scale, gate)
        self.calls.append(_Attention(layer, q, k, v, scale, gate, torch.empty_like(out)))
        self._begin()
        return self.calls[-1].out
