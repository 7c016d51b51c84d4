"""Which sequences run in the next step: admit waiting ones while the cache pool has rows, prefill prompts one chunk
at a time, decode every sequence whose prompt is in, free a finished sequence's row at once."""

from __future__ import annotations

from collections import deque

from sluice.engine.sequence import DECODING, FINISHED, PREFILLING, WAITING, Sequence


class Scheduler:
    def __init__(self, prefill_chunk: int):
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # prefilling or decoding, in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, pool) -> None:
        """Waiting sequences, first come first served, take free rows while they fit the pool's capacity."""
        while self.waiting and pool.free_rows and self.waiting[0].length <= pool.capacity:
            seq = self.waiting.popleft()
            seq.row, seq.status, seq.prefilled = pool.allocate(), PREFILLING, 0
            self.running.append(seq)

    def next_prefill(self) -> tuple[Sequence, int, int] | None:
        """(sequence, first, end) of the prompt chunk to prefill next: the oldest admitted prompt not yet in."""
        seq = next((s for s in self.running if s.status == PREFILLING), None)
        if seq is None:
            return None
        return seq, seq.prefilled, min(len(seq.prompt), seq.prefilled + self.prefill_chunk)

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.status == DECODING]

    def finish(self, seq: Sequence, reason: str, pool) -> None:
        seq.status, seq.finish_reason = FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
            pool.release(seq.row)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.row = None
