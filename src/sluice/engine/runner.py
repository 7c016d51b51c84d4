"""Runs the model's forwards for the engine over one pool of cache rows: ONE forward a step. A step of decodes only
replays a CUDA graph captured per batch size; a step that prefills is a flat forward (`engine/batch.py`: the decode
tokens, then the prompt chunks, in one row of tokens) replayed from a graph captured in pieces per padded token count
(`engine/piecewise.py`), or eager.

A flat step of few tokens (`EngineConfig.whole_graph_tokens`) is static where the pool allows it: its mixers read
only device tables (`engine/batch.py`), and its graph holds the whole forward (`WholeGraph`).

A captured decode step reads its token ids, positions and cache rows from persistent device buffers, so one graph
serves every mix of sequences and positions; a batch smaller than its graph fills the remaining rows with the pool's
scratch row (whose recurrent states the graph zeroes first, so the padding stays finite). A flat step's padding
tokens sit past every sequence's segment: the token-wise layers compute them, the mixers skip them. Nothing in a step
waits on the host; the host reads the sampled ids only.
"""

from __future__ import annotations

import logging
import os

import torch

from sluice.config import EngineConfig
from sluice.engine.batch import FlatBatch, ForwardMeta, on_device
from sluice.engine.memory import ACTIVATION_RESERVE, GRAPH_MARGIN, MemoryPlan
from sluice.engine.piecewise import PiecewiseGraph, Staging, WholeGraph
from sluice.errors import InvalidOptionError

log = logging.getLogger("sluice.engine")


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: free GPU memory and what PyTorch's allocator holds unused, or
    the host's MemAvailable."""
    if device.type == "cuda":
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: let the allocator decide


# A static flat step attends each prompt token as its own decode query, reading its row's keys once per token: the
# chunks' sum of length x end position key reads, mostly from L2 while a row's keys fit there. Past this many, a step
# runs in pieces, whose prefill attention reads each chunk's keys about once (two 512-token prompts: 2^19).
STATIC_KEY_READS = 1 << 20
# a pool on a GPU holds rows beyond its running batch for cached prefixes (`engine/prefix.py`): as many as this share
# of the memory left after the pool takes, at most this many per running row
SPARE_SHARE = 0.25
SPARE_PER_ROW = 4


