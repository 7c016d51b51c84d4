"""Which tokens the next step runs, in ONE forward: the next token of every decoding sequence first, then chunks of
the prompts not yet in, oldest admitted first, as many as fit the step's budget of prompt tokens. Waiting requests
take free cache rows first come first served; a finished sequence's row is free at once.

The budget: `prefill_chunk` prompt tokens when nothing decodes (a burst of prompts is in after about
total prompt tokens / prefill_chunk steps); while sequences decode, every one of them waits for the whole forward,
so a step prefills at most `decode_prefill_chunk` prompt tokens, and within `prefill_chunk` tokens in all.

Deterministic (`EngineConfig.deterministic`): a step either decodes every decoding sequence or prefills one chunk of
one prompt (the oldest), the two in turn while both wait; a prompt's chunks start at multiples of prefill_chunk.

After a step failed (`Engine.step`), its sequences are preempted (their rows freed, their prompt and output prefilled
again) and isolated: while one is, each step runs one isolated sequence alone."""

from __future__ import annotations

from collections import deque

from sluice.engine.sequence import DECODING, FINISHED, PREFILLING, WAITING, Sequence


class Scheduler:
    def __init__(self, prefill_chunk: int, decode_prefill_chunk: int | None = None):
        self.prefill_chunk = prefill_chunk  # prompt tokens a step prefills at most, over all its prompts
        # ... while sequences decode in the step (None: prefill_chunk; never more)
        self.decode_prefill_chunk = min(prefill_chunk, decode_prefill_chunk or prefill_chunk)
        self.proportional = False  # the budget beside decodes grows with the prompts waiting (`budget`)
        self.deterministic = False  # decode steps and one-prompt prefill steps, never mixed (above)
        self._prefilled_last = False  # deterministic: the last step prefilled (the next decodes, if any decode)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # prefilling or decoding, in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, rows) -> None:
        """Waiting sequences, first come first served, take free rows (`engine/prefix.py` `PrefixCache`) while they
        fit the pool's capacity and fewer than its batch run; one whose ids begin with a cached prefix prefills from its
        end."""
        while (self.waiting and rows.free_rows and len(self.running) < rows.batch
               and self.waiting[0].length <= rows.capacity):
            if rows.awaits(self.waiting[0], self.running):
                break  # a running prompt is about to leave the row state where this one could resume
            if not rows.fits(self.waiting[0], self.running):
                break  # its prompt's KV blocks are not free (a paged cache)
            seq = self.waiting.popleft()
            seq.row, seq.status = rows.allocate(seq, self.running), PREFILLING
            seq.prefilled = seq.fed = seq.cached
            self.running.append(seq)

    def schedule(self, in_flight: dict[int, int] | None = None) -> tuple[list[Sequence], list[tuple[Sequence, int,
                                                                                                  int]]]:
        """The next step: (the sequences that decode a token, the prompt chunks (sequence, first, end) it prefills).
        in_flight: tokens a sequence has sampled that are not in its output yet (a step run ahead); a sequence whose
        last token is among them decodes no more."""
        in_flight = in_flight or {}
        isolated = next((s for s in self.running if s.isolated), None)
        if isolated is not None:  # alone: a failure now is its own
            if isolated.status == DECODING:
                return [isolated], []
            return [], [self._chunk(isolated, self.prefill_chunk)]
        decodes = [s for s in self.running
                   if s.status == DECODING and len(s.output) + in_flight.get(s.id, 0) < s.max_tokens]
        if self.deterministic:
            prompt = next((s for s in self.running if s.status == PREFILLING), None)
            if prompt is None or (decodes and self._prefilled_last):
                self._prefilled_last = False
                return decodes, []
            self._prefilled_last = True
            return [], [self._chunk(prompt, self.prefill_chunk)]
        return decodes, self.next_prefills(len(decodes))

    def budget(self, decoding: int) -> int:
        """Prompt tokens a step in which `decoding` sequences decode may prefill: decode_prefill_chunk times
        1 + (prompts waiting for their first token, admitted or not) / (decoding sequences): a burst of prompts gets
        in fast, while a lone long prompt joining a batch stalls it little; within prefill_chunk tokens in all."""
        if not decoding:
            return self.prefill_chunk
        share = 1.0
        if self.proportional:
            share += (len(self.waiting) + sum(s.status == PREFILLING for s in self.running)) / decoding
        return max(1, min(int(self.decode_prefill_chunk * share), self.prefill_chunk - decoding))

    def next_prefills(self, decoding: int = 0) -> list[tuple[Sequence, int, int]]:
        """[(sequence, first, end)]: the prompt chunks the next step prefills beside `decoding` decode tokens,
        oldest admitted prompt first, within `budget`; a prompt that does not fit whole gets the tokens left, and
        the rest next step."""
        chunks, budget = [], self.budget(decoding)
        for seq in self.running:
            if budget == 0:
                break
            if seq.status == PREFILLING:
                chunks.append(self._chunk(seq, budget))
                budget -= chunks[-1][2] - seq.prefilled
        return chunks

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> tuple[Sequence, int, int]:
        """The next chunk of a prompt within `budget` tokens, cut at a snapshot point (`Sequence.chunk_end`)."""
        first = seq.prefilled
        return seq, first, seq.chunk_end(first, min(len(seq.prefill_ids), first + budget))

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.status == DECODING]

    def preempt(self, seq: Sequence, rows, isolate: bool = True) -> None:
        """Take a running sequence's row back and queue it first, to prefill its prompt and output again and go on
        from there (recompute): isolated after a failed step (its row dropped); else (KV blocks ran out) its row kept
        as a cached prefix, which it resumes from unless the blocks were needed meanwhile."""
        if seq in self.running:
            self.running.remove(seq)
            rows.release(seq, keep=not isolate)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.row, seq.status, seq.prefilled = None, WAITING, 0
        seq.recompute = seq.prompt + seq.output if seq.output else None
        seq.isolated = isolate
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, rows) -> None:
        """End a sequence; its row goes back (kept as a cached prefix unless it failed)."""
        seq.status, seq.finish_reason = FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
            rows.release(seq, keep=reason != "error")
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.row = None
