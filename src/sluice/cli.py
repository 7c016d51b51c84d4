"""The `sluice` command: run, chat, info, bench, serve, convert. Errors a user can cause print a message and exit with
status 2."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from sluice.cache import KV_CACHE_KINDS
from sluice.errors import InvalidOptionError, ModelFileError, SluiceError


# sluice serve's default cache rows: a GPU serves many clients at once; on the CPU 16 rows of 4,096 fp32 positions of
# the demo model already hold 3 GB
SERVE_MAX_BATCH_GPU, SERVE_MAX_BATCH_CPU = 64, 16

def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", "-m", default=None, help="GGUF file or model directory (default: the demo model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU)")
    _add_kv_cache_arg(p)
    p.add_argument("--dequantize", action="store_true",
                   help="hold quantized weights dense in memory (more memory; dense matmuls)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: a prompt that begins with what an earlier request left "
                        "in the cache, such as a chat's history, starts from there)")
    p.add_argument("--kv-page", type=int, default=None, metavar="N",
                   help="positions a block of the paged KV cache holds, a multiple of 32 (default 256 on a GPU, "
                        "whole rows on the CPU; 0: whole rows)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="blocks of the paged KV cache (default: what the memory plan gives; `sluice info` prints it)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the weights across N processes, one GPU each (gloo ranks on the CPU; default 1)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel: split the routed experts whole across the ranks (default: each "
                        "expert's intermediate size split)")
    _add_placement_args(p)


def _add_placement_args(p: argparse.ArgumentParser):
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="device memory the model may use, e.g. 24GiB; routed experts that do not fit stay in host "
                        "memory and stream through a slot cache (default: the free GPU memory)")
    p.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="stream routed experts through N device slots per MoE layer, whatever the budget")
    p.add_argument("--expert-store", default="auto", choices=("auto", "host", "disk"),
                   help="where streamed experts stay: host memory when they fit there, else the checkpoint's files "
                        "(auto, the default), or always host / disk")


def _add_prefill_args(p: argparse.ArgumentParser):
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens a step's one forward takes at most when no sequence decodes "
                        "(default 4096 on a GPU, 512 on the CPU)")
    p.add_argument("--decode-prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens a step takes beside decoding sequences, which all wait for its forward: a "
                        "long prompt joining stalls them less (default 2048 on a GPU, 512 on the CPU; at most "
                        "--prefill-chunk)")


def _prefill_options(args) -> dict:
    """The prefill budgets given on the command line, as engine options (the others keep the engine's defaults)."""
    return {name: getattr(args, name) for name in ("prefill_chunk", "decode_prefill_chunk")
            if getattr(args, name) is not None}


def _add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--max-tokens", "-n", type=int, default=256,
                   help="most tokens to generate (default 256; the context window may end it sooner)")
    p.add_argument("--temperature", "-t", type=float, default=0.7, help="randomness (default 0.7; 0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the likeliest tokens whose probabilities sum to p (default 1 = all)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min-p times the likeliest (default 0 = none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already seen by this (default 1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling: the same seed, the same text")


