"""The `sluice` command: run, chat, info, bench, serve, convert. Errors a user can cause print a message and exit with
status 2."""

from __future__ import annotations

import argparse
import json
import sys
import time

from sluice.cache import KV_CACHE_KINDS
from sluice.errors import SluiceError


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", "-m", default=None, help="GGUF file or model directory (default: the demo model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU)")
    _add_kv_cache_arg(p)
    p.add_argument("--dequantize", action="store_true",
                   help="hold quantized weights dense in memory (more memory; dense matmuls)")


def _add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temperature", "-t", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def _load(args, **options):
    import sluice

    return sluice.load(args.model, device=args.device, dtype=args.dtype, keep_quantized=not args.dequantize,
                       kv_cache=args.kv_cache, **options)


def cmd_run(args) -> int:
    from sluice.engine.sampling import SamplingParams

    SamplingParams(**_sampling(args)).validate()  # bad options fail before the model loads
    prompt = args.prompt if args.prompt is not None else (sys.stdin.read() if not sys.stdin.isatty() else "")
    model = _load(args)
    t0, n = time.perf_counter(), 0
    for piece in model.stream(prompt, max_tokens=args.max_tokens, chat=args.chat, system=args.system,
                              **_sampling(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
        n += 1
    sys.stdout.write("\n")
    if args.verbose:
        print(f"[{time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from sluice.engine.sampling import SamplingParams

    SamplingParams(**_sampling(args)).validate()
    model = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("sluice chat — empty line or Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in model.stream(messages, max_tokens=args.max_tokens, **_sampling(args)):
            sys.stdout.write(piece)
            sys.stdout.flush()
            reply.append(piece)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _add_kv_cache_arg(p):
    p.add_argument("--kv-cache", default="dense", choices=KV_CACHE_KINDS,
                   help="dense (the model's dtype) or turboquant4 (4-bit codes + a scale per vector, ~3.8x smaller)")


def cmd_info(args) -> int:
    import sluice

    model = sluice.load(args.model, device="cpu", kv_cache=args.kv_cache)
    info = model.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    c = info["config"]
    print(f"model:        {info['path']} ({info['format']})")
    print(f"architecture: {info['architecture']}: {c['num_layers']} layers, hidden {c['hidden_size']}, "
          f"{c['num_heads']} heads / {c['num_kv_heads']} kv heads of {c['head_dim']}, "
          f"MLP {c['intermediate_size']}, vocab {c['vocab_size']}, context {c['context_length']}")
    print(f"parameters:   {info['parameters'] / 1e6:.1f} M, {_human(info['weight_bytes'])} of weights in memory")
    for kind, n in sorted(info["weights_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:28s} {n / 1e6:8.1f} M params")
    kv = info["kv_cache_bytes_per_token"]
    kind = info["dtype"] if info["kv_cache"] == "dense" else info["kv_cache"]
    fixed = info["kv_cache_fixed_bytes"]
    print(f"KV cache:     {_human(kv)} per token ({kind}; {info['kv_cache_bytes_per_token_layer']} B per token in "
          f"each of {info['kv_cache_layers']} attention layers){f' + {_human(fixed)} fixed' if fixed else ''}; "
          f"full context {_human(kv * c['context_length'] + fixed)}")
    print(f"memory:       ~{_human(info['weight_bytes'] + kv * c['context_length'])} at full context")
    return 0


def cmd_bench(args) -> int:
    options = {"graphs": not args.no_graphs, "max_batch": max(args.batch, 1)}
    if args.load_format != "auto":
        options["load_format"] = args.load_format
    model = _load(args, **options)
    rows = []
    for kind in args.kv_cache_kinds or [args.kv_cache]:
        if kind != model.kv_cache:
            model = _with_engine_options(model, kv_cache=kind)
        rows.append(model.bench(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, batch=args.batch,
                                repeats=args.repeats))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    r0 = rows[0]
    print(f"{model.path.name} on {r0['device']} ({r0['dtype']}, {'CUDA graphs' if r0['graphs'] else 'eager'}): "
          f"batch {args.batch} of distinct {args.prompt_tokens}-token prompts, {args.gen_tokens} generated tokens "
          f"each, best of {args.repeats}")
    floor = "floor tok/s" if "floor_decode_tok_s" in r0 else ""
    print(f"{'KV cache':12s} {'TTFT cold s':>11s} {'TTFT warm s':>11s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
          f"{'per seq':>8s} {floor:>12s} {'KV B/token':>11s}")
    for r in rows:
        fl = f"{r['floor_decode_tok_s']:12.0f}" if floor else f"{'':12s}"
        print(f"{r['kv_cache']:12s} {r['ttft_cold_s']:11.3f} {r['ttft_warm_s']:11.3f} {r['prefill_tok_s']:14.1f} "
              f"{r['decode_tok_s']:13.1f} {r['decode_tok_s_per_seq']:8.1f} {fl} {r['kv_cache_bytes_per_token']:11d}")
    return 0


def cmd_serve(args) -> int:
    import os

    from sluice.server import ServerConfig, _require_server_packages, serve

    _require_server_packages()  # before the model loads
    api_key = args.api_key if args.api_key is not None else os.environ.get("SLUICE_API_KEY")
    config = ServerConfig(host=args.host, port=args.port, api_key=api_key, model_name=args.served_model_name,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)), log_level=args.log_level)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"sluice: warning: serving on {config.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    options = {"max_batch": args.max_batch, "graphs": not args.no_graphs}
    if args.load_format != "auto":
        options["load_format"] = args.load_format
    model = _load(args, **options)
    max_seq_len = args.max_seq_len or min(model.context_length, 4096)
    model = _with_engine_options(model, max_seq_len=max_seq_len)
    print(f"sluice: serving {model.path.name} on http://{config.host}:{config.port}/v1 ({args.max_batch} sequences "
          f"of up to {max_seq_len} positions{', API key required' if config.api_key else ''})", file=sys.stderr)
    serve(model, config)
    return 0


def _with_engine_options(model, **options):
    """The same weights with other engine settings (a new engine: its own cache pool and graphs)."""
    from dataclasses import replace

    from sluice.engine.model import Model

    return Model(model.module, model.tokenizer, model.path, model.format, model.device, model.dtype,
                 replace(model.engine_config, **options))


def cmd_convert(args) -> int:
    from sluice.formats.convert import convert

    out = convert(args.src, args.dst, bits=args.bits, group_size=args.group_size)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sluice", description="Run gated MoE language models from quantized weights.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate a continuation of a prompt")
    run.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    _add_model_args(run)
    _add_sampling_args(run)
    run.add_argument("--chat", action="store_true", help="apply the model's chat template")
    run.add_argument("--system", default=None, help="system message (with --chat)")
    run.add_argument("--verbose", "-v", action="store_true")
    run.set_defaults(func=cmd_run)
    chat = sub.add_parser("chat", help="interactive chat")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None)
    chat.set_defaults(func=cmd_chat)
    info = sub.add_parser("info", help="architecture, sizes, quantization, memory estimate")
    info.add_argument("model", nargs="?", default=None)
    info.add_argument("--json", action="store_true")
    _add_kv_cache_arg(info)
    info.set_defaults(func=cmd_info)
    bench = sub.add_parser("bench", help="prefill and decode speed, and KV-cache bytes per token")
    _add_model_args(bench)
    bench.add_argument("--prompt-tokens", type=int, default=512)
    bench.add_argument("--gen-tokens", type=int, default=64)
    bench.add_argument("--batch", type=int, default=1, help="sequences decoding together (distinct prompts)")
    bench.add_argument("--repeats", type=int, default=2)
    bench.add_argument("--load-format", default="auto", help="auto, or dummy: random weights at the shapes of "
                       "--model's config.json (a directory or a config.json file), made on the device")
    bench.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs), to compare")
    bench.add_argument("--compare-kv-caches", dest="kv_cache_kinds", action="store_const",
                       const=list(KV_CACHE_KINDS), help="one row per KV cache kind")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                         "/v1/models, /health)")
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but "
                     "/health (default: $SLUICE_API_KEY, else none)")
    srv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its file name)")
    srv.add_argument("--max-batch", type=int, default=16, help="sequences decoding together (cache rows)")
    srv.add_argument("--max-seq-len", type=int, default=None,
                     help="positions per sequence, prompt + output (default: the context window, at most 4096)")
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body accepted (413 beyond)")
    srv.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    srv.add_argument("--load-format", default="auto", help="auto, or dummy: random weights at the shapes of "
                     "--model's config.json, made on the device (to measure a model without downloading it)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(func=cmd_serve)
    conv = sub.add_parser("convert", help="HF checkpoint directory -> MLX-format quantized directory")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--bits", type=int, default=4)
    conv.add_argument("--group-size", type=int, default=64)
    conv.set_defaults(func=cmd_convert)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SluiceError as e:
        print(f"sluice: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
