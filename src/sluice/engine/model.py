"""The user-facing model: `sluice.load(path)` -> Model with .tokenizer, .generate, .stream, .logits, .engine."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from sluice.config import EngineConfig
from sluice.engine.batch import ForwardMeta
from sluice.engine.engine import Engine, GenerationError, check_prompt
from sluice.errors import InvalidOptionError, UnsupportedError
from sluice.layers.linear import RMSNorm, _WeightHolder
from sluice.quant.affine import QuantizedTensor


class Model:
    def __init__(self, module, tokenizer, path: Path, fmt: str, device: torch.device, dtype: torch.dtype,
                 config: EngineConfig):
        self.module, self.tokenizer, self.path, self.format = module, tokenizer, path, fmt
        self.config = module.cfg
        self.engine_config = config
        self.device, self.dtype = device, dtype
        self._engine = None
        self.mirror, self.key = None, 0  # tensor-parallel: the workers (`sluice/parallel/mirror.py`), this engine's key

    @property
    def placement(self):
        """Where the routed experts live when they stream (`sluice.experts.placement.Placement`), else None."""
        return getattr(self.module, "placement", None)

    @property
    def kv_cache(self) -> str:
        return self.engine_config.kv_cache

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def engine(self) -> Engine:
        """The batching engine (made on first use; one per model, its cache pool and graphs kept between calls)."""
        if self._engine is None:
            args = (self.module, self.tokenizer, self.engine_config, self.device, self.dtype)
            if self.mirror is None:
                self._engine = Engine(*args)
            else:
                from sluice.parallel.mirror import MirroredEngine

                self._engine = MirroredEngine(*args, mirror=self.mirror, key=self.key)
        return self._engine

    @property
    def tensor_parallel(self) -> int:
        """Ranks the weights are split across (`sluice.load(..., tensor_parallel=N)`)."""
        tp = getattr(self.module, "tp", None)
        return 1 if tp is None else tp.size

    def close(self) -> None:
        """Stop a tensor-parallel model's worker processes, for it and every model `with_engine` made from it
        (nothing to do for one process); a closed tensor-parallel model raises on use."""
        if self.mirror is not None:
            self.mirror.close()

    def with_engine(self, **options) -> "Model":
        """The same weights (shared, not copied) with other engine settings (`sluice.config.EngineConfig`: kv_cache,
        max_batch, max_seq_len, prefill_chunk, decode_prefill_chunk, graphs, graph_batch_sizes, graph_token_sizes,
        whole_graph_tokens, overlap, deterministic): a model
        with its own engine, cache pool and graphs."""
        from dataclasses import fields, replace

        unknown = sorted(set(options) - {f.name for f in fields(EngineConfig)})
        if unknown:
            raise InvalidOptionError(f"unknown engine option(s): {', '.join(unknown)}.")
        model = Model(self.module, self.tokenizer, self.path, self.format, self.device, self.dtype,
                      replace(self.engine_config, **options))
        if self.mirror is not None:  # the workers make the same engine over their shards, dropped with this one
            model.mirror, model.key = self.mirror, self.mirror.new_key()
            self.mirror.send("with_engine", self.key, model.key, options)
            weakref.finalize(model, self.mirror.drop, model.key)
        return model

    def new_cache(self, capacity: int, rows: int = 1):
        """Empty caches for `rows` sequences of up to `capacity` positions (the architecture decides the kinds)."""
        return self.module.new_cache(rows, capacity, self.dtype, self.device, self.kv_cache)

    @torch.inference_mode()
    def forward(self, ids, cache, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits (float32) of ids [B, T] at positions start.. of the sequences in cache rows 0..B-1, whose earlier
        positions are in `cache`; one token each (T = 1) is a decode step. One eager forward, for tests and tools:
        generation runs through `engine`."""
        if self.mirror is not None:
            raise UnsupportedError("Model.forward over caches of your own is not supported with tensor_parallel (the "
                                   "other ranks hold no such caches); use logits() or the engine.")
        return self._forward(ids, cache, start, last_only)

    @torch.inference_mode()
    def _forward(self, ids, cache, start: int, last_only: bool = False) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device)
        B, T = ids.shape
        if T == 1:
            meta = ForwardMeta.decode_host(list(range(B)), [start] * B, cache.visible, self.device)
        else:
            meta = ForwardMeta.prefill(0, B, start, T, self.device)
        return self.module(ids, cache, meta, self.dtype, last_only=last_only)

    # -- API ----------------------------------------------------------------------------------------------
    def logits(self, ids) -> torch.Tensor:
        """Float32 logits [B, T, vocab] of a full forward from empty caches (prefilled in chunks)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        for row in ids.tolist():
            check_prompt(row, self.config.vocab_size, self.context_length)
        cache = self.new_cache(ids.shape[1], rows=ids.shape[0])
        if self.mirror is not None:
            self.mirror.send("logits", self.key, ids.tolist())  # plain lists: no tensors over the connection
        step = self.engine_config.prefill_tokens(self.device)
        return torch.cat([self._forward(ids[:, s:s + step], cache, s).cpu() for s in range(0, ids.shape[1], step)],
                         dim=1)

    def encode_prompt(self, prompt, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or a list of chat messages ({role, content})."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not chat:
            return tok.encode(prompt)
        if isinstance(prompt, str):
            prompt = ([{"role": "system", "content": system}] if system else []) + \
                     [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):  # special tokens' texts inside the messages stay plain text
            return tok.encode_chat(prompt, add_generation_prompt=True)[1]
        return [int(t) for t in prompt]

    def _request(self, ids: list[int], max_tokens, **kwargs):
        """A request whose generation the context window ends (max_tokens clipped to it)."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise InvalidOptionError(f"max_tokens={max_tokens!r}: use a non-negative integer.")
        check_prompt(ids, self.config.vocab_size, self.context_length)
        engine = self.engine
        return engine.add_request(ids, max_tokens=min(max_tokens, engine.max_length - len(ids)), **kwargs)

    def generate_ids(self, ids: list[int], max_tokens: int = 256, stop_ids=None, **sampling) -> Iterator[int]:
        """Yield generated token ids (stops at an end-of-generation token, which is not yielded)."""
        for out in self._run_one(ids, max_tokens, stop_ids=stop_ids, **sampling):
            if out.token is not None:
                yield out.token

    def _run_one(self, ids, max_tokens, **kwargs):
        engine = self.engine
        seq = self._request(ids, max_tokens, **kwargs)
        try:
            while not seq.finished:
                for out in engine.step():
                    if out.seq is seq:
                        if seq.finish_reason == "error":
                            raise GenerationError(seq.error)
                        yield out
        finally:
            engine.abort(seq)

    def outputs(self, prompt, max_tokens: int = 256, chat: bool = False, system: str | None = None,
                stop=(), **sampling) -> Iterator:
        """Yield the request's `StepOutput`s (text, token, finished; `.seq` has finish_reason and max_tokens, which
        the context window may have lowered). NaN/inf logits raise a `GenerationError`."""
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        yield from self._run_one(ids, max_tokens, stop=stop, **sampling)

    def stream(self, prompt, max_tokens: int = 256, **kwargs) -> Iterator[str]:
        """Yield text pieces as they are decoded (whole UTF-8 characters only; `stop` strings end it, unshown)."""
        for out in self.outputs(prompt, max_tokens, **kwargs):
            if out.text:
                yield out.text

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> str:
        return "".join(self.stream(prompt, max_tokens=max_tokens, **kwargs))

    def generate_batch(self, prompts, max_tokens: int = 256, chat: bool = False, system: str | None = None,
                       stop=(), **sampling) -> list[str]:
        """The continuations of several prompts (strings, id lists or chat message lists), run in one engine: they
        share decode steps. Each prompt samples as it would alone (seeded: the same tokens)."""
        engine = self.engine
        seqs = [self._request(self.encode_prompt(p, chat=chat, system=system), max_tokens, stop=stop, **sampling)
                for p in prompts]
        texts = {s.id: [] for s in seqs}
        try:
            while not all(s.finished for s in seqs):
                for out in engine.step():
                    if out.seq.id in texts:
                        texts[out.seq.id].append(out.text)
        finally:
            for s in seqs:
                engine.abort(s)
        failed = [s.error for s in seqs if s.finish_reason == "error"]
        if failed:
            raise GenerationError("; ".join(failed))
        return ["".join(texts[s.id]) for s in seqs]

    def bench(self, **options) -> dict:
        """Prefill and decode speed (`engine/bench.py`)."""
        from sluice.engine.bench import bench

        return bench(self, **options)

    def _kv_layout(self) -> dict:
        """What the KV cache costs: bytes per token (all attention layers, and one), the fixed part."""
        kv = self.module.new_cache(1, 1, self.dtype, "meta", self.kv_cache).kv
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
            cache = getattr(mod, "expert_cache", None)  # streamed experts: count them where they all are
            stacked = (cache.experts if cache is not None
                       else (getattr(mod, "gate_up", None), getattr(mod, "down", None)))
            for w in stacked:  # stacked MoE experts
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
            head = getattr(self.module, "lm_head", None)
            if self.config.tie_word_embeddings and (mod is head or mod is getattr(head, "head", None)):
                continue  # (tensor-parallel: the head inside its wrapper)
            count(n, kind, nb)
        return {"path": str(self.path), "format": self.format, "architecture": self.config.architecture,
                "config": dict(vars(self.config)), "parameters": params, "weight_bytes": nbytes,
                "weights_by_kind": kinds, "kv_cache": self.kv_cache, **self._kv_layout(),
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "tensor_parallel": self.tensor_parallel,  # >1: parameters and bytes are rank 0's shard
                "expert_parallel": bool(getattr(getattr(self.module, "tp", None), "expert_parallel", False)),
                "placement": None if self.placement is None else self.placement.summary(),
                "memory_plan": self.engine.memory_plan()}
