"""Every engine setting in one object. A captured CUDA graph freezes them, so they are fixed per engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.errors import InvalidOptionError

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# token counts of the flat steps (decodes and prompt chunks together) replayed from graphs: about 1.25x apart, so a
# step computes at most a fifth more tokens than it holds
GRAPH_TOKEN_SIZES = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048,
                     2560, 3072, 4096)
# every chunk reads all the experts: bigger chunks prefill faster (docs/perf-log.md, 2026-11-25 "prefill chunks")
GPU_PREFILL_CHUNK = 4096
CPU_PREFILL_CHUNK = 512
# beside decodes: on a GPU 2,048 (a burst of prompts and a long prompt's first token in half the time of 512, decodes
# stalled 100 ms a step instead of 55 meanwhile: docs/perf-log.md, 2026-11-28 "step budget"); the CPU's whole step
GPU_DECODE_PREFILL_CHUNK, CPU_DECODE_PREFILL_CHUNK = 2048, 512
WHOLE_GRAPH_TOKENS = 256  # flat steps up to this many tokens: one whole graph each (`EngineConfig.whole_graph_tokens`)
GPU_KV_PAGE = 256  # positions a block of a paged KV cache holds on a GPU (`EngineConfig.kv_page`)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches.

    max_batch: the most sequences decoding at once (cache rows).
    max_seq_len: the most positions one sequence may hold (prompt + generated); None = the model's context window.
    prefill_chunk: prompt tokens a step prefills at most when no sequence decodes (bounds activation memory); None:
        4096 on a GPU, where every step reads most of the experts once and bigger steps prefill several times faster,
        512 on the CPU. A step's tokens (decodes and prompt chunks) never exceed it.
    decode_prefill_chunk: prompt tokens a step prefills at most while sequences decode in it: each step is one
        forward, so every decoding sequence waits for the whole of it (a long prompt joining then takes many short
        steps, not a few that stall every decode for a whole big chunk); at most prefill_chunk; None: 2048 on a GPU
        (measured against 512: first tokens of a burst and of a long prompt twice as soon, decode steps twice as long
        while a prompt joins), 512 on the CPU.
    graphs: on CUDA, replay each step from a CUDA graph: a decode step's captured per batch size, a step that
        prefills captured in pieces per padded token count (`engine/piecewise.py`) (False: eager, to compare).
    graph_batch_sizes: the batch sizes decode graphs are captured for; a batch runs in the smallest that holds it.
    graph_token_sizes: the token counts the graphs of steps that prefill are captured for; a step is padded to the
        smallest that holds it (on a GPU also when it runs eagerly: graphs change a step's speed, not its result).
    whole_graph_tokens: steps that prefill, padded to at most this many tokens, are captured whole, mixers included
        (`engine/batch.py`, static flat forwards: their attention takes each token as a decode query), where the
        KV cache allows it (dense, no sliding window); larger ones, and the rest, in pieces. 0: always in pieces.
    kv_cache: "dense" (K/V in the model's dtype) or "turboquant4".
    overlap: launch each step before the host reads the last one's tokens (`engine/engine.py`); None: on a
        GPU, where it hides the host's part of a step behind the device's.
    deterministic: batch-invariant outputs on a GPU, as a request alone gets them whatever shares its batch: every
        decode step runs at the pool's full batch (its largest graph), and each prompt prefills alone, never beside
        decodes or other prompts, in chunks that start at fixed positions; so every kernel sees the same shapes
        and a row's sums never depend on the others'. Costs throughput; needs graphs on a GPU. (On the CPU each row
        already runs alone.) Turns the prefix cache off.
    prefix_cache: a request whose ids begin with what an earlier one left in the cache starts from there
        (`engine/prefix.py`): a finished sequence's row stays as a cached prefix until a row is needed. Dense KV
        caches without a sliding window.
    kv_page: positions a block of a paged KV cache holds (`cache/blocks.py`: sequences take blocks as they grow, from
        one pool, and share a cached prefix's blocks); None: 256 on a GPU, rows of `max_seq_len` positions on the CPU
        (whose native attention kernel reads whole rows); 0: rows; else a multiple of 32 (of 128 on a GPU). Dense and
        TurboQuant KV caches without a sliding window.
    kv_blocks: the blocks of a paged KV cache; None: the memory plan decides (`engine/runner.py` `build_pool`:
        enough for `max_batch` sequences of the longest length, fewer where memory is short, more for cached
        prefixes where it is not).
    """

    max_batch: int = 64
    max_seq_len: int | None = None
    prefill_chunk: int | None = None
    decode_prefill_chunk: int | None = None
    graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = field(default=GRAPH_BATCH_SIZES)
    graph_token_sizes: tuple[int, ...] = field(default=GRAPH_TOKEN_SIZES)
    whole_graph_tokens: int = WHOLE_GRAPH_TOKENS
    kv_cache: str = "dense"
    overlap: bool | None = None
    deterministic: bool = False
    prefix_cache: bool = True
    kv_page: int | None = None
    kv_blocks: int | None = None

    def __post_init__(self):
        from sluice.cache import KV_CACHE_KINDS

        def positive(name, value):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name}={value!r}: use an integer >= 1.")

        positive("max_batch", self.max_batch)
        if self.prefill_chunk is not None:
            positive("prefill_chunk", self.prefill_chunk)
        if self.decode_prefill_chunk is not None:
            positive("decode_prefill_chunk", self.decode_prefill_chunk)
        if self.max_seq_len is not None:
            positive("max_seq_len", self.max_seq_len)
        if self.kv_blocks is not None:
            positive("kv_blocks", self.kv_blocks)
            if self.kv_blocks >= 1 << 31:  # block ids are int32 in the kernels' tables
                raise InvalidOptionError(f"kv_blocks={self.kv_blocks}: use fewer than 2**31.")
        if self.kv_page is not None and (not isinstance(self.kv_page, int) or isinstance(self.kv_page, bool)
                                         or self.kv_page < 0 or self.kv_page % 32):
            raise InvalidOptionError(f"kv_page={self.kv_page!r}: use 0 (rows) or a multiple of 32 (TurboQuant's "
                                     "blocks of codes; of 128 on a GPU: the attention kernels' tiles never straddle "
                                     "two blocks).")
        if not isinstance(self.whole_graph_tokens, int) or isinstance(self.whole_graph_tokens, bool) \
                or self.whole_graph_tokens < 0:
            raise InvalidOptionError(f"whole_graph_tokens={self.whole_graph_tokens!r}: use an integer >= 0.")
        for name in ("deterministic", "prefix_cache"):
            if getattr(self, name) not in (True, False):
                raise InvalidOptionError(f"{name}={getattr(self, name)!r}: use True or False.")
        if self.overlap not in (None, True, False):
            raise InvalidOptionError(f"overlap={self.overlap!r}: use True, False or None (on a GPU).")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise InvalidOptionError(f"kv_cache={self.kv_cache!r}: use one of {', '.join(KV_CACHE_KINDS)}.")
        for name in ("graph_batch_sizes", "graph_token_sizes"):
            sizes = tuple(getattr(self, name))
            if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
                raise InvalidOptionError(f"{name}={sizes!r}: use positive integers.")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))

    def prefill_tokens(self, device, decoding: bool = False) -> int:
        """The prompt tokens a step prefills at most on `device`: `prefill_chunk` (or its default there); decoding:
        for a step in which sequences decode, `decode_prefill_chunk` (or its default there) within that."""
        gpu = torch.device(device).type == "cuda"
        step = self.prefill_chunk if self.prefill_chunk is not None else GPU_PREFILL_CHUNK if gpu else CPU_PREFILL_CHUNK
        if not decoding:
            return step
        beside_decodes = self.decode_prefill_chunk if self.decode_prefill_chunk is not None else \
            GPU_DECODE_PREFILL_CHUNK if gpu else CPU_DECODE_PREFILL_CHUNK
        return min(step, beside_decodes)

    def page(self, device) -> int | None:
        """Positions a KV block holds on `device` (None: rows, not paged)."""
        if self.kv_page is not None:
            return self.kv_page or None
        return GPU_KV_PAGE if torch.device(device).type == "cuda" else None

    def graph_size(self, batch: int) -> int | None:
        """The captured batch size a batch of `batch` sequences replays in (None: larger than any)."""
        return next((s for s in self.graph_batch_sizes if s >= batch), None)

    def graph_tokens(self, tokens: int) -> int | None:
        """The captured token count a flat step of `tokens` tokens replays in (None: larger than any)."""
        return next((s for s in self.graph_token_sizes if s >= tokens), None)
