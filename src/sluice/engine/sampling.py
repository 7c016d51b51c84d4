"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties,
seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sluice.errors import InvalidOptionError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off; subtracted once from every token the output already holds
    frequency_penalty: float = 0.0  # 0 = off; subtracted once per time the output already holds the token
    seed: int | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty: the token is the argmax of the logits."""
        return (self.temperature == 0 and self.repetition_penalty == 1 and self.presence_penalty == 0
                and self.frequency_penalty == 0)

    @property
    def counts_output(self) -> bool:
        """Presence or frequency penalty: sampling needs the counts of the tokens generated so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def validate(self) -> SamplingParams:
        """Check every value's type and range (NaN and the infinities are out of range): a bad value is refused here,
        naming itself, before it reaches the device sampler, which packs these values into float32 and int64
        tensors."""
        def bad(name, rule):
            raise InvalidOptionError(f"{name}={getattr(self, name)!r} is out of range: {rule}.")

        t = self.temperature
        if not _real(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            bad("temperature", f"use 0 for greedy decoding or a value from {MIN_TEMPERATURE:g} to "
                               f"{MAX_TEMPERATURE:g}, such as 0.7")
        if not _integer(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"use 0 to disable or a positive integer up to {MAX_TOP_K}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "use a value in (0, 1]; 1 disables it")
        if not _real(self.min_p) or not 0 <= self.min_p < 1:
            bad("min_p", "use a value in [0, 1); 0 disables it")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _real(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            bad("repetition_penalty", f"use a value from {lo:g} to {hi:g}; 1 disables it")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "use a value in [-2, 2]; 0 disables it")
        if self.seed is not None and (not _integer(self.seed) or not -(1 << 63) <= self.seed < 1 << 64):
            bad("seed", "use an integer from -2**63 to 2**64 - 1, or none for a random one")
        return self


# Bounds that keep the sampler's float32 divisions by the temperature and the repetition penalty finite.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TOP_K = (1 << 31) - 1


def _real(value) -> bool:
    """A finite int or float (not a bool)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: list[int] | None = None, output: list[int] | None = None) -> int:
        """One token id from logits [vocab] (float32). history: the tokens the repetition penalty counts (prompt and
        output); output: the tokens generated so far (presence and frequency penalties)."""
        p = self.p
        logits = logits.float().cpu()
        if p.repetition_penalty != 1.0 and history:
            # HF convention: penalised logits move toward "less likely" whatever their sign.
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.counts_output and output:
            # OpenAI convention: logit -= count * frequency_penalty + (count > 0) * presence_penalty
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
