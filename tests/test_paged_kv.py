"""Paged KV (`cache/blocks.py`) on the CPU: the block table's reference counts; an engine whose dense KV cache is
paged gives the greedy tokens of one whose cache is whole rows, for mixed lengths, with the prefix cache sharing
blocks, and when blocks run out (the newest sequence preempted, every request finished, nothing lost)."""

import pytest
import torch

import sluice
from sluice.cache.blocks import BlockTable


def ids(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def outputs(model, prompts, max_tokens=12, **sampling):
    seqs = [model.engine.add_request(p, max_tokens=max_tokens, stop_ids=(), **sampling) for p in prompts]
    model.engine.run(seqs)
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.output for s in seqs]


def test_block_table_counts_shares_and_copies():
    copies = []
    t = BlockTable(rows=4, blocks=6, page=4, max_positions=16, device="cpu")
    assert t.ensure(0, 10) and t.owned[0] == [0, 1, 2] and t.free_blocks == 3
    assert t.host[0].tolist() == [0, 1, 2, 6] and t.needs(0, 13) == 1
    assert t.share(0, 1, 9, lambda a, b: copies.append((a, b)))  # two whole blocks shared, the third copied
    refs = lambda: [t.refs.get(b, 0) for b in range(4)]  # noqa: E731
    assert t.owned[1] == [0, 1, 3] and copies == [(2, 3)] and refs() == [2, 2, 1, 1]
    assert not t.ensure(2, 16)  # four blocks wanted, two free: none given
    assert t.owned[2] == [] and t.free_blocks == 2
    t.release(0)  # the shared blocks stay with row 1
    assert refs() == [1, 1, 0, 1] and t.free_blocks == 3 and t.host[0].tolist() == [6] * 4
    assert t.share(1, 2, 8, None)  # whole blocks only: nothing copied
    assert t.truncate(2, 6, lambda a, b: copies.append((a, b)))  # it writes from 6 on: block 1 becomes its own
    assert t.owned[2] == [0, copies[-1][1]] and copies[-1][0] == 1 and t.refs[1] == 1
    t.sync()
    assert t.device.tolist() == t.host.tolist()
    with pytest.raises(IndexError):
        t.ensure(3, 17)


@pytest.mark.parametrize("arch,kind", [("llama", "dense"), ("llama", "turboquant4"), ("qwen", "dense"),
                                       ("qwen", "turboquant4"), ("deepseek", "dense")])
def test_paged_engine_gives_the_tokens_of_rows(arch, kind, request):
    """Prompts of mixed lengths in blocks of 32 positions, chunked prefill beside decodes, greedy and sampled, then
    the same prompts and more, resuming from the cached prefixes (their blocks shared; Qwen3-Next from the snapshots
    where the first prompts ended): the tokens of the rows layout. DeepSeek's latent cache pages alike."""
    path = request.getfixturevalue(f"{arch}_dir")
    rows = sluice.load(path, device="cpu", prefill_chunk=32, kv_page=0, prefix_cache=False, kv_cache=kind)
    paged = sluice.load(path, device="cpu", prefill_chunk=32, kv_page=32, kv_cache=kind)
    vocab = rows.config.vocab_size
    prompts = [ids(n, i, vocab) for i, n in enumerate([5, 40, 17, 70, 33, 16])]
    longer = [p + ids(7, 100 + i, vocab) for i, p in enumerate(prompts)]
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        assert outputs(paged, prompts, **sampling) == outputs(rows, prompts, **sampling)
        assert outputs(paged, longer, **sampling) == outputs(rows, longer, **sampling)  # from the cached prefixes
    table = paged.engine.runner.pool.blocks
    assert table is not None and table.page == 32
    stats = paged.engine.rows.stats
    assert stats.hits >= (len(prompts) if kind == "dense" else 1)  # TurboQuant's rings: a few snapshot slots
    if arch != "qwen" and kind == "dense":  # prefixes resumed anywhere: whole blocks shared, not copied
        assert any(r > 1 for r in table.refs.values())


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_blocks_running_out_preempt_and_every_request_finishes(arch, request, caplog):
    """Eight sequences growing in a pool of blocks that holds about three of them: the newest is preempted when a
    step's tokens find no block (its row kept as a cached prefix it may resume from), and every request ends with
    the tokens it gets alone in a big pool."""
    path = request.getfixturevalue(f"{arch}_dir")
    big = sluice.load(path, device="cpu", prefill_chunk=32, kv_page=0, prefix_cache=False)
    small = sluice.load(path, device="cpu", prefill_chunk=32, kv_page=32, kv_blocks=12, max_batch=8,
                        max_seq_len=96)
    vocab = big.config.vocab_size
    prompts = [ids(n, 10 + i, vocab) for i, n in enumerate([20, 50, 9, 33, 60, 14, 41, 27])]
    want = [outputs(big, [p], max_tokens=30)[0] for p in prompts]
    with caplog.at_level("INFO", logger="sluice.engine"):
        assert outputs(small, prompts, max_tokens=30) == want
    assert "preempted" in caplog.text
    table = small.engine.runner.pool.blocks
    assert table.blocks == 12
    small.engine.rows.clear()
    assert table.free_blocks == 12 and not table.refs


