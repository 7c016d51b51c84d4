"""The engine: requests join and leave between steps (continuous batching) over one pool of cache rows.

Each `step()` runs ONE forward: the next token of every sequence whose prompt is in, and chunks of the oldest prompts
not yet in, as many as fit the step's budget (`engine/scheduler.py`); on a GPU a graph replay (`engine/runner.py`).
It samples on the device, one token for each decoding sequence and each prompt that is now in (`engine/readback.py`),
and returns what reached the host for each sequence, so callers stream per request:

    engine = model.engine
    seq = engine.add_request(ids, max_tokens=64, temperature=0.7, seed=1)
    while engine.has_work():
        for out in engine.step():
            print(out.seq.id, out.text)

Per request, beyond the sampling parameters: `logprobs=N` makes each StepOutput carry the sampled token's log
probability and the N most likely tokens' (of the model's own distribution: the log-softmax of the raw logits, before
penalties, temperature and masks), and `constraint` (a `TokenConstraint`) masks the logits before each draw.
Greedy requests without either take one argmax over the batch, as before.

Overlap (`EngineConfig.overlap`, on by default on a GPU): a step whose sampling runs wholly on the device is not read
back at once. The next step is launched first, its decode tokens' ids those still on the device, and the host reads
and detokenizes the earlier step while the GPU runs the later one; so each step's outputs come from the `step()` call
after the one that launched it. A sequence that stops on a stop id or string costs one step computed and thrown
away, and one at its max_tokens decodes no further; a step whose rows need the host (logprobs, a constraint, presence
or frequency penalties), or that runs a sequence isolated after a failed step (`step`), is read back before the next
launch.
"""

from __future__ import annotations

import cProfile
import io
import itertools
import logging
import os
import pstats
import time
from dataclasses import dataclass

import torch

from sluice.config import EngineConfig
from sluice.engine.prefix import PrefixCache
from sluice.engine.readback import Drawn, decode_ids, draw, land
from sluice.engine.runner import ModelRunner
from sluice.engine.sampler import fill_seen, random_seed
from sluice.engine.sampling import SamplingParams
from sluice.engine.scheduler import Scheduler
from sluice.engine.sequence import DECODING, Sequence, TokenConstraint, stop_text
from sluice.errors import ContextLengthError, InvalidOptionError, SluiceError

POOL_POSITIONS = 256  # a growing pool's capacity is a multiple of this
PROFILE_SLOW_S = float(os.environ.get("SLUICE_PROFILE_SLOW") or 0)  # > 0: every step profiled, a slower one logged
log = logging.getLogger("sluice.engine")


class GenerationError(SluiceError):
    """A request could not go on: the model produced NaN or inf logits for it (damaged weights, overflow)."""


@dataclass
class StepOutput:
    seq: Sequence
    token: int | None  # the token sampled this step (None: an end-of-generation id, not part of the output)
    text: str  # the text that became safe to show
    finished: bool
    logprob: float | None = None  # with logprobs: the token's log probability
    top_logprobs: list[tuple[int, float]] | None = None  # with logprobs=N: the N likeliest (id, logprob), best first


