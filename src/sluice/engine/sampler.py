"""Batched next-token sampling on the device: one token per row, each row with its own parameters and seed.

`sample(logits, batch, seen, counts=...)` turns float32 logits [B, V] into token ids [B] with tensor ops only: nothing
in it waits on the device, so the host syncs only when it reads the ids. The filters are those of `sampling.Sampler`,
row by row: repetition penalty (HF convention) on the rows' seen tokens, presence and frequency penalties (OpenAI
convention) on the counts of the tokens each row generated, then temperature (0 = greedy), top-k on the scaled
logits, softmax, min-p (relative to the largest probability), top-p (the smallest prefix of the sorted probabilities
whose mass reaches top_p). A row whose filter is off is left exactly as it was when another row of the batch turns
that filter on.

The draw is an exponential race: token = argmax_v probs[v] / E[v] with E[v] = -log u[v], which picks v with
probability probs[v] / sum(probs). The uniforms u come from an integer hash of (the row's key, v), the key a hash of
(the request's seed, the row's counter) computed on the host, so a row's token depends only on its logits, parameters,
seed and counter: not on the other rows, its place in the batch, or any torch generator. The hash uses 32-bit lanes in
int64 tensors with no overflow, so CPU and CUDA produce the same bits; the rest is float32 arithmetic, equal across
devices up to rounding.

The seen mask is a bool tensor [rows, V] the engine keeps on the device, one row per cache row: `fill_seen` sets a
row to a prompt's tokens at admission, `mark_seen` adds each step's sampled tokens.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence

import torch

from sluice.engine.sampling import SamplingParams

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: keeps a zero seed away from the hash's fixed point at 0


def random_seed() -> int:
    """A fresh random 63-bit seed for a request that gave none (draw it once, at admission)."""
    return secrets.randbits(63)


def row_key(seed: int, counter: int) -> int:
    """The 32-bit key of a row's uniforms: a hash of the seed (any int, taken modulo 2**64) and the counter (in
    [0, 2**32))."""
    seed %= 1 << 64
    return _mix32(_mix32(_mix32((seed & _M32) ^ _GOLDEN) ^ (seed >> 32)) ^ counter)


class SamplingBatch:
    """The sampling parameters of one step's rows, as device tensors, and host flags that choose the work to do.

    Device tensors (column views of two packed tensors): temperature, top_p, min_p, repetition_penalty,
    presence_penalty, frequency_penalty (float32 [B]); top_k, key (int64 [B]; key = row_key(seed, counter)). Host
    flags: `all_greedy` (every temperature is 0: sample() is one argmax), `any_greedy`, `needs_seen` (some row has a
    repetition penalty: sample() needs its seen mask), `needs_counts` (some row has a presence or frequency penalty:
    sample() needs the counts of the rows' generated tokens),
    `max_top_k` (the largest top_k, 0 when no row uses top-k), `any_min_p`, `any_top_p`, `top_p_within_top_k` (every
    row with top-p also has top-k: top-p sorts only the max_top_k largest probabilities, not the whole vocabulary).
    """

    def __init__(self, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int],
                 device: torch.device | str, out: SamplingBatch | None = None):
        """params[i], seeds[i] and counters[i] describe row i. A seed is any int (taken modulo 2**64; see
        random_seed for unseeded requests). A counter is the index of the token being generated (0 for a request's
        first output token), in [0, 2**32).

        The values reach the device in two non-blocking copies from pinned memory. With `out` (an earlier batch of at
        least len(params) rows, e.g. one built once for the engine's largest batch) they are written into its first
        rows and this batch views them, so the device tensors keep their addresses from step to step."""
        if not len(params) == len(seeds) == len(counters):
            raise ValueError(f"{len(params)} params, {len(seeds)} seeds and {len(counters)} counters: one each per row")
        if any(not 0 <= c <= _M32 for c in counters):
            raise ValueError(f"counters must lie in [0, 2**32): {list(counters)}")
        params = [p.validate() for p in params]
        self.all_greedy = all(p.temperature == 0 for p in params)
        self.any_greedy = any(p.temperature == 0 for p in params)
        self.needs_seen = any(p.repetition_penalty != 1 for p in params)
        self.needs_counts = any(p.counts_output for p in params)
        self.max_top_k = max((p.top_k for p in params), default=0)
        self.any_min_p = any(p.min_p > 0 for p in params)
        self.any_top_p = any(p.top_p < 1 for p in params)
        self.top_p_within_top_k = all(p.top_k > 0 for p in params if p.top_p < 1)

        device = torch.device(device)
        pin = device.type == "cuda"
        floats = torch.tensor([[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                                p.frequency_penalty] for p in params],
                              dtype=torch.float32, pin_memory=pin).reshape(-1, 6)
        ints = torch.tensor([[p.top_k, row_key(s, c)] for p, s, c in zip(params, seeds, counters)],
                            dtype=torch.int64, pin_memory=pin).reshape(-1, 2)
        if out is None:
            self.floats = floats.to(device, non_blocking=True)
            self.ints = ints.to(device, non_blocking=True)
        else:
            if out.floats.shape[0] < len(params) or out.floats.device != device:
                raise ValueError(f"out holds {out.floats.shape[0]} rows on {out.floats.device}: need {len(params)} "
                                 f"on {device}")
            self.floats = out.floats[:len(params)].copy_(floats, non_blocking=True)
            self.ints = out.ints[:len(params)].copy_(ints, non_blocking=True)

    @property
    def temperature(self) -> torch.Tensor:
        return self.floats[:, 0]

    @property
    def top_p(self) -> torch.Tensor:
        return self.floats[:, 1]

    @property
    def min_p(self) -> torch.Tensor:
        return self.floats[:, 2]

    @property
    def repetition_penalty(self) -> torch.Tensor:
        return self.floats[:, 3]

    @property
    def presence_penalty(self) -> torch.Tensor:
        return self.floats[:, 4]

    @property
    def frequency_penalty(self) -> torch.Tensor:
        return self.floats[:, 5]

    @property
    def top_k(self) -> torch.Tensor:
        return self.ints[:, 0]

    @property
    def key(self) -> torch.Tensor:
        return self.ints[:, 1]


def sample(logits: torch.Tensor, batch: SamplingBatch, seen: torch.Tensor | None = None,
           rows: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row (int64 [B], on the logits' device) from logits [B, V] (float32; other dtypes are
    converted). seen: the rows' seen tokens, needed when batch.needs_seen: either a bool [B, V] mask, or with `rows`
    (int64 [B]) the engine's whole bool [pool_rows, V] mask, of which row rows[i] belongs to logits row i (one [B, V]
    gather; when the step's rows are the pool's first B in order, pass seen[:B] instead: a view, no copy). counts:
    float32 [B, V], how often each row generated each token (`output_counts`), needed when batch.needs_counts."""
    x = _penalised(logits, batch, seen, rows, counts)
    if batch.all_greedy:
        return x.argmax(-1)
    ids = (_filtered(x, batch) / uniforms(batch.key, x.shape[-1]).log_().neg_()).argmax(-1)
    return torch.where(batch.temperature == 0, x.argmax(-1), ids) if batch.any_greedy else ids


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch, seen: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The distributions sample() draws from (float32 [B, V]; arguments as for sample): the softmax of the penalised,
    temperature-scaled, top-k-masked logits, with the entries min-p and top-p drop set to 0 and the rest left as they
    are (a row sums to at most 1). A greedy row gets its distribution at temperature 1 (sample() takes its argmax)."""
    return _filtered(_penalised(logits, batch, seen, rows, counts), batch)


def _penalised(logits: torch.Tensor, batch: SamplingBatch, seen: torch.Tensor | None, rows: torch.Tensor | None,
               counts: torch.Tensor | None) -> torch.Tensor:
    """float32 logits with the repetition penalty applied to the seen tokens (positive ones divided, negative ones
    multiplied), then count * frequency_penalty + (count > 0) * presence_penalty subtracted (a row whose penalties
    are off is unchanged)."""
    x = logits.float()
    if batch.needs_seen:
        if seen is None:
            raise ValueError("a row has a repetition penalty: pass the rows' seen mask")
        if rows is not None:
            seen = seen.index_select(0, rows)
        pen = batch.repetition_penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    if batch.needs_counts:
        if counts is None:
            raise ValueError("a row has a presence or frequency penalty: pass the counts of its generated tokens")
        x = x - counts * batch.frequency_penalty[:, None] - (counts > 0).float() * batch.presence_penalty[:, None]
    return x


def _filtered(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """filtered_probs of the penalised logits x."""
    vocab = x.shape[-1]
    x = x / torch.where(batch.temperature == 0, 1.0, batch.temperature)[:, None]
    if batch.max_top_k:
        k = batch.top_k[:, None]
        top = torch.topk(x, min(batch.max_top_k, vocab), dim=-1)
        kth = top.values.gather(1, k.clamp(1, top.values.shape[1]) - 1)
        x = x.masked_fill(x < torch.where((k > 0) & (k < vocab), kth, float("-inf")), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if batch.any_min_p:
        probs = probs.masked_fill(probs < batch.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    if batch.any_top_p:
        # drop the sorted positions whose preceding mass already reaches top_p; keep every token at least as likely
        # as the least likely one kept (at least the most likely token)
        top_p = batch.top_p[:, None]
        if batch.top_p_within_top_k and batch.max_top_k < vocab:
            # a top-p row's probabilities outside its max_top_k largest are 0 or tie its k-th largest, which the
            # threshold keeps or drops with it: the sorted max_top_k largest give the same threshold as a full sort
            desc = probs.gather(1, top.indices).sort(dim=-1, descending=True).values
        else:
            desc = torch.sort(probs, dim=-1, descending=True).values
        least_kept = desc.masked_fill(desc.cumsum(-1) - desc >= top_p, float("inf")).amin(-1, keepdim=True)
        probs = probs.masked_fill(probs < torch.where(top_p < 1, least_kept, 0.0), 0.0)
    return probs


def uniforms(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, vocab] of uniforms in (0, 1): u[b, v] is a function of (key[b], v) alone (key: int64 [B] of
    row_key values), bit-identical on every device: the odd multiples of 2**-24, from 2**-24 to 1 - 2**-24 (23 random
    bits each)."""
    bits = _mix32(key[:, None] ^ _token_hash(vocab, key.device))
    bits >>= 8
    bits |= 1
    return bits.float().mul_(2.0 ** -24)


@functools.lru_cache(maxsize=8)
def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """_mix32 of the token ids 0..vocab-1 (int64 [vocab]; computed once per vocabulary size and device)."""
    return _mix32(torch.arange(vocab, device=device))


def _mix32(x):
    """lowbias32 (C. Wellons, hash-prospector), a bijection of 32-bit integers, of x: a Python int or an int64 tensor
    (overwritten) of values in [0, 2**32). The second multiplier is applied as c - 2**32 (congruent modulo 2**32): both
    products stay below 2**63 in magnitude, so nothing overflows, and the shifted values are never negative."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _M32
    x ^= x >> 15
    x *= 0x846CA68B - (1 << 32)
    x &= _M32
    x ^= x >> 16
    return x


def output_counts(outputs: Sequence[Sequence[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """float32 [len(outputs), vocab]: how often row i's generated tokens outputs[i] hold each token id."""
    rows = torch.tensor([i for i, out in enumerate(outputs) for _ in out], dtype=torch.long)
    ids = torch.tensor([t for out in outputs for t in out], dtype=torch.long)
    counts = torch.zeros(len(outputs), vocab, dtype=torch.float32, device=device)
    return counts.index_put_((rows.to(device), ids.to(device)), torch.ones((), device=device), accumulate=True)


def mark_seen(seen: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """Mark tokens[i] as seen in row rows[i] of the bool mask seen [pool_rows, V] (rows, tokens: int64 [B] on its
    device, e.g. the ids sample() returned); no host sync."""
    seen.index_put_((rows, tokens), torch.ones((), dtype=torch.bool, device=seen.device))


def fill_seen(seen: torch.Tensor, row: int, ids: Sequence[int] | torch.Tensor) -> None:
    """Set row `row` of the bool mask seen [pool_rows, V] to exactly the tokens `ids` (a prompt, at admission)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if seen.device.type == "cuda" and ids.device.type == "cpu":
        ids = ids.pin_memory()
    seen[row].zero_().index_fill_(0, ids.to(seen.device, non_blocking=True), True)
