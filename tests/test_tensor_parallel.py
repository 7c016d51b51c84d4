"""Tensor parallelism on the CPU (gloo ranks, `sluice.parallel`): Llama, Qwen3-Next and DeepSeek-V3 split across 2
and 4 processes give the logits of one process within fp32 tolerance and the same tokens, greedy and sampled, batched
through the engine in lockstep; quantized weights split on their groups; what cannot split is a clear error."""

import os

import pytest
import torch
from helpers import rel, save_llama_gguf, tiny_llama

import sluice

PROMPTS = [[1, 5, 9, 200, 17, 3, 44, 120], [7, 7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def tokens(model, **sampling):
    """Each prompt's 10 tokens, the three batched in one engine."""
    engine = model.engine
    seqs = [engine.add_request(p, max_tokens=10, stop_ids=(), **sampling) for p in PROMPTS]
    engine.run(seqs)
    return [s.output for s in seqs]


def same_as_one(split, one, prompt=PROMPTS[2], seed=5, tol=1e-5):
    """The split model's logits of `prompt` within `tol` of one process's, and the same greedy and seeded-sampled
    tokens through the batched engine."""
    ids = torch.tensor([prompt])
    assert rel(split.logits(ids), one.logits(ids)) < tol
    assert tokens(split, temperature=0.0) == tokens(one, temperature=0.0)
    assert tokens(split, temperature=1.0, seed=seed) == tokens(one, temperature=1.0, seed=seed)


@pytest.fixture(scope="module")
def one(llama_dir):
    return sluice.load(llama_dir, device="cpu")


@pytest.mark.parametrize("size", [2, 4])
def test_llama_split_gives_the_logits_and_tokens_of_one_process(llama_dir, one, size):
    """4 query heads and 2 KV heads: at 2 ranks each holds 2 and 1, at 4 ranks one query head each and the KV
    heads replicated (ranks 0-1 read KV head 0, ranks 2-3 head 1); the MLP and the vocabulary split."""
    threads = torch.get_num_threads()
    tp = sluice.load(llama_dir, device="cpu", tensor_parallel=size)
    try:
        assert tp.tensor_parallel == size and tp.module.layers[0].attn.num_heads == 4 // size
        if "OMP_NUM_THREADS" not in os.environ:  # the ranks share the cores; close() gives rank 0's back
            assert torch.get_num_threads() == max(1, threads // size)
        ids = torch.tensor([PROMPTS[0]])
        assert rel(tp.logits(ids), one.logits(ids)) < 1e-5
        assert tokens(tp, temperature=0.0) == tokens(one, temperature=0.0)
        assert tokens(tp, temperature=1.0, seed=3) == tokens(one, temperature=1.0, seed=3)
        other = tp.with_engine(max_batch=2, prefix_cache=False)  # another engine over the same shards
        assert tokens(other, temperature=0.0) == tokens(one, temperature=0.0)
        seq = tp.engine.add_request(PROMPTS[1], max_tokens=50, stop_ids=())  # an abort reaches every rank
        tp.engine.step()
        tp.engine.abort(seq)
        assert tokens(tp, temperature=0.0) == tokens(one, temperature=0.0)
        if size == 2:  # bench passes clear the prefix cache on every rank; a forward over caches of one's own is
            tp.bench(prompt_tokens=20, gen_tokens=3, batch=2, repeats=2, temperature=0.0)  # refused
            assert tokens(tp, temperature=0.0) == tokens(one, temperature=0.0)
            with pytest.raises(sluice.SluiceError, match="tensor_parallel"):
                tp.forward([[1, 2]], tp.new_cache(8), 0)
    finally:
        tp.close()
    assert torch.get_num_threads() == threads
    with pytest.raises(sluice.SluiceError, match="closed"):
        tp.generate("hi", max_tokens=2)


def test_quantized_weights_split_on_their_groups(tmp_path):
    """A 4-bit GGUF (Q4_0: groups of 32, Q/K rows permuted the llama.cpp way): output rows and input groups split;
    the logits of one process."""
    import gguf

    model = tiny_llama(seed=4, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = save_llama_gguf(model, tmp_path / "q4.gguf", qtype=gguf.GGMLQuantizationType.Q4_0)
    ids = torch.tensor([PROMPTS[2]])
    tp = sluice.load(path, device="cpu", tensor_parallel=2)
    try:
        assert tp.module.layers[0].down.linear.quantized
        assert rel(tp.logits(ids), sluice.load(path, device="cpu").logits(ids)) < 1e-5
    finally:
        tp.close()


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    """A tiny Qwen3-Next whose linear-attention heads split four ways (4 key heads, 8 value heads), 2 KV heads."""
    from test_qwen3_next import qwen3_next, save

    return save(qwen3_next(seed=6, linear_num_key_heads=4, linear_num_value_heads=8), tmp_path_factory.mktemp("q4"))


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3"])
@pytest.mark.parametrize("size", [2, 4])
def test_hybrid_and_mla_splits_give_the_logits_and_tokens_of_one_process(qwen4, deepseek_dir, arch, size):
    """Qwen3-Next: Gated DeltaNet by key heads (with their value heads, conv channels, A and dt), the gated attention
    by heads (KV replicated at 4), the recurrent states per rank. DeepSeek-V3: MLA by heads (q or q_b, kv_b, o_proj),
    the latent and its cache whole on every rank, the dense first layer. Both: every routed and shared expert's
    intermediate size split, the router whole, the MoE's partial sums summed once."""
    path = qwen4 if arch == "qwen3_next" else deepseek_dir
    one = sluice.load(path, device="cpu")
    tp = sluice.load(path, device="cpu", tensor_parallel=size)
    try:
        same_as_one(tp, one)
        assert tokens(tp, temperature=0.0) == tokens(one, temperature=0.0)  # again: from the prefix cache
    finally:
        tp.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3"])
def test_expert_parallel_gives_the_logits_and_tokens_of_one_process(qwen4, deepseek_dir, arch):
    """The routed experts split whole across 2 ranks (each runs its own and a zero expert for the rest; the
    all-reduce after the block sums them), the shared experts split by intermediate size as in tensor parallel."""
    path = qwen4 if arch == "qwen3_next" else deepseek_dir
    one = sluice.load(path, device="cpu")
    ep = sluice.load(path, device="cpu", tensor_parallel=2, expert_parallel=True)
    try:
        moe = next(m for m in ep.module.modules() if hasattr(m, "held"))
        E = moe.num_experts
        assert moe.held == (0, E // 2) and moe.gate_up.shape[0] == E // 2 + 1 and ep.info()["expert_parallel"]
        same_as_one(ep, one)
    finally:
        ep.close()


def test_split_with_streamed_experts(tmp_path):
    """Each rank streams its slices of the experts from host memory through its own slot cache (6 slots for 16
    experts: misses and evictions), in lockstep: the logits and tokens of one process holding every expert."""
    from sluice.formats.convert import convert
    from test_qwen3_next import qwen3_next, save

    src = save(qwen3_next(seed=21, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64), tmp_path / "hf")
    path = convert(src, tmp_path / "mlx", bits=4, group_size=32, quiet=True)
    one = sluice.load(path, device="cpu")
    tp = sluice.load(path, device="cpu", tensor_parallel=2, expert_slots=6)
    try:
        assert tp.placement is not None and tp.info()["placement"]["slots_per_layer"] == 6
        same_as_one(tp, one, PROMPTS[0], seed=2)
    finally:
        tp.close()


def test_close_ends_a_stuck_worker(llama_dir):
    """A worker that does not answer (stopped here; on a GPU, one waiting in a collective of a step rank 0 left at a
    Ctrl-C) is terminated, then killed, within seconds, not left behind."""
    import os
    import signal
    import time

    tp = sluice.load(llama_dir, device="cpu", tensor_parallel=2)
    worker = tp.mirror.procs[0]
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    tp.close()
    assert worker.poll() is not None and time.monotonic() - t0 < 20


def test_what_cannot_split_is_a_clear_error(llama_dir, qwen_dir):
    with pytest.raises(sluice.SluiceError, match="3 equal parts"):  # 4 heads
        sluice.load(llama_dir, device="cpu", tensor_parallel=3)
    with pytest.raises(sluice.SluiceError, match="host memory only"):
        sluice.load(qwen_dir, device="cpu", tensor_parallel=2, expert_store="disk")
    with pytest.raises(sluice.SluiceError, match="not with expert_parallel"):
        sluice.load(qwen_dir, device="cpu", tensor_parallel=2, expert_parallel=True, expert_slots=6)
    with pytest.raises(sluice.SluiceError, match="positive integer"):
        sluice.load(llama_dir, device="cpu", tensor_parallel=0)
    with pytest.raises(sluice.SluiceError, match="give tensor_parallel"):
        sluice.load(qwen_dir, device="cpu", expert_parallel=True)


def test_the_server_answers_from_a_split_model(llama_dir, one):
    """`sluice serve` over a model split across 2 ranks (its engine thread steps them all), through the real `openai`
    client: concurrent greedy replies are each one's alone."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from sluice.server import Server, ServerConfig

    tp = sluice.load(llama_dir, device="cpu", tensor_parallel=2, max_seq_len=256, max_batch=4)
    try:
        with Server(tp, ServerConfig(port=0, log_level="warning")) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
            name = client.models.list().data[0].id

            def complete(prompt):
                return client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

            prompts = ["hello", "the river", "a b c d e f"]
            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(complete, prompts))
            assert got == [one.generate(p, max_tokens=8, temperature=0) for p in prompts]
    finally:
        tp.close()


def test_torchrun_starts_the_same_ranks(llama_dir, one):
    """Under torchrun (one node, two processes: the multi-node path, each rank's device by LOCAL_RANK) every process
    runs the same `sluice run`; rank 0 prints the text of one process, the other rank serves it and exits."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sluice", "run", "-m", str(llama_dir), "--device", "cpu", "--tensor-parallel", "2",
           "-n", "8", "-t", "0", "hello"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == one.generate("hello", max_tokens=8, temperature=0).strip()
    bad = subprocess.run(cmd[:5] + ["1"] + cmd[6:], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert bad.returncode != 0 and "torchrun started 1 processes" in bad.stderr
    unsplit = subprocess.run(cmd[:cmd.index("--tensor-parallel")] + cmd[cmd.index("--tensor-parallel") + 2:],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
    assert unsplit.returncode != 0 and "give --tensor-parallel 2" in unsplit.stderr


def _small_config(tmp_path, name: str, **over) -> str:
    """A real config (benchmarks/configs) made small: its layer kinds, quantization and head dims kept."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).parent.parent / "benchmarks" / "configs" / name).read_text())
    text = cfg.get("text_config", cfg)  # (Qwen3.5's text model inside its multimodal config)
    text.update(over)
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:text["num_hidden_layers"]]
    d = tmp_path / name.removesuffix(".json")
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name,over", [
    ("qwen3-next-80b-a3b.json", dict(num_hidden_layers=4, hidden_size=512, num_experts=32, vocab_size=4096,
                                     moe_intermediate_size=256, shared_expert_intermediate_size=256)),
    ("moonlight-16b-a3b.json", dict(num_hidden_layers=3, hidden_size=512, n_routed_experts=16, vocab_size=4096,
                                    intermediate_size=1024, moe_intermediate_size=256)),
    ("qwen3.5-397b-a17b.json", dict(num_hidden_layers=4, hidden_size=512, num_experts=32, vocab_size=4096)),
])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_split_on_two_gpus_gives_the_logits_and_tokens_of_one(tmp_path, name, over, expert_parallel):
    """4-bit dummy weights of a real config's layout, fp32 activations, on cuda:0 alone and split over cuda:0 and
    cuda:1 (NCCL, the Triton kernels, decode steps replayed as CUDA graphs with their all-reduces inside); the
    experts split by intermediate size or whole."""
    path = _small_config(tmp_path, name, **over)
    one = sluice.load(path, load_format="dummy", device="cuda", dtype="float32", max_batch=4)
    tp = sluice.load(path, load_format="dummy", device="cuda", dtype="float32", max_batch=4, tensor_parallel=2,
                     expert_parallel=expert_parallel)
    try:
        assert tp.engine.runner.uses_graphs
        same_as_one(tp, one, tol=1e-4)
    finally:
        tp.close()


def test_rank_0_drops_connections_without_the_key():
    """Under torchrun rank 0 accepts its workers on a TCP port: a connection that sends garbage or says nothing is
    dropped (the latter after the handshake's timeout), a worker with the key gets through, and its commands then
    wait as long as they need."""
    import os
    import socket
    import threading
    import time
    from multiprocessing.connection import Client

    from sluice.parallel.launch import _accept

    key = os.urandom(32)
    with socket.create_server(("127.0.0.1", 0), backlog=4) as server:
        server.settimeout(20)
        port = server.getsockname()[1]
        silent = socket.create_connection(("127.0.0.1", port))
        garbage = socket.create_connection(("127.0.0.1", port))
        garbage.sendall(b"not a handshake" * 8)
        got = []

        def worker():
            with Client(("127.0.0.1", port), authkey=key) as c:
                got.append(c.recv())
                time.sleep(1.5)  # longer than the handshake's timeout
                c.send("pong")

        threading.Thread(target=worker, daemon=True).start()
        (conn,) = _accept(server, key, 1, handshake_s=1)
        conn.send("ping")
        assert conn.recv() == "pong" and got == ["ping"]
        conn.close()
        silent.close()
        garbage.close()