class ModelRunner:
    def __init__(self, module, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.module, self.config, self.device, self.dtype = module, config, device, dtype
        self.vocab_size = module.cfg.vocab_size
        self.pool = None
        self.plan: MemoryPlan | None = None  # the pool's (`plan_pool`)
        self.batch = 0  # the most sequences a step holds (the pool's rows less its spare ones)
        self.seen = None  # bool [rows + 1, vocab]: the tokens each row has seen (repetition penalty)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._flat_graphs: dict[tuple[int, bool], PiecewiseGraph | WholeGraph] = {}  # by (tokens, static)
        self._graph_memory = None
        self._capturable = None
        self.last: tuple = ()  # what the last step ran (`step`), for a slow step's diagnosis (`describe_last`)
        self._reserve = None  # bytes of activations and graphs (`activation_reserve`), measured once
        self.captures = 0  # graphs captured so far

    @property
    def uses_graphs(self) -> bool:
        """Steps replay CUDA graphs: asked for, on a GPU, and every layer can be captured (a layer on a torch
        reference path that reads back to the host runs eagerly)."""
        if self._capturable is None:
            self._capturable = all(getattr(m, "capturable", True) for m in self.module.modules())
        return self.config.graphs and self.device.type == "cuda" and self._capturable

    # -- the cache pool -------------------------------------------------------------------------------------
    def plan_pool(self, rows: int, capacity: int, spare: int | None = 0, reclaim: int = 0) -> MemoryPlan:
        """How the caches of `rows` sequences running at once, of `capacity` positions each, would use the device
        (`engine/memory.py`), without making them: `spare` rows more that only hold cached prefixes
        (`engine/prefix.py`; None: on a GPU, as many as `SPARE_SHARE` of the memory left after the pool holds, at
        most `SPARE_PER_ROW` per running row, unless the model has a memory budget (`gpu_memory`) or streams
        experts; 0 elsewhere). Under a budget the caches take what it leaves after the weights and
        `ACTIVATION_RESERVE`.

        A paged KV cache (`EngineConfig.page`) holds `kv_blocks` blocks, or by default enough for `rows` sequences
        of `capacity` positions, fewer if memory is short (never fewer than one sequence of `capacity` needs), and
        with spare rows `SPARE_PER_ROW` times as many more for cached prefixes, within `SPARE_SHARE` of the memory
        left. InvalidOptionError when even that does not fit, or when `kv_blocks` holds fewer positions than one
        sequence of `capacity`. `reclaim`: bytes of a pool about to be dropped, counted as free.

        On a GPU the reserve for activations and graphs (`activation_reserve`) also takes one row's keys and values
        of one layer at `capacity` positions: a paged prefill chunk that resumes late gathers its row's blocks."""
        kind = self.config.kv_cache
        page = self.config.page(self.device)
        per_seq = -(-capacity // page) if page else 0  # blocks a sequence of `capacity` positions takes

        def size_of(n, blocks=None):
            pool = self.module.new_cache(n, capacity, self.dtype, "meta", kind, page=page,
                                         blocks=max(1, blocks if blocks is not None else n * per_seq))
            return pool, pool.nbytes() + (n + 1) * self.vocab_size

        probe, need = size_of(rows)
        paged = probe.blocks is not None
        gpu = self.device.type == "cuda"
        budget = getattr(self.module, "memory_budget", None)
        reclaim = reclaim if gpu else 0  # (on the CPU both pools would be touched at once: no OOM error, the killer)
        weights = torch.cuda.memory_allocated(self.device) - reclaim if gpu else None
        reserve = self.activation_reserve()
        if paged and gpu:
            reserve += probe.kv.bytes_per_token() // max(1, probe.kv.num_layers) * capacity
        free = self._agreed(available_memory(self.device), min) + reclaim - reserve
        if budget is not None and gpu:
            free = min(free, self._agreed(budget - weights - reserve, min))
        budgeted = budget is not None or self._streams_experts()
        blocks = self.config.kv_blocks if paged else None
        if blocks is not None and blocks < per_seq:
            raise InvalidOptionError(f"kv_blocks={blocks} holds {blocks * page} positions, fewer than one sequence of "
                                     f"{capacity} may need; give at least {per_seq} or a smaller max_seq_len.")
        if paged and blocks is None:
            per_block = size_of(rows, rows * per_seq + 1)[1] - need
            base = rows * per_seq
            if need > free:  # fewer blocks: short and long sequences share them
                blocks = max(per_seq, base - -(-(need - free) // per_block))
            elif spare is None and gpu and not budgeted:
                blocks = base + min(SPARE_PER_ROW * base, int(SPARE_SHARE / 2 * (free - need)) // per_block)
            else:
                blocks = base
        if paged:
            need = size_of(rows, blocks)[1]
        if spare is None:  # not under a memory budget the user set, nor beside streamed experts
            per_row = size_of(rows + 1, blocks)[1] - need
            share = SPARE_SHARE / 2 if paged else SPARE_SHARE
            spare = 0 if not gpu or budgeted or need > free else \
                min(SPARE_PER_ROW * rows, int(share * (free - need)) // max(1, per_row))
        pool, need = size_of(rows + spare, blocks)
        if need > free:  # sized before it is made: no giant allocation, no OOM killer
            raise InvalidOptionError(
                f"the caches of {rows + spare} sequence(s) of {capacity} positions need {need / 2**30:.2f} GiB "
                f"({kind} KV), but {self.device} has {max(0, free) / 2**30:.2f} GiB"
                f"{' for them within the gpu_memory budget' if budget is not None and gpu else ' free'}; lower "
                "max_batch or "
                f"max_seq_len{' or use --kv-cache turboquant' if kind == 'dense' else ''}.")
        kv = pool.kv.nbytes() if pool.kv is not None else 0
        free -= need
        return MemoryPlan(str(self.device), budget, free, weights, reserve, rows, spare, capacity, kind,
                          page if paged else None, blocks, (blocks * page) if paged else (rows + spare) * capacity,
                          kv, need - kv)

    def _agreed(self, value: int, op) -> int:
        """value as every rank of a tensor-parallel model takes it (op: min or max over the ranks), so that their
        pools, and with them every scheduling choice, come out the same; value itself in one process."""
        tp = getattr(self.module, "tp", None)
        return value if tp is None else tp.agree(value, op, self.device)

    def activation_reserve(self) -> int:
        """Bytes a GPU keeps beside the weights and the caches for the steps' activations and CUDA graphs, measured
        once (vLLM's profile run): `profile_step`'s peak allocation over what was allocated before, twice (the
        piecewise graphs' private pool holds about as much again), plus `GRAPH_MARGIN`. 0 off a GPU;
        `ACTIVATION_RESERVE` with streamed experts (a step of that many tokens stages whole layers of them, from disk
        perhaps) or if the step fails (logged)."""
        if self.device.type != "cuda":
            return 0
        if self._reserve is None and self._streams_experts():
            self._reserve = ACTIVATION_RESERVE
        if self._reserve is None:
            try:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
                self.profile_step()
                torch.cuda.synchronize(self.device)
                reserve = 2 * (torch.cuda.max_memory_allocated(self.device) - base) + GRAPH_MARGIN
            except Exception as error:  # the plan goes on with the fixed reserve; a broken device fails later anyway
                if getattr(self.module, "tp", None) is not None:
                    raise  # a rank whose collectives stopped midway cannot go on with the others
                log.warning("the memory plan's profile step failed (%s: %s); reserving %.1f GiB for activations",
                            type(error).__name__, error, ACTIVATION_RESERVE / 2**30)
                reserve = ACTIVATION_RESERVE
            self._reserve = self._agreed(reserve, max)  # (tensor-parallel: every rank's pool the same)
        return self._reserve

    @torch.inference_mode()
    def profile_step(self) -> None:
        """One eager flat step of the most prompt tokens a step holds, on a pool of one row made for it and dropped
        after (the pool in use, if any, left as it was)."""
        tokens = self.config.prefill_tokens(self.device)
        page = self.config.page(self.device)
        capacity = -(-tokens // page) * page if page else tokens
        pool = self.module.new_cache(1, capacity, self.dtype, self.device, self.config.kv_cache, page=page,
                                     blocks=capacity // page if page else None)
        row = pool.allocate()
        pool.reserve(row, capacity)
        pool.sync()
        batch = FlatBatch([], [(row, [0] * tokens, 0)], pool.visible, tokens, 1, pad_row=pool.scratch_row)
        ids, meta = batch.place(torch.zeros(FlatBatch.size(tokens, 1), dtype=torch.long, device=self.device))
        self.module(ids, pool, meta, self.dtype, last_only=True)

    def build_pool(self, rows: int, capacity: int, spare: int | None = 0, reclaim: int = 0) -> None:
        """A new pool as `plan_pool` plans it (`self.plan`); the old pool, and its graphs, are dropped first."""
        # (no torch.cuda.empty_cache(): it frees the cuBLAS workspaces that graphs captured anywhere in the process,
        # this engine's or another's over the same weights, still write to)
        self.pool = self.seen = None
        self._graphs.clear()
        self._flat_graphs.clear()
        # and a new graph memory pool: PyTorch refuses to capture into one whose every graph is gone (an internal
        # assert in the caching allocator; a DeepSeek engine whose pool grew hit it on its next capture)
        self._graph_memory = None
        plan = self.plan_pool(rows, capacity, spare, reclaim)
        rows = plan.running + plan.spare
        try:
            self.pool = self.module.new_cache(rows, capacity, self.dtype, self.device, plan.kv_kind, page=plan.page,
                                              blocks=plan.blocks)
            self.seen = torch.zeros(rows + 1, self.vocab_size, dtype=torch.bool, device=self.device)
        except torch.OutOfMemoryError as e:
            self.pool = self.seen = None
            raise InvalidOptionError(
                f"the caches of {rows} sequences of {capacity} positions do not fit in {self.device} memory; "
                "lower max_batch or max_seq_len.") from e
        self.plan = plan
        self.batch = plan.running  # the most sequences a step holds
        batch = self.batch
        size = max(batch, self.config.graph_size(batch) or batch)
        # a decode graph's inputs, one host-to-device copy a step: token ids, positions, cache rows
        self._inputs = torch.zeros(3, size, dtype=torch.long, device=self.device)
        # a flat step's: `FlatBatch`'s row, for the most tokens a step holds and a logit row per sequence
        self._rows_max = size
        self._tokens_max = max(self.config.prefill_tokens(self.device), max(self.config.graph_token_sizes)) + batch
        self._flat = torch.zeros(FlatBatch.size(self._tokens_max, size), dtype=torch.long, device=self.device)
        self._staging = Staging(max(self.config.graph_token_sizes))

    # -- forwards -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, decodes: list[tuple[int, int]], tokens, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """One step in one forward: the decode tokens (cache row, position) with their ids `tokens` (host ints, or
        int64 [D] on the device: the last step's sampled ids, which need not have reached the host), and the prompt
        chunks (cache row, token ids, first position). Returns the logits [D + chunks, vocab] fp32 of each decode
        token and each chunk's last token (with graphs, a view of the graph's output: read it before the next step)."""
        self.pool.sync()
        if not chunks:
            return self.decode([r for r, _ in decodes], [p for _, p in decodes], tokens)
        D, R = len(decodes), len(decodes) + len(chunks)
        n = D + sum(len(ids) for _, ids, _ in chunks)
        n_pad = self._flat_size(n, R)
        static = self._static(n_pad, chunks)
        batch = FlatBatch(decodes, chunks, self.pool.visible, n_pad, self._rows_max if n_pad else None,
                          static=static, pad_row=self.pool.scratch_row)
        # the graph first: a capture runs on a batch of its own in the same input buffer
        graph = None
        if n_pad is not None and self.uses_graphs and not self._streams_experts():
            graph = self._flat_graph(n_pad, static)
        self.last = ("flat", n, D, len(chunks), n_pad, "eager" if graph is None else "whole graph" if static
                     else "graph in pieces")
        on_host = D and not isinstance(tokens, torch.Tensor)
        ids, meta = batch.place(self._flat, list(tokens) if on_host else None)
        if D and not on_host:
            ids[0, :D].copy_(tokens)
        if graph is None:
            return self.module(ids, self.pool, meta, self.dtype, last_only=True)[0][:R]
        return graph.run(meta)[:R]

    def prefill(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Prompt chunks (cache row, token ids, first position) of one or several sequences in one forward: the
        logits [chunks, vocab] of each chunk's last token."""
        return self.step([], [], chunks)

    @torch.inference_mode()
    def decode(self, rows: list[int], positions: list[int], tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """One decode step: token tokens[b] at positions[b] of the sequence in rows[b]; logits [B, vocab] fp32 (with
        graphs, a view of the graph's output: read it before the next step). tokens: host ints, or int64 [B] on the
        device (the last step's sampled ids, which need not have reached the host)."""
        n = len(rows)
        self.pool.sync()
        size = self._graph_size(n)
        self.last = ("decode", n, size)
        if size is None:
            meta = ForwardMeta.decode_host(rows, positions, self.pool.visible, self.device)
            ids = tokens if isinstance(tokens, torch.Tensor) else on_device(tokens, torch.long, self.device)
            return self.module(ids[:, None], self.pool, meta, self.dtype, last_only=True)[:, 0]
        graph, logits = self._graph(size)
        tokens_on_device = isinstance(tokens, torch.Tensor)
        # pinned and not blocking: a pageable copy would wait for the step before to end
        inputs = self._padded([[0] * n if tokens_on_device else tokens, positions, rows], size).pin_memory()
        self._inputs[:, :size].copy_(inputs, non_blocking=True)
        if tokens_on_device:
            self._inputs[0, :n].copy_(tokens)
        graph.replay()
        return logits[:n]

    def describe_last(self) -> str:
        """What the last step ran, in words."""
        if not self.last:
            return "nothing yet"
        if self.last[0] == "decode":
            _, n, size = self.last
            return f"decode {n} tokens, {'eager' if size is None else f'graph of {size}'}"
        _, n, D, S, n_pad, path = self.last
        return f"flat {n} tokens ({D} decodes, {S} chunks) padded to {n_pad}, {path}"

    def _streams_experts(self) -> bool:
        return getattr(self.module, "placement", None) is not None

    def _flat_size(self, tokens: int, rows: int) -> int | None:
        """The tokens a flat step of `tokens` tokens and `rows` sequences is padded to on a GPU: the graph size that
        holds it, whether it replays that graph or runs eagerly (no graphs, or streamed experts, whose many-token
        steps stage whole layers), so that graphs change a step's speed, never its result; None: unpadded (the CPU,
        or larger than any graph)."""
        if self.device.type != "cuda" or rows > self._rows_max:
            return None
        return self.config.graph_tokens(tokens)

    def _static(self, n_pad: int | None, chunks=()) -> bool:
        """Whether a flat step padded to n_pad tokens, with these prompt chunks (cache row, ids, first position), is
        static (`engine/batch.py`): captured whole. Its chunks' attention must be cheap that way
        (`STATIC_KEY_READS`)."""
        return (n_pad is not None and n_pad <= self.config.whole_graph_tokens and self.pool.static_flat
                and sum(len(ids) * (start + len(ids)) for _, ids, start in chunks) <= STATIC_KEY_READS)

    def _flat_graph(self, n_pad: int, static: bool) -> PiecewiseGraph | WholeGraph:
        """The flat step of n_pad tokens, captured on first use (on a flat batch of the scratch row): whole when it
        is static, else in pieces."""
        if (n_pad, static) not in self._flat_graphs:
            if self._graph_memory is None:
                self._graph_memory = torch.cuda.graph_pool_handle()
            batch = self._scratch_batch(n_pad, static)
            if static:
                graph = WholeGraph(self.module, self.pool, batch, self._flat, self._staging, self.dtype,
                                   self._graph_memory)
            else:
                graph = PiecewiseGraph(self.module, self.pool, batch, self._flat, self._staging, self.dtype,
                                       self._graph_memory)
            self._flat_graphs[n_pad, static] = graph
            self.captures += 1
        return self._flat_graphs[n_pad, static]

    def _scratch_batch(self, n_pad: int, static: bool) -> FlatBatch:
        """A flat batch of n_pad tokens on the scratch row that runs every kind of mixer: one decode token, then
        prompt chunks of at most the pool's capacity."""
        row, cap = self.pool.scratch_row, min(self.pool.capacity, n_pad)
        chunks, left = [], n_pad - 1
        while left and len(chunks) < self._rows_max - 1:
            n = min(left, cap)
            chunks.append((row, [0] * n, 0))
            left -= n
        return FlatBatch([(row, 0)], chunks, self.pool.visible, n_pad, self._rows_max, static=static, pad_row=row)

    def _graph_size(self, n: int) -> int | None:
        """The captured batch size a decode step of n sequences replays in; None: run it eagerly (no graphs, larger
        than any graph, or, with streamed experts, more tokens than a layer's slots hold, which stages whole layers, or
        any step whose misses the host must read from disk)."""
        size = self.config.graph_size(n) if self.uses_graphs else None
        if size is not None and self.config.deterministic:  # every decode step at the pool's batch: one shape
            size = self.config.graph_size(self.batch) or size
        placement = getattr(self.module, "placement", None)
        if size is not None and placement is not None and size > placement.max_graph_tokens:
            return None
        return size

    def _padded(self, inputs: list[list[int]], size: int) -> torch.Tensor:
        """[3, size] ids, positions, rows; the rows past the batch point at the scratch row, position 0."""
        pad = size - len(inputs[0])
        return torch.tensor([inputs[0] + [0] * pad, inputs[1] + [0] * pad, inputs[2] + [self.pool.scratch_row] * pad])

    def _graph_step(self, size: int) -> torch.Tensor:
        ids, positions, rows = self._inputs[:, :size]
        meta = ForwardMeta(True, positions[:, None], rows, self.pool.visible)
        if size > 1:  # a batch of one fills its graph: no padding rows, no scratch states to clear
            self.pool.reset_scratch()
        return self.module(ids[:, None], self.pool, meta, self.dtype, last_only=True)[:, 0]

    def _graph(self, size: int):
        """The decode graph of `size` rows, captured on first use (after an eager warm-up on the scratch row that
        compiles every kernel). Captured by hand: `torch.cuda.graph` empties the allocator's cache first, which frees
        the cuBLAS workspaces other graphs replay into."""
        if size not in self._graphs:
            self._inputs[:, :size].copy_(self._padded([[], [], []], size))
            if self._graph_memory is None:
                self._graph_memory = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._graph_step(size)
                torch.cuda.synchronize(self.device)
                graph.capture_begin(pool=self._graph_memory)
                logits = self._graph_step(size)
                graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._graphs[size] = (graph, logits)
            self.captures += 1
        return self._graphs[size]

    @torch.inference_mode()
    def capture(self, sizes=None, tokens=None) -> None:
        """Capture now the decode graphs of these batch sizes and the flat graphs of these token counts (None: all
        that a step of this pool can use), largest first: the smaller reuse their memory."""
        if not self.uses_graphs:
            return
        rows = self.batch
        if sizes is None:
            sizes = [s for s in self.config.graph_batch_sizes if s < rows] + [rows]
        for size in sorted({self._graph_size(s) for s in sizes} - {None}, reverse=True):
            self._graph(size)
        if self._streams_experts():
            return
        if tokens is None:
            most = self.config.prefill_tokens(self.device) + rows
            tokens = [t for t in self.config.graph_token_sizes if t < most] + [most]
        for n in sorted({self.config.graph_tokens(t) for t in tokens} - {None}, reverse=True):
            self._flat_graph(n, False)
            if self._static(n):  # small steps whose chunks start late (the end of a long prompt) run in pieces
                self._flat_graph(n, True)
