"""A flat forward of a fixed number of tokens (`engine/batch.py`: decode tokens and prompt chunks of any sequences),
replayed from CUDA graphs: the engine's steps that prefill cost about their kernels' time, not an eager forward's
host time.

All of a flat forward can be captured but its sequence mixers (`CachePool.mix`: attention over the KV cache, Gated
DeltaNet's conv and rule over its states): which sequences a step holds, how long their chunks are and where they
start decide their launches. So the forward is captured in pieces cut at each mixer (vLLM's piecewise graphs): a
piece runs everything token-wise up to a mixer's inputs (projections, norms, RoPE, the MoE experts over all the
step's tokens); the mixer runs eagerly on them with this step's metadata, into a buffer the next piece reads; and so
on to the logits of the tokens the step samples. The pieces read the token ids, positions and logit rows from device
buffers the step fills first (at fixed offsets: `FlatBatch`), so one capture serves every mix of sequences whose
tokens fit.

A static flat forward (`engine/batch.py`: its mixers read only device tables of fixed shapes) is captured whole
instead (`WholeGraph`): one replay, no host work between the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.cache.pool import CachePool
from sluice.engine.batch import FlatBatch


@dataclass
class _Cut:
    """One mixer between two pieces: its function, its inputs (staged by the earlier piece), the buffer its output
    goes to (which the later piece reads)."""

    fn: object
    args: tuple
    out: torch.Tensor


class Staging:
    """The buffers the pieces hand the mixers their inputs in, and take their outputs from: per input slot (and the
    output, and the logits), one buffer sized for the most tokens a step holds, shared by every cut of every graph
    (a mixer consumes its inputs at once, and graphs never run at the same time). Captured graphs would otherwise
    each keep their own copy of every mixer's inputs alive."""

    def __init__(self, tokens_max: int):
        self.tokens_max = tokens_max
        self._buffers: dict[tuple, torch.Tensor] = {}

    def view(self, key, like: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
        """A contiguous tensor of like's shape and dtype in the buffer of `key` (sized for like's elements per token
        at the most tokens, when like holds `tokens` tokens; else for like)."""
        key = (key, like.dtype, like.device)
        need = like.numel() if tokens is None else -(-like.numel() // tokens) * self.tokens_max
        if key not in self._buffers or self._buffers[key].numel() < need:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("piecewise graph: a staging buffer grew while capturing")
            self._buffers[key] = torch.empty(need, dtype=like.dtype, device=like.device)
        return self._buffers[key][:like.numel()].view(like.shape)


class _Capturing:
    """The cache pool as the captured forward sees it: `mix` ends the piece being captured and begins the next."""

    def __init__(self, pool, graph: PiecewiseGraph):
        self._pool, self._graph = pool, graph

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def mix(self, fn, meta, *args):
        return self._graph._cut(fn, meta, args)

    attend = CachePool.attend  # through this object's `mix`


class PiecewiseGraph:
    """The flat forward of `batch.n_pad` tokens with `batch.r_pad` logit rows, captured in pieces on the flat batch
    `batch` (a step on the pool's scratch row), its inputs read from `buffer`, its cuts staged in `staging`."""

    def __init__(self, module, pool, batch: FlatBatch, buffer: torch.Tensor, staging: Staging, dtype: torch.dtype,
                 memory):
        self.module, self.pool, self.staging, self.dtype = module, pool, staging, dtype
        self.n_pad, self.r_pad = batch.n_pad, batch.r_pad
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[_Cut] = []
        self._memory = memory
        self._capture(batch, buffer)

    def run(self, meta) -> torch.Tensor:
        """Replay with the flat batch whose row is in the buffer (`FlatBatch.place`) and its meta: the logits
        [r_pad, vocab] (a shared buffer: read it before the next run of any graph)."""
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.cuts):
                c = self.cuts[i]
                c.out.copy_(c.fn(meta, *c.args))
        return self.logits

    def _capture(self, batch: FlatBatch, buffer: torch.Tensor) -> None:
        """Two eager forwards (every kernel compiled, every staging buffer made), then the pieces; the scratch row's
        states cleared after."""
        device = buffer.device
        ids, meta = batch.place(buffer)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                logits = self.module(ids, _Staged(self.pool, self), meta, self.dtype, last_only=True)[0]
            self.logits = self.staging.view("logits", logits)
            torch.cuda.synchronize(device)
            self._begin()
            self.logits.copy_(self.module(ids, _Capturing(self.pool, self), meta, self.dtype, last_only=True)[0])
            self.pieces[-1].capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        self.pool.reset_scratch()

    def _begin(self) -> None:
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(pool=self._memory)

    def _stage(self, args) -> tuple:
        """The mixer's inputs copied into their staging buffers (inside the piece being captured)."""
        return tuple(None if a is None else self.staging.view(("in", i), a, self.n_pad).copy_(a)
                     for i, a in enumerate(args))

    def _cut(self, fn, meta, args) -> torch.Tensor:
        """At a mixer while capturing: stage its inputs and end this piece, run the mixer once (its output sizes the
        next piece's input), begin the next piece reading the output's staging buffer."""
        args = self._stage(args)
        self.pieces[-1].capture_end()
        out = fn(meta, *args)
        self.cuts.append(_Cut(fn, args, self.staging.view("out", out, self.n_pad)))
        self._begin()
        return self.cuts[-1].out


class _Staged(_Capturing):
    """The eager warm-up forwards: mixers take staged inputs as the captured forward will (every buffer made before
    the capture, which may not allocate one)."""

    def mix(self, fn, meta, *args):
        out = fn(meta, *self._graph._stage(args))
        return self._graph.staging.view("out", out, self._graph.n_pad).copy_(out)


class WholeGraph:
    """A static flat forward of `batch.n_pad` tokens (`FlatBatch(static=True)`) captured whole, mixers included, on
    the flat batch `batch` (a step on the pool's scratch row), its inputs read from `buffer`."""

    def __init__(self, module, pool, batch: FlatBatch, buffer: torch.Tensor, staging: Staging, dtype: torch.dtype,
                 memory):
        if not batch.static:
            raise ValueError("a whole graph needs a static flat batch")
        self.n_pad, self.r_pad = batch.n_pad, batch.r_pad
        device = buffer.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # every kernel compiled, every lazily made buffer made
                ids, meta = batch.place(buffer)
                logits = module(ids, pool, meta, dtype, last_only=True)[0]
            self.logits = staging.view("logits", logits)  # shared by all graphs, as the pieces' are
            torch.cuda.synchronize(device)
            ids, meta = batch.place(buffer)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=memory)
            self.logits.copy_(module(ids, pool, meta, dtype, last_only=True)[0])
            self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        pool.reset_scratch()

    def run(self, meta) -> torch.Tensor:
        """Replay with the flat batch whose row is in the buffer: the logits [r_pad, vocab] (a shared buffer: read
        it before the next run of any graph)."""
        self.graph.replay()
        return self.logits