def test_a_pool_short_of_memory_gets_fewer_blocks(llama_dir, monkeypatch):
    """Sized against memory: a paged pool that cannot hold every row at its longest gets fewer blocks (at least one
    longest sequence's), not an error."""
    from sluice.engine import runner

    model = sluice.load(llama_dir, device="cpu", kv_page=32, max_batch=8, max_seq_len=256)
    pool = model.module.new_cache(8, 256, torch.float32, "meta", "dense", page=32, blocks=8 * 8)
    monkeypatch.setattr(runner, "available_memory", lambda device: pool.nbytes() // 2)
    model.engine.reserve()
    blocks = model.engine.runner.pool.blocks.blocks
    assert 8 <= blocks < 8 * 8
    assert outputs(model, [ids(200, 1, model.config.vocab_size)], max_tokens=40)


def test_memory_plan_is_one_place(llama_dir):
    """The engine's memory plan (`engine/memory.py`): before a pool, what `reserve()` would make; after, the pool's,
    with its blocks and snapshot bytes; `sluice info` and `/health` show it."""
    model = sluice.load(llama_dir, device="cpu", kv_page=32, max_batch=4, max_seq_len=128)
    before = model.engine.memory_plan()
    assert before["page"] == 32 and before["blocks"] == 4 * 4 and before["running"] == 4
    model.engine.reserve()
    plan = model.engine.memory_plan()
    pool = model.engine.runner.pool
    assert plan["blocks"] == pool.blocks.blocks and plan["kv_bytes"] == pool.kv.nbytes()
    assert plan["total"] == plan["kv_bytes"] + plan["row_bytes"] + plan["snapshot_bytes"] + plan["reserve"]
    assert any("16 blocks of 32 positions" in line for line in plan["lines"])
    assert model.info()["memory_plan"]["blocks"] == 16
    too_big = sluice.load(llama_dir, device="cpu", kv_page=32, kv_blocks=1 << 30, max_seq_len=128)
    assert "error" in too_big.engine.memory_plan()


def test_the_profile_step_runs_beside_a_pool(llama_dir):
    """The memory plan's profile step (`ModelRunner.profile_step`, measured on a GPU): a step of the most prompt
    tokens on a one-row pool of its own, the engine's pool untouched."""
    model = sluice.load(llama_dir, device="cpu", kv_page=32, max_batch=2, max_seq_len=64, prefill_chunk=64)
    model.engine.reserve()
    runner = model.engine.runner
    pool = runner.pool
    runner.profile_step()
    assert runner.pool is pool and runner.activation_reserve() == 0  # nothing kept off a GPU



def test_server_with_few_blocks_answers_everyone(demo_gguf_path):
    """`sluice serve` over a paged KV cache too small for its clients at once (the demo model, CPU): concurrent
    requests all get the reply the model gives alone; `/health` shows the blocks and the preemptions."""
    import concurrent.futures

    import httpx

    from sluice.server import Server, ServerConfig

    alone = sluice.load(demo_gguf_path, device="cpu")
    model = sluice.load(demo_gguf_path, device="cpu", max_seq_len=128, max_batch=4, kv_page=32, kv_blocks=5)
    prompts = [f"Count from {i} to {i + 40}, one number a line." for i in range(4)]
    want = [alone.generate(p, max_tokens=32, temperature=0.0) for p in prompts]
    with Server(model, ServerConfig(port=0, log_level="warning")) as server:
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

        def ask(p):
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"model": name, "prompt": p, "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
        health = httpx.get(server.url + "/health").json()
    assert got == want
    blocks = health["kv_blocks"]
    assert blocks["page"] == 32 and blocks["blocks"] == 5 and 0 <= blocks["free"] <= 5


def test_no_request_waits_forever_for_blocks(llama_dir):
    """Cached prefixes whose blocks are shared (a prompt and its longer twin) hold every block: an unrelated request
    is still admitted, the prefixes evicted for it; a request that resumes from the only prefix in a pool with no
    free block takes what it can."""
    model = sluice.load(llama_dir, device="cpu", prefill_chunk=64, kv_page=32, kv_blocks=8, max_batch=4,
                        max_seq_len=256)
    engine, vocab = model.engine, model.config.vocab_size
    a = ids(200, 1, vocab)
    outputs(model, [a], max_tokens=1)
    outputs(model, [a + ids(18, 2, vocab)], max_tokens=2)
    assert engine.rows.blocks.free_blocks == 0
    assert outputs(model, [ids(100, 3, vocab)], max_tokens=4)  # evicts what it needs
    assert outputs(model, [a + ids(40, 4, vocab)], max_tokens=4)
    assert not engine.has_work()


def test_bad_block_counts_and_an_empty_step(llama_dir):
    """Pages not in 32s, block counts past int32 or below one longest sequence are refused, saying what to give; a
    step before any pool (a request for no tokens) works."""
    from sluice.errors import InvalidOptionError

    for options, match in (({"kv_page": 48}, "multiple of 32"), ({"kv_page": -32}, "multiple of 32"),
                           ({"kv_blocks": 1 << 31}, "fewer than 2"), ({"kv_blocks": 0}, "integer >= 1")):
        with pytest.raises(InvalidOptionError, match=match):
            sluice.load(llama_dir, device="cpu", **options)

    few = sluice.load(llama_dir, device="cpu", kv_page=32, kv_blocks=2, max_seq_len=128)
    with pytest.raises(InvalidOptionError, match="kv_blocks=2"):
        few.engine.reserve()
    model = sluice.load(llama_dir, device="cpu", kv_page=32)
    seq = model.engine.add_request([1, 2, 3], max_tokens=0)
    out = model.engine.step()
    assert seq.finished and [o.seq for o in out] == [seq]
