"""The benchmarks, by name, and what a run writes.

Every benchmark is a function `main(argv: list[str] | None) -> dict` in a module of this package: it parses its own
options, measures, prints what a reader wants to see, and returns its figures (a JSON-able dict). The runner
(`python -m benchmarks run NAME`, `runner.py`) wraps the figures in one record, the same for every benchmark:

    {"benchmark", "date", "machine": {"host", "cpus"}, "gpu": name or null, "commit", "command", "args",
     "figures": {...}, "partial"?: true, "base"?: {"ref", "commit", "figures"}}

A benchmark whose figures say `"ok": false` (errors, mismatches) makes the run exit with status 1. A long benchmark
may call `checkpoint(figures)` after each step: the record so far is written (with "partial": true), so a run cut
short by a timeout keeps what it measured.

The table is static (names to module paths): `python -m benchmarks list` imports no benchmark, so no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Benchmark:
    name: str
    target: str  # "module:function" inside this package
    device: str  # "cpu", "gpu" or "cpu|gpu": where it runs
    summary: str
    pythonpath: tuple[str, ...] = field(default=())  # repository folders its module needs importable (tests/)

    def load(self) -> Callable[[list[str] | None], dict]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(f"benchmarks.{module}"), function or "main")


REGISTRY: dict[str, Benchmark] = {}


def register(name: str, target: str, device: str, summary: str, pythonpath: tuple[str, ...] = ()) -> None:
    if name in REGISTRY:
        raise ValueError(f"benchmark {name!r} registered twice")
    REGISTRY[name] = Benchmark(name, target, device, summary, tuple(pythonpath))


# -- end to end (what a user gets) ------------------------------------------------------------------------------------
register("serving_gpu", "serving_gpu:main", "gpu",
         "one process, dummy model of a real config: decode 1/16/64, prefill 4k/32k, closed 64 clients, burst, join; "
         "--policies, --baseline, --profile")
register("engine_gpu", "engine_gpu:main", "gpu",
         "Model.bench per KV kind and decode batch, graph replay alone, a step's anatomy, the HBM floor; --serial")
register("prefill_gpu", "prefill_gpu:main", "gpu", "TTFT and prefill tok/s by prefill chunk size; --profile")
register("long_prompt_join", "long_prompt_join:main", "gpu",
         "running decodes' step latency while a long prompt prefills beside them, per --decode-prefill-chunk")
register("paged_kv", "paged_kv:main", "cpu|gpu",
         "issue #41: many sequences of mixed lengths in a pool of KV blocks too small for all at once")
register("memory_budget", "memory_budget:main", "gpu",
         "issue #41: a model under --gpu-memory keeps its peak device memory within it: the plan and the readings")
register("agent_trace", "agent_trace:main", "cpu|gpu",
         "users in multi-turn chats behind one system prompt, with the prefix cache and without: hit rate, TTFT, "
         "whole time")
register("tp_gpu", "tp_gpu:main", "gpu",
         "issue #44: decode on 1 GPU and on N (tensor parallel): tok/s, per-GPU floor, time in collectives")
register("deepseek_gpu", "deepseek_gpu:main", "gpu",
         "issue #42: Moonlight decode with the fused chain off and on, its 4k prefill, DeepSeek-V3 per-layer times")
register("stream_gpu", "stream_gpu:main", "gpu", "expert streaming (host / disk) of a model larger than the GPU")
register("server_load", "server_load:main", "cpu|gpu",
         "N streaming clients against `sluice serve` on loopback (the demo model on the CPU, dummy weights on a GPU)")
register("soak", "soak:main", "cpu|gpu", "the server held for a long time: 8 request kinds, RSS quarters and slope")
register("hostile", "hostile:main", "cpu|gpu", "rounds of hostile requests, each followed by a normal one")
register("load_memory", "load_memory:main", "cpu|gpu",
         "host memory and time of loading a generated checkpoint (tests/test_load.py runs it small)")
register("cpu_speed", "cpu_speed:main", "cpu", "CPU prefill / decode tok/s vs llama.cpp on the demo GGUF")
register("llamacpp_agreement", "llamacpp_agreement:main", "cpu",
         "teacher-forced top-1 agreement and perplexity vs llama.cpp on the demo GGUF")
register("kv_quality", "kv_quality:main", "cpu|gpu",
         "perplexity, top-1 and KL of each KV cache kind against the dense one")
register("fuzz_campaign", "fuzz_campaign:main", "cpu",
         "a long fuzz campaign of the loaders (tests/test_fuzz.py's mutator and fork server)", pythonpath=("tests",))
# -- kernels (docs/PERF.md's kernel sections rely on these) -----------------------------------------------------------
register("qmatmul_gpu", "qmatmul_gpu:main", "gpu", "4-bit GEMV / GEMM vs cuBLAS bf16 and the copy-bandwidth floor")
register("moe_gpu", "moe_gpu:main", "gpu", "the MoE layer vs its floor: decode launches, sweeps, grouped prefill GEMM")
register("moe_mma_gpu", "moe_mma_gpu:main", "gpu",
         "issue #43: the experts by token count, GEMVs / Triton grouped / the CUDA tensor-core kernel vs the floor; "
         "the engine's decode and 4k prefill with the kernel and without")
register("attention_gpu", "attention_gpu:main", "gpu",
         "decode attention, dense bf16 and TurboQuant, vs SDPA and the copy floor; --sweep / --tq-sweep")
register("gdn_gpu", "gdn_gpu:main", "gpu", "Gated DeltaNet prefill / decode vs FLA, accuracy, per-kernel breakdown")
register("gdn_state_precision", "gdn_state_precision:main", "cpu",
         "issue #43: a GDN decode's state stored in bf16 (to nearest, stochastically) vs fp32, against fp64")
register("mla_gpu", "mla_gpu:main", "gpu",
         "MLA absorbed decode (latent cache) vs the torch path and the copy floor, Moonlight / V3 heads; --sweep")
# -- a smoke benchmark: the runner itself, on any machine -------------------------------------------------------------
register("tiny_cpu", "tiny:main", "cpu", "a tiny random Llama on the CPU: prefill and decode tok/s (the runner's test)")

_writer: Callable[[dict], None] | None = None


def checkpoint(figures: dict) -> None:
    """Write the record so far (marked partial) where the runner will write the final one; no-op outside a run."""
    if _writer is not None:
        _writer(figures)