class Engine:
    def __init__(self, module, tokenizer, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.tokenizer, self.config = tokenizer, config
        self.vocab_size = module.cfg.vocab_size
        self.context_length = module.cfg.context_length
        self.runner = ModelRunner(module, config, device, dtype)
        self.scheduler = Scheduler(config.prefill_tokens(device), config.prefill_tokens(device, decoding=True))
        self.scheduler.deterministic = config.deterministic
        if config.deterministic and device.type == "cuda" and not config.graphs:
            raise InvalidOptionError("deterministic=True needs graphs on a GPU (its decode steps run at the largest "
                                     "graph's batch); drop graphs=False.")
        self._ids = itertools.count()
        self._ahead: Drawn | None = None  # a decode step launched, its ids not read yet (`overlap`)
        self._stepping: list[Sequence] = []  # the sequences of the step under way (`step`'s failure isolation)
        self._outputs: list[StepOutput] = []  # what the step under way has handed out so far
        self.failed_steps = 0  # steps that raised and were traced to their sequences (`_isolate`)
        self._rows: PrefixCache | None = None
        self.timing: dict[str, float] = {}  # the last step's host seconds: plan (admit, schedule), launch, land
        self.preemptions = 0  # sequences preempted because KV blocks ran out (`_reserve`)
        # a rank of a tensor-parallel model (`sluice.parallel`): a step that fails is not retried per sequence (the
        # other ranks' collectives would no longer meet); it fails the model
        self.lockstep = getattr(module, "tp", None) is not None

    @property
    def max_length(self) -> int:
        """Positions (prompt + generated) one sequence may hold."""
        return min(self.context_length, self.config.max_seq_len or self.context_length)

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_tokens: int = 256, stop_ids=None, stop=(), logprobs: int | None = None,
                    constraint: TokenConstraint | None = None, snapshot_at=(), **sampling) -> Sequence:
        """Queue a request (prompt token ids); it joins the running batch at the next step. stop_ids: the
        end-of-generation ids (default: the tokenizer's); stop: strings that end it (cut from the text); logprobs:
        None, or how many of the likeliest tokens each step reports beside the sampled one's log probability;
        constraint: which tokens may come next (see `TokenConstraint`); snapshot_at: prompt positions where the
        prefix cache should keep the row state, for later requests that share the prompt up to there (the end of a
        system prompt: `sluice serve` passes it)."""
        rid = next(self._ids)
        params = SamplingParams(**sampling).validate()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise InvalidOptionError(f"request {rid}: max_tokens={max_tokens!r}: use a non-negative integer.")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or
                                     not 0 <= logprobs <= self.vocab_size):
            raise InvalidOptionError(f"request {rid}: logprobs={logprobs!r}: use None or an integer in "
                                     f"[0, {self.vocab_size}].")
        if isinstance(stop, str):
            stop = (stop,)
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, self.vocab_size, self.context_length)
        if len(prompt) + max_tokens > self.max_length:
            raise ContextLengthError(
                f"request {rid}: {len(prompt)} prompt tokens + max_tokens={max_tokens} need {len(prompt) + max_tokens}"
                f" positions, more than the {self.max_length} a sequence may hold; lower max_tokens or shorten the "
                "prompt.")
        seq = Sequence(rid, prompt, max_tokens, params, random_seed() if params.seed is None else params.seed,
                       frozenset(self.tokenizer.stop_ids if stop_ids is None else stop_ids), tuple(stop))
        seq.text = stop_text(self.tokenizer, seq.stop)
        seq.logprobs, seq.constraint = logprobs, constraint
        seq.snapshot_at = tuple(sorted({int(p) for p in snapshot_at if 0 < int(p) < len(prompt)}))
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Cancel a request; its cache row is free for the next step."""
        if not seq.finished:
            self.scheduler.finish(seq, "abort", self.rows)

    def reserve(self) -> None:
        """Build the cache pool now, at its final size (`max_batch` rows of `max_seq_len` positions), instead of at
        the first step: a server sizes it once, before its first request. Needs max_seq_len."""
        if self.config.max_seq_len is None:
            raise InvalidOptionError("reserve() needs max_seq_len: the positions each sequence may hold.")
        if self.runner.pool is None and not self.scheduler.running:
            self._build_pool(self.config.max_batch, self.max_length, spare=None)

    def memory_plan(self, make: bool = True) -> dict:
        """How the engine's caches use the device (`engine/memory.py`): the pool's plan, or, before there is a pool,
        the plan `reserve()` would make (`max_batch` rows of `max_length` positions; {} with make=False: planning may
        run a profile step on the device, which only the engine's own thread may do); {"error": why} if that does not
        fit."""
        plan = self.runner.plan if self.runner.pool is not None else None
        if plan is None and not make:
            return {}
        if plan is None:
            try:
                plan = self.runner.plan_pool(self.config.max_batch, self.max_length, spare=None)
            except SluiceError as e:
                return {"error": str(e)}
        return {**plan.as_dict(), "lines": plan.lines()}

    @property
    def prefix_caching(self) -> bool:
        """Whether requests may start from a cached prefix (`EngineConfig.prefix_cache`; never deterministic: a hit
        moves where a prompt's chunks begin)."""
        return self.config.prefix_cache and not self.config.deterministic

    @property
    def rows(self) -> PrefixCache | None:
        """The pool's rows and the prefixes cached in them (`engine/prefix.py`); None before there is a pool."""
        pool = self.runner.pool
        if pool is None:
            return None
        if self._rows is None or self._rows.pool is not pool:
            plan = self.runner.plan
            budgeted = plan is not None and plan.budget is not None
            self._rows = PrefixCache(pool, self.prefix_caching, self.runner.batch, plan.free if budgeted else None)
            if plan is not None:
                plan.snapshot_bytes = self._rows.snapshot_bytes
        return self._rows

    def _build_pool(self, rows: int, capacity: int, spare: int | None = 0) -> None:
        """A new cache pool (`ModelRunner.build_pool`: `spare` rows for cached prefixes beyond the `rows` that run),
        the prefixes cached in the old one carried over while they fit (dropped first if both do not fit in memory
        at once)."""
        old = self._rows
        spare = spare if self.prefix_caching else 0
        try:  # planned as if the old pool were gone (it is once its entries are carried over)
            self.runner.build_pool(rows, capacity, spare, reclaim=0 if old is None else old.pool.nbytes())
        except InvalidOptionError:
            if old is None or not old.entries:
                raise
            old = self._rows = None
            self.runner.build_pool(rows, capacity, spare)
        if old is not None and self.rows.enabled and old.entries:
            self.rows.take(old)

    def warmup(self) -> float:
        """Build the cache pool at its final size (needs max_seq_len), capture every graph a step can replay and
        compile the kernels of the paths requests take (a few short requests, greedy and sampled, run to the end),
        so that the first requests wait for none of it; the seconds it took. Needs an idle engine."""
        if self.has_work():
            raise InvalidOptionError("warmup() needs an idle engine.")
        t0 = time.perf_counter()
        self.reserve()
        self.runner.capture()
        # a long prompt, then one short prompt a step joining the others as they decode: steps of every size of
        # decode tokens beside a prompt chunk, greedy and sampled
        rows = self.runner.batch
        long = min(self.max_length - 4, self.config.prefill_tokens(self.runner.device) // 2)
        seqs = [self.add_request([0] * long, max_tokens=2, stop_ids=(), temperature=0.0)]
        for i in range(rows):
            n = max(1, min(1 + i % 17, self.max_length - rows - 2))
            seqs.append(self.add_request([i % 251] * n, max_tokens=max(1, min(rows + 1 - i, self.max_length - n)),
                                         stop_ids=(), temperature=float(i % 2), seed=i))
            self.step()
        self.run(seqs)
        # then a wave: a prompt for every row at once (what many clients starting together send), then a wave
        # joining a full batch as it decodes
        for _ in range(2):
            wave = [self.add_request([(7 * i) % 251] * max(1, min(1 + i % 17, self.max_length - 4)), max_tokens=2,
                                     stop_ids=(), temperature=float(i % 2), seed=i) for i in range(rows)]
            self.step()
        self.run(wave)
        while self.has_work():
            self.step()
        self.rows.clear()  # the warm-up's prompts are nobody's prefix
        placement = getattr(self.runner.module, "placement", None)
        if placement is not None:
            placement.reset_stats()  # the hit rate counts requests, not the warm-up
        return time.perf_counter() - t0

    def clear_prefixes(self) -> None:
        """Drop every cached prefix (the next requests prefill their prompts whole)."""
        if self.rows is not None:
            self.rows.clear()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight > 0

    @property
    def in_flight(self) -> int:
        """Tokens sampled on the device and not yet read back (a step run ahead, `overlap`)."""
        return 0 if self._ahead is None else sum(not s.finished for s in self._ahead.seqs)

    @property
    def overlaps(self) -> bool:
        """Whether decode steps run ahead of the host (`EngineConfig.overlap`; None: on a GPU)."""
        overlap = self.config.overlap
        return self.runner.device.type == "cuda" if overlap is None else overlap

    # -- steps ----------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step (above). If it fails, only what it can be traced to fails: a step of one sequence (or of isolated
        ones) ends that request with finish_reason "error"; a step of several preempts them all (their prompts and
        outputs prefilled again) and runs them alone, one a step, until each has a step of its own that succeeds.
        What the step handed out before it failed (tokens already appended) is returned with the rest. An error of the
        device itself (a CUDA error leaves it unusable), or one raised before any request was in the step (a cache
        pool that does not fit), is raised."""
        self._stepping, self._outputs = [], []
        profile = cProfile.Profile() if PROFILE_SLOW_S > 0 else None
        try:
            if profile is None:
                self._step()
            else:
                self._profiled(profile)
        except Exception as error:
            if _device_error(error) or not any(not s.finished for s in self._stepping) or self.lockstep:
                raise  # the device's, before any request was in the step, or in a tensor-parallel group's lockstep
            self._outputs += self._isolate(error)
        else:
            for out in self._outputs:  # a sequence is cleared once its tokens reached the host
                out.seq.isolated = False
        outputs, self._outputs = self._outputs, []
        return outputs

    def _profiled(self, profile: cProfile.Profile) -> None:
        """`_step` under cProfile (`SLUICE_PROFILE_SLOW=seconds`): a step slower than that logs where its host time
        went (a host wait for the device shows as the call that waited)."""
        clock = time.perf_counter()
        profile.enable()
        try:
            self._step()
        finally:
            profile.disable()
            seconds = time.perf_counter() - clock
            if seconds > PROFILE_SLOW_S:
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats("tottime").print_stats(25)
                stats.sort_stats("cumulative").print_stats("sluice", 40)  # which of our calls it went under
                log.warning("a step took %.2f s; its profile:\n%s", seconds, text.getvalue())

    def _isolate(self, error: Exception) -> list[StepOutput]:
        self.failed_steps += 1
        suspects = list({id(s): s for s in self._stepping if not s.finished}.values())
        log.warning("a step of %d sequence(s) failed; %s:", len(suspects),
                    "they end" if len(suspects) == 1 or all(s.isolated for s in suspects) else "they go on one at a "
                    "time", exc_info=error)
        self._ahead = None  # its tokens are drawn again: a row's draws depend on (seed, index) alone
        if len(suspects) == 1 or all(s.isolated for s in suspects):
            why = f"{type(error).__name__}: {error}"
            return [self._fail(s, f"the step failed ({why})") for s in suspects]
        for seq in reversed(suspects):
            self.scheduler.preempt(seq, self.rows)
        return []

    def _step(self) -> None:
        """The step, its outputs into `_outputs` as they come; `timing` says where its host time went."""
        clock = time.perf_counter()
        self._outputs += [StepOutput(s, None, "", True) for s in self._finish_empty()]
        ahead, self._ahead = self._ahead, None
        self._fit_pool()
        self.scheduler.admit(self.rows)
        in_flight = {} if ahead is None else {s.id: 1 for s in ahead.seqs if not s.finished}
        decodes, chunks = self.scheduler.schedule(in_flight)
        if self.rows is not None and self.rows.blocks is not None:
            decodes, chunks, ahead, in_flight = self._reserve(decodes, chunks, ahead, in_flight)
        self._stepping = ([] if ahead is None else list(ahead.seqs)) + decodes + [seq for seq, _, _ in chunks]
        timing = self.timing = {"plan": time.perf_counter() - clock}
        if decodes or chunks:
            for seq, first, _ in chunks:
                if first == seq.cached:
                    self._mark_seen(seq)
            positions = [s.next_position + in_flight.get(s.id, 0) for s in decodes]
            logits = self.runner.step([(s.row, p) for s, p in zip(decodes, positions)],
                                      decode_ids(decodes, ahead),
                                      [(seq.row, seq.prefill_ids[first:end], first) for seq, first, end in chunks])
            timing["launch"] = time.perf_counter() - clock - timing["plan"]
            for seq, p in zip(decodes, positions):
                seq.fed = p + 1
            done = []
            for i, (seq, _, end) in enumerate(chunks):
                seq.prefilled = seq.fed = end
                if end == len(seq.prefill_ids):
                    seq.status = DECODING
                    done.append(len(decodes) + i)
                if end == len(seq.prefill_ids) or end in seq.snapshot_at:  # the row state kept where the prompt
                    self.rows.snapshot(seq, end)  # or a snapshot point ends
            drawn = draw(decodes + [chunks[i - len(decodes)][0] for i in done],
                         logits if len(done) == len(chunks) else logits[list(range(len(decodes))) + done],
                         [in_flight.get(s.id, 0) for s in decodes] + [0] * len(done), self.runner.seen)
        else:
            drawn = None
        mark = time.perf_counter()
        if ahead is not None:  # read while the GPU runs the step just launched
            self._land(ahead)
        if drawn is not None:
            if self.overlaps and all(self._runs_ahead(s) and not s.isolated for s in drawn.seqs):
                self._ahead = drawn
            else:
                self._land(drawn)
        timing["land"] = time.perf_counter() - mark  # mostly waiting for the device

    def _reserve(self, decodes, chunks, ahead, in_flight):
        """A paged KV cache: give the step's sequences the blocks their new positions need, cached prefixes evicted
        for them first; if that is not enough, the newest running sequence is preempted (its row kept as a cached
        prefix, which it resumes from unless its blocks were taken meanwhile; the step run ahead, if any, is read
        back first) and the step scheduled again. Returns (decodes, chunks, ahead, in_flight)."""
        while True:
            need = [(s, s.next_position + in_flight.get(s.id, 0) + 1) for s in decodes] + \
                [(seq, end) for seq, _, end in chunks]
            if all(self.rows.reserve(s, n) for s, n in need):
                return decodes, chunks, ahead, in_flight
            if ahead is not None:  # its tokens land first: a sequence preempted then holds no token in flight
                self._land(ahead)
                ahead, in_flight = None, {}
            else:
                if len(self.scheduler.running) < 2:
                    raise RuntimeError("a sequence alone does not find the KV blocks its positions need")
                running = self.scheduler.running
                victim = next((s for s in reversed(running) if not s.isolated), running[-1])
                log.info("KV blocks ran out: request %d preempted (it resumes later)", victim.id)
                self.preemptions += 1
                self.scheduler.preempt(victim, self.rows, isolate=False)
            decodes, chunks = self.scheduler.schedule(in_flight)

    @staticmethod
    def _runs_ahead(seq: Sequence) -> bool:
        """Whether a sequence's step may be read back a step late: its sampling needs nothing from the host."""
        return seq.logprobs is None and seq.constraint is None and not seq.sampling.counts_output

    def _finish_empty(self) -> list[Sequence]:
        """Requests for no tokens at all end before they take a row."""
        empty = [s for s in self.scheduler.waiting if s.max_tokens == 0]
        for seq in empty:
            self.scheduler.finish(seq, "length", self.rows)
        return empty

    def _fit_pool(self) -> None:
        """Size the cache pool for the waiting requests while nothing runs: `max_batch` rows of `max_seq_len` when
        that is set, else rows and positions grown to what the requests need."""
        waiting, pool = self.scheduler.waiting, self.runner.pool
        if self.scheduler.running or not waiting:
            return
        if self.config.max_seq_len is not None:
            if pool is None:
                self._build_pool(self.config.max_batch, self.max_length, spare=None)
            return
        # deterministic: every decode step at the pool's full batch, so the pool has all its rows from the start
        rows = self.config.max_batch if self.config.deterministic else min(self.config.max_batch, len(waiting))
        capacity = max(s.length for s in waiting)
        if pool is not None and pool.rows >= rows and pool.capacity >= capacity:
            return
        if pool is not None:  # grown: positions at least doubled (a chat's history grows every turn)
            rows = max(rows, pool.rows)
            capacity = max(capacity, pool.capacity if capacity <= pool.capacity else 2 * pool.capacity)
        rows = min(self.config.max_batch, 1 << (rows - 1).bit_length())
        capacity = min(self.max_length, -(-capacity // POOL_POSITIONS) * POOL_POSITIONS)
        self._build_pool(rows, capacity)

    def _mark_seen(self, seq: Sequence) -> None:
        if seq.sampling.repetition_penalty != 1.0:
            fill_seen(self.runner.seen, seq.row, seq.prefill_ids)

    def _land(self, drawn: Drawn) -> None:
        """Wait for a drawn step's ids (`readback.land`) and hand them to their sequences, each output into
        `_outputs` as it is made (those aborted or stopped since are skipped: a step run ahead of a stop is thrown
        away)."""
        for seq, token, finite, lp in land(drawn):
            self._outputs.append(self._append(seq, token, *lp) if finite else self._fail(seq, "NaN or inf logits"))

    def _fail(self, seq: Sequence, why: str) -> StepOutput:
        """End a request that cannot go on (finish_reason "error"); the others in the batch continue."""
        if why.startswith("the step failed"):
            seq.error = f"request {seq.id}: {why} after {len(seq.output)} generated tokens; it was stopped."
        else:
            seq.error = (f"request {seq.id}: the model produced {why} after {len(seq.output)} generated tokens; its "
                         "output would be garbage, so it was stopped. The weights may be damaged, or the dtype "
                         "overflows (try --dtype float32).")
        self.scheduler.finish(seq, "error", self.rows)
        return StepOutput(seq, None, "", True)

    def _append(self, seq: Sequence, token: int, logprob: float | None = None,
                top_logprobs: list[tuple[int, float]] | None = None) -> StepOutput:
        if token in seq.stop_ids:
            seq.stopped_on = token
            self.scheduler.finish(seq, "stop", self.rows)
            return StepOutput(seq, None, seq.text.flush(), True, logprob, top_logprobs)
        seq.output.append(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        text, stopped = seq.text.push(token)
        if stopped:
            self.scheduler.finish(seq, "stop", self.rows)
        elif len(seq.output) >= seq.max_tokens:
            self.scheduler.finish(seq, "length", self.rows)
            text += seq.text.flush()
        return StepOutput(seq, token, text, seq.finished, logprob, top_logprobs)

    # -- whole requests -------------------------------------------------------------------------------------
    def run(self, seqs: list[Sequence]) -> None:
        """Step until these sequences are finished."""
        while not all(s.finished for s in seqs):
            self.step()


def _device_error(error: Exception) -> bool:
    """Whether an error comes from the device itself (a CUDA error: the context is unusable after it), not from a
    request."""
    accelerator = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator) or "CUDA error" in str(error)


def check_prompt(ids: list[int], vocab_size: int, context_length: int) -> None:
    if not ids:
        raise InvalidOptionError("the prompt is empty: give at least one token.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidOptionError(f"token ids must be in [0, {vocab_size}).")
    if len(ids) > context_length:
        raise ContextLengthError(f"the prompt has {len(ids)} tokens but the model's context window is "
                                 f"{context_length}. Shorten the prompt.")
