"""A request's state: its prompt, what it generated, how it samples, when it stops, where its caches live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from sluice.engine.sampling import SamplingParams

WAITING, PREFILLING, DECODING, FINISHED = "waiting", "prefilling", "decoding", "finished"


class TokenConstraint(Protocol):
    """A per-request rule on which tokens may come next (e.g. a grammar for structured output). Before each of the
    request's tokens is sampled, `allowed()` gives a bool [vocab] mask (True = may be sampled; on the CPU or the
    logits' device), and every other token's logit becomes -inf; `advance(token)` then tells it the token sampled
    (never an end-of-generation id, which ends the request). Both run on the engine's thread."""

    def allowed(self) -> torch.Tensor: ...

    def advance(self, token: int) -> None: ...


@dataclass
class Sequence:
    id: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int  # the counter-based sampler's key: a row's draws depend on (seed, output index) alone
    stop_ids: frozenset[int] = frozenset()  # end-of-generation ids: end it, not part of the output
    stop: tuple[str, ...] = ()  # stop strings: end it, the text cut before the first one
    output: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None  # "stop" (a stop id or string), "length" (max_tokens), "abort", "error"
    row: int | None = None  # the cache row while it holds one
    prefilled: int = 0  # prompt tokens already in the cache
    text: _StopText | None = None  # the detokenized output, held back while it may start a stop string
    logprobs: int | None = None  # None: off; N: each step reports the token's logprob and the N most likely
    constraint: TokenConstraint | None = None  # which tokens may be sampled next (structured output)
    error: str | None = None  # with finish_reason "error": what went wrong (e.g. NaN/inf logits)
    recompute: list[int] | None = None  # preempted (`Scheduler.preempt`): its prompt and output, prefilled again
    isolated: bool = False  # in a step that failed: runs alone until a step of its own succeeds
    cached: int = 0  # prompt tokens its row held from the prefix cache when it got it (`engine/prefix.py`)
    fed: int = 0  # positions of its row a launched step has fed (its keys and values, its recurrent states)
    stopped_on: int | None = None  # the end-of-generation id that ended it (fed by a step run ahead)
    snapshots: list = field(default_factory=list)  # (position, slot): recurrent states kept (`PrefixCache`)
    snapshot_at: tuple[int, ...] = ()  # prompt positions to keep the row state at (a system prompt's end)

    @property
    def prefill_ids(self) -> list[int]:
        """The ids its prefill puts in the cache: the prompt, or once preempted the prompt and the output so far."""
        return self.prompt if self.recompute is None else self.recompute

    def chunk_end(self, first: int, end: int) -> int:
        """Where a prompt chunk from `first` wanting to reach `end` stops: at the first snapshot point past `first`
        before `end` (the row state is kept there, `PrefixCache.snapshot`)."""
        return next((p for p in self.snapshot_at if first < p < end), end)

    def fed_ids(self) -> list[int] | None:
        """The ids of the positions its row was fed, or None if they are not known."""
        ids = self.prompt + self.output + ([] if self.stopped_on is None else [self.stopped_on])
        return ids[:self.fed] if self.fed <= len(ids) else None

    @property
    def length(self) -> int:
        """Positions the sequence needs in the cache at most."""
        return len(self.prompt) + self.max_tokens

    @property
    def next_position(self) -> int:
        """Where the newest token (the next decode step's input) goes."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


class _StopText:
    """Incremental text of a sequence's output with stop strings: `push(token)` returns the text that is now safe to
    show (whole characters, never a possible start of a stop string), and says when a stop string was completed."""

    def __init__(self, decoder, stop: tuple[str, ...]):
        self.decoder, self.stop = decoder, tuple(s for s in stop if s)
        self.pending = ""  # decoded, not yet shown

    def push(self, token: int) -> tuple[str, bool]:
        self.pending += self.decoder.push(token)
        return self._release(final=False)

    def flush(self) -> str:
        self.pending += self.decoder.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0 if final else self._held_back()
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def _held_back(self) -> int:
        """The longest tail of the pending text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:n]):
                    best = n
                    break
        return best


def stop_text(tokenizer, stop: tuple[str, ...]) -> _StopText:
    return _StopText(tokenizer.stream_decoder(), stop)
