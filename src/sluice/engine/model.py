"""The user-facing model: `sluice.load(path)` -> Model with .tokenizer, .generate, .stream, .logits."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from sluice.engine.sampling import Sampler, SamplingParams
from sluice.errors import ContextLengthError, InvalidOptionError, ModelFileError, UnsupportedError
from sluice.layers.linear import RMSNorm, _WeightHolder
from sluice.quant.affine import QuantizedTensor

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds activation memory for long prompts


class Model:
    def __init__(self, module, tokenizer, path: Path, fmt: str, device: torch.device, dtype: torch.dtype,
                 kv_cache: str = "dense"):
        self.module, self.tokenizer, self.path, self.format = module, tokenizer, path, fmt
        self.config = module.cfg
        self.device, self.dtype = device, dtype
        self.kv_cache = kv_cache

    # -- pieces -------------------------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.config.context_length

    def new_cache(self, capacity: int, batch: int = 1):
        """Empty caches for `batch` sequences of up to `capacity` positions (the architecture decides the kind)."""
        return self.module.new_cache(batch, capacity, self.dtype, self.device, self.kv_cache)

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, cache, start: int, last_only: bool) -> torch.Tensor:
        return self.module(ids.to(self.device), cache, start, self.dtype, last_only=last_only)

    def _prefill(self, ids: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
        outs = []
        for s in range(0, ids.shape[1], PREFILL_CHUNK):
            outs.append(self._forward(ids[:, s:s + PREFILL_CHUNK], cache, s, last_only))
        return outs[-1] if last_only else torch.cat(outs, dim=1)

    def _check_ids(self, ids: torch.Tensor):
        if ids.numel() == 0:
            raise InvalidOptionError("the prompt is empty: give at least one token.")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise InvalidOptionError(f"token ids must be in [0, {self.config.vocab_size}).")
        if ids.shape[-1] > self.context_length:
            raise ContextLengthError(
                f"the prompt has {ids.shape[-1]} tokens but the model's context window is {self.context_length}. "
                "Shorten the prompt.")

    # -- API ----------------------------------------------------------------------------------------------
    def logits(self, ids) -> torch.Tensor:
        """Float32 logits [B, T, vocab] of a full forward from empty caches."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        self._check_ids(ids)
        cache = self.new_cache(ids.shape[1], batch=ids.shape[0])
        return self._prefill(ids, cache, last_only=False).cpu()

    def encode_prompt(self, prompt, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or a list of chat messages ({role, content})."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not chat:
            return tok.encode(prompt)
        if isinstance(prompt, str):
            prompt = ([{"role": "system", "content": system}] if system else []) + \
                     [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special=False)
        return [int(t) for t in prompt]

    def generate_ids(self, ids: list[int], max_tokens: int = 256, stop_ids=None, **sampling) -> Iterator[int]:
        """Yield generated token ids (stops at an end-of-generation token, which is not yielded)."""
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidOptionError(f"max_tokens={max_tokens!r}: use a non-negative integer.")
        sampler = Sampler(SamplingParams(**sampling))
        prompt = torch.tensor([ids], dtype=torch.long)
        self._check_ids(prompt)
        stop = self.tokenizer.stop_ids if stop_ids is None else set(stop_ids)
        n = len(ids)
        max_tokens = min(max_tokens, self.context_length - n)  # the window ends generation
        if max_tokens <= 0:
            return
        cache = self.new_cache(n + max_tokens)
        logits = self._prefill(prompt, cache, last_only=True)
        history = list(ids)
        for i in range(max_tokens):
            tok = sampler(logits[0, -1], history)
            if tok in stop:
                return
            yield tok
            history.append(tok)
            if i + 1 < max_tokens:
                logits = self._forward(torch.tensor([[tok]]), cache, n + i, last_only=True)

    def stream(self, prompt, max_tokens: int = 256, chat: bool = False, system: str | None = None,
               **sampling) -> Iterator[str]:
        """Yield text pieces as they are decoded (whole UTF-8 characters only)."""
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        dec = self.tokenizer.stream_decoder()
        for tok in self.generate_ids(ids, max_tokens=max_tokens, **sampling):
            piece = dec.push(tok)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> str:
        return "".join(self.stream(prompt, max_tokens=max_tokens, **kwargs))

    def bench(self, prompt_tokens: int = 512, gen_tokens: int = 64, repeats: int = 2) -> dict:
        """Prefill and decode speed on `prompt_tokens` random ids (fixed seed), then `gen_tokens` greedy steps;
        the best of `repeats` runs (the first also warms up kernels)."""
        if prompt_tokens < 1 or gen_tokens < 1 or repeats < 1:
            raise InvalidOptionError("bench: prompt and generated token counts and repeats must be >= 1.")
        if prompt_tokens + gen_tokens > self.context_length:
            raise ContextLengthError(f"bench: {prompt_tokens} + {gen_tokens} tokens exceed the model's context "
                                     f"window of {self.context_length}.")
        ids = torch.randint(0, self.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        best_p = best_d = float("inf")
        for _ in range(repeats):
            cache = self.new_cache(prompt_tokens + gen_tokens)
            sync()
            t0 = time.perf_counter()
            logits = self._prefill(ids, cache, last_only=True)
            sync()
            t1 = time.perf_counter()
            for i in range(gen_tokens):
                tok = int(logits[0, -1].argmax())
                logits = self._forward(torch.tensor([[tok]]), cache, prompt_tokens + i, last_only=True)
            sync()
            best_p, best_d = min(best_p, t1 - t0), min(best_d, time.perf_counter() - t1)
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."), "kv_cache": self.kv_cache,
                "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "prefill_tok_s": prompt_tokens / best_p,
                "decode_tok_s": gen_tokens / best_d, **self._kv_layout()}

    def _kv_layout(self) -> dict:
        """What the KV cache costs: bytes per token (all attention layers, and one), the fixed part."""
        kv = self.module.new_cache(1, 1, self.dtype, "cpu", self.kv_cache)
        kv = getattr(kv, "kv", kv)  # a hybrid model's attention part
        return {"kv_cache_layers": kv.num_layers, "kv_cache_bytes_per_token": kv.bytes_per_token(),
                "kv_cache_bytes_per_token_layer": kv.bytes_per_token() // max(kv.num_layers, 1),
                "kv_cache_fixed_bytes": kv.fixed_bytes()}

    def info(self) -> dict:
        params, nbytes, kinds = 0, 0, {}

        def count(n, kind, nb):
            nonlocal params, nbytes
            params, nbytes = params + n, nbytes + nb
            kinds[kind] = kinds.get(kind, 0) + n

        for mod in self.module.modules():
            for w in (getattr(mod, "gate_up", None), getattr(mod, "down", None)):  # stacked MoE experts
                if isinstance(w, QuantizedTensor):
                    count(math.prod(w.shape), f"{w.bits}-bit affine, group {w.group_size}", w.nbytes)
                elif isinstance(w, torch.Tensor):
                    count(w.numel(), str(w.dtype).removeprefix("torch."), w.nbytes)
            if getattr(mod, "qweight", None) is not None:
                n = mod.out_features * mod.in_features
                kind = f"{mod.bits}-bit affine, group {mod.group_size}"
                nb = mod.qweight.nbytes + mod.scales.nbytes + mod.biases.nbytes
            elif isinstance(mod, (_WeightHolder, RMSNorm)) and mod.weight is not None:
                n, kind, nb = mod.weight.numel(), str(mod.weight.dtype).removeprefix("torch."), mod.weight.nbytes
            else:
                continue
            if mod is getattr(self.module, "lm_head", None) and self.config.tie_word_embeddings:
                continue
            count(n, kind, nb)
        return {"path": str(self.path), "format": self.format, "architecture": self.config.architecture,
                "config": dict(vars(self.config)), "parameters": params, "weight_bytes": nbytes,
                "weights_by_kind": kinds, "kv_cache": self.kv_cache, **self._kv_layout(),
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}
