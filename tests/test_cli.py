"""The `sluice` command on real checkpoints: run, chat, info."""

import json
import subprocess
import sys

import torch

from helpers import save_hf_dir, tiny_llama
from sluice.cli import main


def test_info_demo(demo_gguf_path, capsys):
    assert main(["info", str(demo_gguf_path)]) == 0
    out = capsys.readouterr().out
    assert "llama: 30 layers" in out and "4-bit affine, group 32" in out and "per token" in out
    assert main(["info", str(demo_gguf_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["num_layers"] == 30 and info["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 4


def test_run_hf_directory(tmp_path, capsys):
    d = save_hf_dir(tiny_llama(seed=4), tmp_path / "m")
    assert main(["run", "the cat", "--model", str(d), "--max-tokens", "5", "--temperature", "0"]) == 0
    assert main(["info", str(d)]) == 0
    assert "llama: 2 layers" in capsys.readouterr().out


def test_chat_keeps_the_conversation(demo_gguf_path):
    proc = subprocess.run([sys.executable, "-m", "sluice", "chat", "--model", str(demo_gguf_path), "--temperature",
                           "0", "--max-tokens", "24"], input="What is the capital of France?\nAnd of Italy?\n\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    replies = [line for line in proc.stdout.splitlines() if line.startswith("> ")]
    assert "Paris" in replies[0] and "Rome" in replies[1]  # the second answer needs the first turn's context


def test_run_reads_stdin(demo_gguf_path):
    proc = subprocess.run([sys.executable, "-m", "sluice", "run", "--model", str(demo_gguf_path), "--temperature",
                           "0", "--max-tokens", "8"], input="The capital of France is", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Paris" in proc.stdout


def test_bench_and_kv_cache_option(tmp_path, capsys):
    d = save_hf_dir(tiny_llama(seed=5), tmp_path / "m")
    assert main(["bench", "--model", str(d), "--prompt-tokens", "20", "--gen-tokens", "3", "--repeats", "1",
                 "--compare-kv-caches", "--no-overlap", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["kv_cache"] for r in rows] == ["dense", "turboquant4"]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    size = torch.tensor([], dtype=getattr(torch, rows[0]["dtype"])).element_size()  # fp32 on a CPU, bf16 on a GPU
    assert rows[0]["kv_cache_bytes_per_token_layer"] == 2 * 2 * 16 * size
    assert rows[1]["kv_cache_bytes_per_token_layer"] == 2 * 2 * 12
    assert rows[0]["kv_cache_fixed_bytes"] == 0 and rows[1]["kv_cache_fixed_bytes"] == 2 * 2 * 64 * 2 * 16 * size
    assert main(["bench", "--model", str(d), "--prompt-tokens", "0"]) == 2
    assert main(["info", str(d), "--kv-cache", "turboquant4"]) == 0
    assert "turboquant4; 48 B per token in each of 2 attention layers" in capsys.readouterr().out


def test_bench_prefill_chunk_options(tmp_path, capsys):
    d = save_hf_dir(tiny_llama(seed=5), tmp_path / "m")
    argv = ["bench", "--model", str(d), "--prompt-tokens", "20", "--gen-tokens", "2", "--repeats", "1", "--batch", "2"]
    assert main([*argv, "--prefill-chunk", "16", "--decode-prefill-chunk", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert (rows[0]["prefill_chunk"], rows[0]["decode_prefill_chunk"]) == (16, 4)
    assert main(argv) == 0  # the defaults, said in the header
    assert "prefill 512 tokens a step, 512 beside decodes" in capsys.readouterr().out
    assert main([*argv, "--decode-prefill-chunk", "0"]) == 2
    assert "decode_prefill_chunk=0" in capsys.readouterr().err
