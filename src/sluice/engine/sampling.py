"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded."""

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
    seed: int | None = None

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
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: list[int] | None = None) -> int:
        """One token id from logits [vocab] (float32)."""
        p = self.p
        logits = logits.float().cpu()
        if p.repetition_penalty != 1.0 and history:
            # HF convention: penalised logits move toward "less likely" whatever their sign.
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
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
