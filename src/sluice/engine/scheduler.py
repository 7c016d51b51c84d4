"""Which sequences run in the next step: admit waiting ones while the cache pool has rows, prefill prompts in chunks
(as many prompts' chunks as fit one step's token budget, packed into one forward), decode every sequence whose
prompt is in, free a finished sequence's row at once. A step in which sequences decode prefills fewer prompt tokens
(`decode_prefill_chunk`): its decodes wait for the whole forward."""

from __future__ import annotations

from collections import deque

from sluice.engine.sequence import DECODING, FINISHED, PREFILLING, WAITING, Sequence


class Scheduler:
    def __init__(self, prefill_chunk: int, decode_prefill_chunk: int | None = None):
        self.prefill_chunk = prefill_chunk  # prompt tokens a step prefills at most, over all its prompts
        # ... while sequences decode in the step (None: prefill_chunk; never more)
        self.decode_prefill_chunk = min(prefill_chunk, decode_prefill_chunk or prefill_chunk)
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

    def next_prefills(self, decoding: bool = False) -> list[tuple[Sequence, int, int]]:
        """[(sequence, first, end)]: the prompt chunks the next step prefills, oldest admitted prompt first, until
        `prefill_chunk` tokens, or `decode_prefill_chunk` when sequences decode in that step (`decoding`); a prompt
        that does not fit whole gets the tokens left, and the rest next step."""
        chunks, budget = [], self.decode_prefill_chunk if decoding else self.prefill_chunk
        for seq in self.running:
            if budget == 0:
                break
            if seq.status == PREFILLING:
                end = min(len(seq.prompt), seq.prefilled + budget)
                chunks.append((seq, seq.prefilled, end))
                budget -= end - seq.prefilled
        return chunks

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
