"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties,
seeded."""

from __future__ import annotations

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
        def bad(name, value, rule):
            raise InvalidOptionError(f"{name}={value!r} is out of range: {rule}.")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", self.temperature, "use 0 for greedy decoding or a positive value such as 0.7")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "use 0 to disable or a positive integer")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "use a value in (0, 1]; 1 disables it")
        if not 0 <= self.min_p < 1:
            bad("min_p", self.min_p, "use a value in [0, 1); 0 disables it")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "use a positive value; 1 disables it")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                bad(name, value, "use a value in [-2, 2]; 0 disables it")
        return self


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