def _sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def _load(args, **options):
    import sluice

    if args.no_prefix_cache:
        options["prefix_cache"] = False
    for name in ("kv_page", "kv_blocks"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    if getattr(args, "tensor_parallel", 1) != 1:
        options["tensor_parallel"] = args.tensor_parallel
    if getattr(args, "expert_parallel", False):
        options["expert_parallel"] = True
    return sluice.load(args.model, device=args.device, dtype=args.dtype, keep_quantized=not args.dequantize,
                       kv_cache=args.kv_cache, gpu_memory=args.gpu_memory, expert_slots=args.expert_slots,
                       expert_store=args.expert_store, **options)


def utf8_text(text: str, what: str) -> str:
    """Text from the command line or standard input, where Python keeps bytes that are not UTF-8 as lone surrogates
    (U+DC80-U+DCFF): refused, naming the first such byte."""
    bad = next((i for i, c in enumerate(text) if "\udc80" <= c <= "\udcff"), None)
    if bad is not None:
        raise InvalidOptionError(f"{what} is not valid UTF-8 (byte 0x{ord(text[bad]) - 0xDC00:02x} at character "
                                 f"{bad}); convert it first, e.g. iconv -f latin1 -t utf-8.")
    return text


def cmd_run(args) -> int:
    from sluice.engine.sampling import SamplingParams

    SamplingParams(**_sampling(args)).validate()  # bad options fail before the model loads
    if args.system is not None and not args.chat:
        raise InvalidOptionError("--system needs --chat: the system message is part of the chat template. Add "
                                 "--chat, or write the instruction into the prompt.")
    if args.prompt is not None:
        prompt = utf8_text(args.prompt, "the prompt")
    else:
        prompt = utf8_text(sys.stdin.read(), "standard input") if not sys.stdin.isatty() else ""
    system = utf8_text(args.system, "--system") if args.system is not None else None
    model = _load(args)
    t0, seq = time.perf_counter(), None
    for out in model.outputs(prompt, max_tokens=args.max_tokens, chat=args.chat, system=system,
                             **_sampling(args)):
        sys.stdout.write(out.text)
        sys.stdout.flush()
        seq = out.seq
    sys.stdout.write("\n")
    sys.stdout.flush()
    note_context_end(model, seq, args.max_tokens)
    if args.verbose:
        print(f"[{time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return 0


def note_context_end(model, seq, max_tokens: int) -> None:
    """Say so when the context window, not --max-tokens or a stop, ended the generation."""
    if seq is not None and seq.finish_reason == "length" and seq.max_tokens < max_tokens:
        print(f"sluice: stopped after {len(seq.output)} tokens: the context window ({model.engine.max_length} "
              f"positions, {len(seq.prompt)} of them the prompt) is full; --max-tokens {max_tokens} was not reached.",
              file=sys.stderr)


def cmd_chat(args) -> int:
    from sluice.chat import chat
    from sluice.engine.sampling import SamplingParams

    SamplingParams(**_sampling(args)).validate()
    system = utf8_text(args.system, "--system") if args.system is not None else None
    return chat(_load(args), system, args.max_tokens, _sampling(args))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _add_kv_cache_arg(p):
    p.add_argument("--kv-cache", default="dense", choices=KV_CACHE_KINDS,
                   help="dense (the model's dtype) or turboquant4 (4-bit codes + a scale per vector, ~3.8x smaller)")


def _count(n: float) -> str:
    """A parameter count: 12.3 M, 45.6 K or 789 (never 0.0 M)."""
    for scale, unit in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def cmd_info(args) -> int:
    import sluice

    if args.model and args.model_opt and args.model != args.model_opt:
        raise InvalidOptionError(f"two models given ({args.model} and --model {args.model_opt}); give one.")
    model = sluice.load(args.model or args.model_opt, device="cpu", kv_cache=args.kv_cache,
                        gpu_memory=args.gpu_memory, expert_slots=args.expert_slots, expert_store=args.expert_store)
    info = model.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    c = info["config"]
    print(f"model:        {info['path']} ({info['format']})")
    print(f"architecture: {info['architecture']}: {c['num_layers']} layers, hidden {c['hidden_size']}, "
          f"{c['num_heads']} heads / {c['num_kv_heads']} kv heads of {c['head_dim']}, "
          f"MLP {c['intermediate_size']}, vocab {c['vocab_size']}, context {c['context_length']}")
    if hasattr(model.config, "describe"):  # the architecture's own shape line (MLA + DeepSeekMoE)
        print(f"              {model.config.describe()}")
    print(f"parameters:   {_count(info['parameters'])}, {_human(info['weight_bytes'])} of weights in memory")
    for kind, n in sorted(info["weights_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:28s} {_count(n):>9s} params")
    kv = info["kv_cache_bytes_per_token"]
    kind = info["dtype"] if info["kv_cache"] == "dense" else info["kv_cache"]
    kind = f"latent, {kind}" if hasattr(model.config, "kv_lora_rank") else kind
    fixed = info["kv_cache_fixed_bytes"]
    print(f"KV cache:     {_human(kv)} per token ({kind}; {info['kv_cache_bytes_per_token_layer']} B per token in "
          f"each of {info['kv_cache_layers']} attention layers){f' + {_human(fixed)} fixed' if fixed else ''}; "
          f"full context {_human(kv * c['context_length'] + fixed)}")
    print(f"memory:       ~{_human(info['weight_bytes'] + kv * c['context_length'])} at full context")
    if info.get("placement"):
        print(f"placement:    {_placement_line(info['placement'])}")
    plan = info["memory_plan"]
    print(f"memory plan:  {model.engine_config.max_batch} sequences of up to {model.engine.max_length} positions "
          f"(--max-batch, --max-seq-len of serve): " + (plan["error"] if "error" in plan else ""))
    for line in plan.get("lines", ()):
        print(f"  {line}")
    return 0


def _placement_line(p: dict) -> str:
    hit = "" if p["hit_rate"] is None else f"; hit rate {100 * p['hit_rate']:.1f} % (distinct experts a step)"
    where = "on disk" if p["store"] == "disk" else "in host memory"
    return (f"{p['slots_per_layer']} of {p['experts_per_layer']} routed experts a layer in device slots "
            f"({_human(p['slot_bytes'])}), all {_human(p['host_expert_bytes'])} {where}; "
            f"{_human(p['resident_bytes'])} resident{hit}")


def cmd_bench(args) -> int:
    options = {"graphs": not args.no_graphs, "max_batch": max(args.batch, 1), **_prefill_options(args)}
    if args.no_overlap:
        options["overlap"] = False
    if args.deterministic:
        options["deterministic"] = True
    if args.load_format != "auto":
        options["load_format"] = args.load_format
    _progress(f"loading {args.model or 'the demo model'}")
    t0 = time.perf_counter()
    model = _load(args, **options)
    _progress(f"loaded in {time.perf_counter() - t0:.1f} s")
    rows = []
    for kind in args.kv_cache_kinds or [args.kv_cache]:
        if kind != model.kv_cache:
            model = model.with_engine(kv_cache=kind)
        _progress(f"{kind} KV cache: {args.repeats} runs of batch {args.batch}, {args.prompt_tokens} prompt + "
                  f"{args.gen_tokens} generated tokens each")
        t0 = time.perf_counter()
        rows.append(model.bench(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, batch=args.batch,
                                repeats=args.repeats, temperature=args.temperature))
        rows[-1].update(prefill_chunk=model.engine_config.prefill_tokens(model.device),
                        decode_prefill_chunk=model.engine_config.prefill_tokens(model.device, decoding=True))
        _progress(f"{kind} KV cache: done in {time.perf_counter() - t0:.1f} s")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    r0 = rows[0]
    print(f"{model.path.name} on {r0['device']} ({r0['dtype']}, {'CUDA graphs' if r0['graphs'] else 'eager'}): "
          f"batch {args.batch} of distinct {args.prompt_tokens}-token prompts, {args.gen_tokens} generated tokens "
          f"each, best of {args.repeats}; prefill {r0['prefill_chunk']} tokens a step, {r0['decode_prefill_chunk']} "
          "beside decodes")
    floor = "floor tok/s" if "floor_decode_tok_s" in r0 else ""
    print(f"{'KV cache':12s} {'TTFT cold s':>11s} {'TTFT warm s':>11s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
          f"{'per seq':>8s} {floor:>12s} {'KV B/token':>11s}")
    for r in rows:
        fl = f"{r['floor_decode_tok_s']:12.0f}" if floor else f"{'':12s}"
        decode = (f"{r['decode_tok_s']:13.1f} {r['decode_tok_s_per_seq']:8.1f}" if r["decode_tok_s"] is not None
                  else f"{'no steady':>13s} {'window':>8s}")
        print(f"{r['kv_cache']:12s} {r['ttft_cold_s']:11.3f} {r['ttft_warm_s']:11.3f} {r['prefill_tok_s']:14.1f} "
              f"{decode} {fl} {r['kv_cache_bytes_per_token']:11d}")
    if any(r["decode_tok_s"] is None for r in rows):
        print("no steady window: the sequences never all decoded together (a sequence ended before the last prompt "
              "was in); raise --gen-tokens or the positions a sequence may hold")
    for r in rows:
        if r.get("placement"):
            print(f"placement ({r['kv_cache']}): {_placement_line(r['placement'])}")
    return 0


def _progress(message: str) -> None:
    print(f"sluice: bench: {message}", file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    from sluice.server import ServerConfig, _require_server_packages, serve

    _require_server_packages()  # before the model loads
    if args.max_seq_len is not None and args.max_seq_len < 1:
        raise InvalidOptionError(f"--max-seq-len {args.max_seq_len}: use a positive number of positions (default: "
                                 "the context window, at most 4096).")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb * (1 << 20) >= 1):
        raise InvalidOptionError(f"--max-body-mb {args.max_body_mb:g}: use a positive number of MiB (default 8).")
    api_key = args.api_key if args.api_key is not None else os.environ.get("SLUICE_API_KEY")
    config = ServerConfig(host=args.host, port=args.port, api_key=api_key, model_name=args.served_model_name,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)), read_timeout=args.read_timeout,
                          max_connections=args.max_connections, allow_special_tokens=args.allow_special_tokens,
                          log_level=args.log_level)
    from sluice.parallel.launch import torchrun

    if (torchrun() or (0,))[0] == 0:  # under torchrun the other ranks serve rank 0 and never listen
        _check_port(config.host, config.port)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"sluice: warning: serving on {config.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    if args.max_batch is not None and args.max_batch < 1:
        raise InvalidOptionError(f"--max-batch {args.max_batch}: use a positive number of sequences (default: 64 on "
                                 "a GPU, 16 on the CPU).")
    options = {"graphs": not args.no_graphs, **_prefill_options(args)}
    if args.no_overlap:
        options["overlap"] = False
    if args.deterministic:
        options["deterministic"] = True
    if args.load_format != "auto":
        options["load_format"] = args.load_format
    model = _load(args, **options)
    if args.max_seq_len is not None and args.max_seq_len > model.context_length:
        raise InvalidOptionError(f"--max-seq-len {args.max_seq_len} is more than the model's context window "
                                 f"({model.context_length} positions); use at most {model.context_length}.")
    max_seq_len = args.max_seq_len or min(model.context_length, 4096)
    max_batch = args.max_batch or (SERVE_MAX_BATCH_GPU if model.device.type == "cuda" else SERVE_MAX_BATCH_CPU)
    model = model.with_engine(max_seq_len=max_seq_len, max_batch=max_batch)
    print(f"sluice: serving {model.path.name} on http://{config.host}:{config.port}/v1 ({max_batch} sequences "
          f"of up to {max_seq_len} positions{', API key required' if config.api_key else ''})", file=sys.stderr)
    serve(model, config)
    return 0


def _check_port(host: str, port: int) -> None:
    """Fail before the model loads when the address cannot be listened on (a port in use, a bad host)."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except (OSError, ValueError, OverflowError) as e:  # in use, unknown host, a host name that is not one
        raise InvalidOptionError(f"cannot listen on {host}:{port} ({getattr(e, 'strerror', None) or e}); choose "
                                 "another --port or --host.") from None


def cmd_convert(args) -> int:
    from pathlib import Path

    from sluice.formats.convert import convert

    src = Path(args.src)
    if not src.exists():
        raise ModelFileError(f"{src} does not exist: give the directory of an HF checkpoint (config.json, "
                             "*.safetensors, tokenizer.json).")
    if src.is_file():
        kind = "a GGUF file" if src.suffix.lower() == ".gguf" else "a file"
        raise ModelFileError(f"{src} is {kind}; sluice convert reads an HF checkpoint directory (Qwen3-Next or "
                             f"Qwen3.5/3.6-MoE). A GGUF file needs no conversion: sluice run --model {src}")
    out = convert(args.src, args.dst, bits=args.bits, group_size=args.group_size)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import sluice

    ap = argparse.ArgumentParser(prog="sluice", description="Run gated MoE language models from quantized weights.")
    ap.add_argument("--version", action="version", version=f"sluice {sluice.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate a continuation of a prompt")
    run.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    _add_model_args(run)
    _add_sampling_args(run)
    run.add_argument("--chat", action="store_true", help="apply the model's chat template")
    run.add_argument("--system", default=None, help="system message (with --chat)")
    run.add_argument("--verbose", "-v", action="store_true", help="print the time taken to standard error")
    run.set_defaults(func=cmd_run)
    chat = sub.add_parser("chat", help="interactive chat")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message, kept when old turns are dropped")
    chat.set_defaults(func=cmd_chat)
    info = sub.add_parser("info", help="architecture, sizes, quantization, memory estimate")
    info.add_argument("model", nargs="?", default=None, help="GGUF file or model directory (or --model)")
    info.add_argument("--model", "-m", dest="model_opt", default=None,
                      help="GGUF file or model directory (default: the demo model)")
    info.add_argument("--json", action="store_true", help="print everything as JSON")
    _add_kv_cache_arg(info)
    _add_placement_args(info)
    info.set_defaults(func=cmd_info)
    bench = sub.add_parser("bench", help="prefill and decode speed, and KV-cache bytes per token")
    _add_model_args(bench)
    bench.add_argument("--prompt-tokens", type=int, default=512, help="tokens in each random prompt (default 512)")
    bench.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per sequence (default 64)")
    bench.add_argument("--batch", type=int, default=1, help="sequences decoding together (distinct prompts)")
    bench.add_argument("--repeats", type=int, default=2, help="runs; the best counts (default 2)")
    bench.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, seeded per sequence "
                       "(default 1; 0 = greedy, which with random weights routes to few experts)")
    bench.add_argument("--load-format", default="auto", help="auto, or dummy: random weights at the shapes of "
                       "--model's config.json (a directory or a config.json file), made on the device")
    _add_prefill_args(bench)
    bench.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs), to compare")
    bench.add_argument("--deterministic", action="store_true",
                       help="batch-invariant outputs on a GPU: decode steps at the full batch, each prompt prefilled "
                          "alone (slower; see EngineConfig.deterministic)")
    bench.add_argument("--no-overlap", action="store_true", help="read each decode step back before launching the "
                       "next (on a GPU the next is launched first), to compare")
    bench.add_argument("--compare-kv-caches", dest="kv_cache_kinds", action="store_const",
                       const=list(KV_CACHE_KINDS), help="one row per KV cache kind")
    bench.add_argument("--json", action="store_true", help="print the rows as JSON")
    bench.set_defaults(func=cmd_bench)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                         "/v1/models, /health)")
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but "
                     "/health (default: $SLUICE_API_KEY, else none)")
    srv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its file name)")
    srv.add_argument("--max-batch", type=int, default=None,
                     help=f"sequences decoding together, cache rows (default: {SERVE_MAX_BATCH_GPU} on a GPU, "
                          f"{SERVE_MAX_BATCH_CPU} on the CPU, whose caches are fp32)")
    srv.add_argument("--max-seq-len", type=int, default=None,
                     help="positions per sequence, prompt + output (default: the context window, at most 4096)")
    _add_prefill_args(srv)
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body accepted (413 beyond)")
    srv.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                     help="seconds a client has to send a request's headers, then its body (default 30)")
    srv.add_argument("--max-connections", type=int, default=1024, metavar="N",
                     help="open connections at most; one more is answered 503 (default 1024)")
    srv.add_argument("--allow-special-tokens", action="store_true",
                     help="read special-token texts such as <|im_start|> in chat messages as the tokens themselves "
                          "(default: as plain text, so a message cannot open a turn of another role)")
    srv.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    srv.add_argument("--deterministic", action="store_true",
                     help="batch-invariant outputs on a GPU: decode steps at the full batch, each prompt prefilled "
                          "alone (slower; see EngineConfig.deterministic)")
    srv.add_argument("--no-overlap", action="store_true", help="read each decode step back before launching the next")
    srv.add_argument("--load-format", default="auto", help="auto, or dummy: random weights at the shapes of "
                     "--model's config.json, made on the device (to measure a model without downloading it)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="server log detail (default info)")
    srv.set_defaults(func=cmd_serve)
    conv = sub.add_parser("convert", help="HF checkpoint directory -> MLX-format quantized directory (Qwen3-Next "
                          "and Qwen3.5/3.6-MoE only; other models run from their HF directory or a GGUF)")
    conv.add_argument("src", help="HF checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    conv.add_argument("dst", help="output directory (must not exist)")
    # the values sluice.quant.affine supports (SUPPORTED_BITS, SUPPORTED_GROUP_SIZES); convert checks them too
    conv.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8), metavar="{2,3,4,5,6,8}",
                      help="bits per weight: 2, 3, 4, 5, 6 or 8 (default 4; router gates stay at 8)")
    conv.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), metavar="{32,64,128}",
                      help="weights sharing one scale and bias: 32, 64 or 128 (default 64)")
    conv.set_defaults(func=cmd_convert)
    return ap


def _usable_home() -> None:
    """$SLUICE_HOME (default ~/.cache/sluice) holds the demo model and the compiled kernels: when it cannot be written,
    use a directory under the system's temporary one for this run, and say so."""
    import tempfile
    from pathlib import Path

    from sluice.formats.demo import cache_dir

    home = cache_dir()
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK | os.X_OK):
            return
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"sluice-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    print(f"sluice: warning: cannot write to {home} (SLUICE_HOME): using {fallback} for this run. Set SLUICE_HOME to "
          "a writable directory to keep the demo model and compiled kernels.", file=sys.stderr)
    os.environ["SLUICE_HOME"] = str(fallback)


def _stdout_gone() -> int:
    """The reader of standard output went away (`sluice ... | head`): stop quietly, as a Unix tool does."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush then writes nowhere
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a tool that SIGPIPE ended


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach utf8_text, which names them
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        _usable_home()
        status = args.func(args)
        sys.stdout.flush()
        return status
    except SluiceError as e:
        print(f"sluice: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _stdout_gone()


if __name__ == "__main__":
    sys.exit(main())
