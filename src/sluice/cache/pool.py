"""All the caches of one model for a pool of sequences: the KV cache of the full-attention layers and, per Gated
DeltaNet layer, the causal-conv state (last W-1 inputs) and the fp32 recurrent state; one row of each per sequence.

The pool hands rows out, the lowest free first, and takes them back (`allocate`, `release`); a row's recurrent states
are zeroed when it is handed out, its KV positions are simply overwritten. A paged KV cache (`cache/blocks.py`) holds
a row's positions in blocks from one pool, handed out as the row needs them (`blocks.ensure`), shared between rows
that share a prefix, and given back with the row. The prefix cache (`engine/prefix.py`) copies
a row's first positions and its row state (`copy_prefix`, `row_state`, `copy_state`) into another row or snapshot
slots. One extra row past `rows` is scratch: the padding rows of a
captured decode graph write there, so they never touch a sequence's cache.
"""

from __future__ import annotations

import heapq

import torch

from sluice.attention import AttentionBackend


class RecurrentStates:
    """Per Gated DeltaNet layer: conv [rows, C, W-1] (model dtype) and recurrent [rows, Hv, K, V] (fp32), held as one
    tensor each across layers so that zeroing a row is one operation."""

    def __init__(self, num_layers: int, rows: int, conv_channels: int, conv_width: int, heads: int, key_dim: int,
                 value_dim: int, dtype: torch.dtype, device):
        self.conv = torch.zeros(num_layers, rows, conv_channels, conv_width - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, rows, heads, key_dim, value_dim, dtype=torch.float32, device=device)

    def reset(self, row: int) -> None:
        self.conv[:, row].zero_()
        self.recurrent[:, row].zero_()


class CachePool:
    """The caches of `rows` sequences: the attention layers' backend (`sluice/attention/`, chosen once here for all
    of them) with its KV cache (`kv`), and Gated DeltaNet's states."""

    def __init__(self, attention: AttentionBackend | None, states: RecurrentStates | None, rows: int):
        self.attention, self.states, self.rows = attention, states, rows
        self.kv = None if attention is None else attention.cache
        self.scratch_row = rows  # the caches hold rows + 1
        self._free = list(range(rows))  # a heap: the lowest free row goes first

    @property
    def capacity(self) -> int:
        """Positions one sequence may hold."""
        return self.kv.max_positions if self.kv is not None else 1 << 62

    @property
    def visible(self) -> int:
        """The most keys a decode query can see: what a captured graph sizes the attention splits for."""
        return self.kv.capacity if self.kv is not None else 1

    @property
    def static_flat(self) -> bool:
        """Whether flat forwards over this pool may take the static path (`engine/batch.py`): one CUDA graph each."""
        return self.attention is None or self.attention.static_flat

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def blocks(self):
        """The KV cache's `BlockTable` when it is paged (`cache/blocks.py`), else None."""
        return None if self.kv is None else self.kv.table

    def sync(self) -> None:
        """Before a step: the device copy of a paged cache's block table as the host's."""
        if self.blocks is not None:
            self.blocks.sync()

    # -- what the prefix cache (`engine/prefix.py`) copies ---------------------------------------------------------
    @property
    def resumable(self) -> bool:
        """Whether a sequence may start from another row's first positions (`copy_prefix`) and row state: not with a
        sliding window (its ring keeps only the newest positions)."""
        return self.kv is None or self.kv.supports_prefix

    def copy_prefix(self, src: int, dst: int, n: int, into: "CachePool | None" = None) -> None:
        """Row src's first n positions of KV into row dst (of `into`: another pool of the same model)."""
        if self.kv is not None and n:
            self.kv.copy_prefix(src, dst, n, (into or self).kv)

    def row_state(self) -> list[torch.Tensor]:
        """The tensors [layers, rows + 1, ...] of what a row holds besides its positions' keys and values: Gated
        DeltaNet's conv and recurrent states, a TurboQuant cache's exact ring of the newest positions. A sequence
        resumes at a position only with this state as it was there."""
        return ([] if self.states is None else [self.states.conv, self.states.recurrent]) + \
            ([] if self.kv is None else self.kv.row_state())

    def state_slots(self, n: int) -> list[torch.Tensor]:
        """n rows of `row_state` apart (snapshots)."""
        return [t.new_zeros((t.shape[0], n, *t.shape[2:])) for t in self.row_state()]

    def state_bytes(self) -> int:
        """Bytes of one row's `row_state`."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.row_state())

    def copy_state(self, src: int, dst: int, src_tensors=None, dst_tensors=None) -> None:
        """Row state src into dst: of this pool's rows, or from / into other tensors of the same kinds (snapshot
        slots, another pool's)."""
        for a, b in zip(src_tensors or self.row_state(), dst_tensors or self.row_state()):
            b[:, dst].copy_(a[:, src])

    def allocate(self) -> int:
        row = heapq.heappop(self._free)
        self.reset(row)
        return row

    def reset(self, row: int) -> None:
        """Zero a row's recurrent states: a sequence starts from nothing there."""
        if self.states is not None:
            self.states.reset(row)

    def release(self, row: int) -> None:
        self.drop_kv(row)
        heapq.heappush(self._free, row)

    def reserve(self, row: int, positions: int) -> bool:
        """Blocks of a paged KV cache for `row`'s positions 0..positions-1 (True at once when not paged): for
        tools and tests that drive a pool themselves; the engine reserves through `engine/prefix.py`."""
        return self.blocks is None or self.blocks.ensure(row, positions)

    def drop_kv(self, row: int) -> None:
        """A paged cache's blocks of `row` given back (shared ones stay with their other holders)."""
        if self.blocks is not None:
            self.blocks.release(row)

    def reset_scratch(self) -> None:
        """Zero the scratch row's recurrent states (padding rows of a graph start from them every step)."""
        if self.states is not None:
            self.states.reset(self.scratch_row)

    def mix(self, fn, meta, *args):
        """Run a sequence mixer: fn(meta, *args) -> a tensor, where fn reads and writes the per-sequence caches
        (attention over the KV cache, a Gated DeltaNet layer's states) and its shapes and launches depend on which
        sequences the step holds. The one place a forward touches per-sequence state: a graph of a flat forward is
        captured in pieces cut here (`engine/piecewise.py`), and fn runs eagerly between them."""
        return fn(meta, *args)

    def attend(self, layer: int, q, k, v, meta, scale: float, gate=None):
        """The attention backend's `forward` for attention layer `layer`, as a sequence mixer."""
        forward = self.attention.forward
        return self.mix(lambda m, q, k, v, g: forward(layer, q, k, v, m, scale, g), meta, q, k, v, gate)

    def append_buffers(self, layer: int, meta):
        return self.attention.append_buffers(layer, meta)

    def conv(self, layer: int) -> torch.Tensor:
        return self.states.conv[layer]

    def recurrent(self, layer: int) -> torch.Tensor:
        return self.states.recurrent[layer]

    def bytes_per_token(self) -> int:
        return self.kv.bytes_per_token() if self.kv is not None else 0

    def nbytes(self) -> int:
        """Bytes all the caches hold (exact on the "meta" device too, where a pool is sized before it is made)."""
        return sum(t.nbytes for part in (self.kv, self.states) if part is not None
                   for t in vars(part).values() if isinstance(t, torch.Tensor))
