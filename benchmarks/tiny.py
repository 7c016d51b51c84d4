"""A tiny random Llama (dummy weights from a config alone) on the CPU: prefill and decode tok/s through `Model.bench`.
Seconds on any machine: what the runner's test runs, and a smoke test of the engine's path end to end.

    python -m benchmarks run tiny_cpu [--prompt-tokens 32] [--gen-tokens 8] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "torch_dtype": "float32"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    import sluice

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        model = sluice.load(d, load_format="dummy", device="cpu", max_batch=args.batch)
        r = model.bench(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, batch=args.batch, repeats=1)
    figures = {k: r.get(k) for k in ("batch", "prompt_tokens", "ttft_warm_s", "prefill_tok_s", "decode_tok_s")}
    print(json.dumps(figures))
    return figures
