"""The prefix cache (`engine/prefix.py`) on the CPU: a request that begins with what an earlier one left in the cache
starts from there, and gets exactly the greedy tokens it gets with the cache off: a chat's next turn (the row's own
end), a prompt that shares an earlier prompt and then differs (a recurrent-state snapshot where that prompt ended),
a hit anywhere in a row for attention-only models, the row taken over when none is free, a pool rebuilt bigger."""

import pytest
import torch

import sluice
from helpers import save_hf_dir, tiny_llama


def load(path, **options):
    return sluice.load(path, device="cpu", prefill_chunk=32, **options)


def ids(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, prompt, max_tokens=12):
    seq = model.engine.add_request(prompt, max_tokens=max_tokens, stop_ids=())
    model.engine.run([seq])
    return seq


@pytest.mark.parametrize("arch", ["llama", "qwen", "deepseek"])
def test_chat_turns_resume_and_match(arch, request):
    """Turn after turn, each prompt the last prompt + its reply + new text: the cache holds all but the last reply
    token, and the tokens are those of a model with the cache off."""
    path = request.getfixturevalue(f"{arch}_dir")
    cached, plain = load(path), load(path, prefix_cache=False)
    vocab = cached.config.vocab_size
    history, hits = ids(50, 0, vocab), []
    for turn in range(3):
        a, b = run(cached, history), run(plain, history)
        assert a.output == b.output and b.cached == 0
        if turn:  # all but the new text and the last reply token, never fed
            assert a.cached == len(history) - 20 - 1
            hits.append(a.cached)
        history = history + a.output + ids(20, turn + 1, vocab)
    stats = cached.engine.rows.stats
    assert (stats.requests, stats.hits, stats.cached_tokens) == (3, 2, sum(hits))


def test_snapshot_where_a_prompt_ended(qwen_dir):
    """A recurrent model resumes only where it knows the states: a prompt that shares an earlier prompt whole and
    then differs from that one's reply resumes at the earlier prompt's end (a snapshot); one that shares part of
    it only, from nothing."""
    cached, plain = load(qwen_dir), load(qwen_dir, prefix_cache=False)
    vocab = cached.config.vocab_size
    first = ids(70, 1, vocab)
    run(cached, first)
    other = first + ids(9, 2, vocab)
    a, b = run(cached, other), run(plain, other)
    assert a.cached == len(first) and a.output == b.output
    part = first[:40] + ids(30, 3, vocab)
    a, b = run(cached, part), run(plain, part)
    assert a.cached == 0 and a.output == b.output


def test_attention_only_resumes_anywhere(llama_dir):
    """Llama: any position of a row (here mid-way through a prefill chunk), and a prompt sent again whole resumes
    one token before its end. (A pool of four rows: one grown to the requests has one row here, which the second
    request would take over.)"""
    cached, plain = load(llama_dir, max_batch=4, max_seq_len=256), load(llama_dir, prefix_cache=False)
    vocab = cached.config.vocab_size
    first = ids(80, 4, vocab)
    run(cached, first)
    for prompt, hit in ((first[:37] + ids(25, 5, vocab), 37), (first, 79)):
        a, b = run(cached, prompt), run(plain, prompt)
        assert a.cached == hit and a.output == b.output


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_no_free_row_takes_the_entry_or_evicts(arch, request):
    """One row: the next turn takes the cached row itself; an unrelated prompt evicts it."""
    path = request.getfixturevalue(f"{arch}_dir")
    cached, plain = load(path, max_batch=1), load(path, max_batch=1, prefix_cache=False)
    vocab = cached.config.vocab_size
    first = ids(40, 6, vocab)
    reply = run(cached, first).output
    following = first + reply + ids(10, 7, vocab)
    a, b = run(cached, following), run(plain, following)
    assert a.cached == len(first) + len(reply) - 1 and a.output == b.output
    assert len(cached.engine.rows.entries) == 1
    fresh = ids(30, 8, vocab)
    a, b = run(cached, fresh), run(plain, fresh)
    assert a.cached == 0 and a.output == b.output
    assert cached.engine.rows.free_rows == cached.engine.runner.pool.rows == 1


def test_many_requests_share_one_prefix(qwen_dir):
    """Several requests behind one system prompt, together: each copies the cached row (which stays) and gets the
    tokens of the cache off."""
    cached, plain = load(qwen_dir), load(qwen_dir, prefix_cache=False)
    vocab = cached.config.vocab_size
    system = ids(60, 9, vocab)
    run(cached, system, max_tokens=1)  # one token: the row's end is the whole system prompt's state
    prompts = [system + ids(5 + 7 * i, 10 + i, vocab) for i in range(3)]
    seqs = [cached.engine.add_request(p, max_tokens=10, stop_ids=()) for p in prompts]
    cached.engine.run(seqs)
    assert [s.cached for s in seqs] == [len(system)] * 3
    assert [s.output for s in seqs] == [run(plain, p, 10).output for p in prompts]


def test_pool_rebuilt_bigger_keeps_prefixes(tmp_path):
    """With no max_seq_len the pool grows to the requests: a longer next turn rebuilds it, the cached rows go
    along."""
    cached = load(save_hf_dir(tiny_llama(seed=3, max_position_embeddings=1024), tmp_path))
    vocab = cached.config.vocab_size
    first = ids(100, 11, vocab)
    reply = run(cached, first).output
    capacity = cached.engine.runner.pool.capacity
    longer = first + reply + ids(capacity, 12, vocab)
    seq = run(cached, longer, max_tokens=4)
    assert cached.engine.runner.pool.capacity >= 2 * capacity
    assert seq.cached == len(first) + len(reply) - 1


def test_off(llama_dir):
    """prefix_cache=False and the deterministic mode never resume."""
    for options in ({"prefix_cache": False}, {"deterministic": True}):
        model = load(llama_dir, **options)
        prompt = ids(40, 13, model.config.vocab_size)
        run(model, prompt)
        assert run(model, prompt).cached == 0
        assert not model.engine.rows.entries


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_turboquant_resumes_where_its_ring_is_known(arch, request):
    """A TurboQuant cache keeps its newest 64 positions exact in a ring, row state like the recurrent states: a
    chat's next turn resumes at the row's end, a prompt sharing an earlier prompt whole at its snapshot (ring
    included), one sharing part of it (even with attention only) nowhere; every reply the cache off's."""
    path = request.getfixturevalue(f"{arch}_dir")
    cached = load(path, kv_cache="turboquant4", max_batch=4, max_seq_len=512)
    plain = load(path, kv_cache="turboquant4", prefix_cache=False)
    vocab = cached.config.vocab_size
    first = ids(150, 14, vocab)
    reply = run(cached, first).output
    cases = ((first + reply + ids(30, 15, vocab), len(first) + len(reply) - 1),  # the row's end
             (first + ids(20, 16, vocab), len(first)),  # the prompt's end: a snapshot
             (first[:120] + ids(20, 17, vocab), 0))  # neither
    for prompt, hit in cases:
        a, b = run(cached, prompt), run(plain, prompt)
        assert a.cached == hit and a.output == b.output


def test_a_system_prompt_shared_by_requests_arriving_together(qwen_dir):
    """A snapshot point at the end of a shared system prompt (`add_request(snapshot_at=)`, what `sluice serve` passes
    for a chat's system message): the first request's prefill stops there and keeps the row state, the others
    wait for it and resume from it; every reply the cache off's."""
    cached, plain = load(qwen_dir, max_batch=8, max_seq_len=256), load(qwen_dir, prefix_cache=False)
    vocab = cached.config.vocab_size
    system = ids(45, 18, vocab)
    prompts = [system + ids(8 + 5 * i, 19 + i, vocab) for i in range(4)]
    seqs = [cached.engine.add_request(p, max_tokens=8, stop_ids=(), snapshot_at=(len(system),)) for p in prompts]
    cached.engine.run(seqs)
    assert [s.cached for s in seqs] == [0] + [len(system)] * 3
    assert [s.output for s in seqs] == [run(plain, p, 8).output for p in prompts]


def test_server_passes_the_system_prompt_end(qwen_dir):
    """`sluice serve`'s chat rendering: the leading system message's end is a snapshot point when the template
    renders it as a prefix of the whole conversation."""
    from types import SimpleNamespace

    from sluice.server.generate import Generation
    from sluice.server.protocol import ChatCompletionRequest

    model = load(qwen_dir)
    handler = SimpleNamespace(model=model, config=SimpleNamespace(allow_special_tokens=False))
    req = ChatCompletionRequest(model="m", messages=[{"role": "system", "content": "You are terse."},
                                                      {"role": "user", "content": "Hi"}])
    text, prompt, points = Generation._render(handler, req, None)
    head = model.tokenizer.encode_chat([{"role": "system", "content": "You are terse."}],
                                       add_generation_prompt=False)[1]
    assert points == (len(head),) and prompt[:len(head)] == head and len(head) < len(prompt)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert Generation._render(handler, req, None)[2] == ()


def test_spare_rows_keep_prefixes_while_others_run(llama_dir):
    """A pool with rows beyond its running batch (`build_pool(spare=)`, on a GPU by default): at most the batch
    runs, and a conversation's cached row outlives the requests that run meanwhile."""
    model = load(llama_dir, max_batch=2, max_seq_len=256)
    engine = model.engine
    engine.runner.build_pool(2, 256, spare=3)
    vocab = model.config.vocab_size
    first = ids(60, 30, vocab)
    reply = run(model, first).output
    seqs = [engine.add_request(ids(30, 31 + i, vocab), max_tokens=6, stop_ids=()) for i in range(4)]
    while engine.has_work():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert all(len(s.output) == 6 for s in seqs) and len(engine.rows.entries) == 5
    follow = run(model, first + reply + ids(10, 35, vocab))
    assert follow.cached == len(first) + len(reply) - 1
    assert engine.rows.free_rows == engine.runner.pool.rows == 5 and engine.rows.batch == 2


def test_common_prefix_by_block_hashes():
    """The matcher's common prefix (chained block hashes, a binary search, then one block's ids) is the plain one."""
    import random

    from sluice.engine.prefix import HASH_BLOCK, block_hashes, common_prefix

    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(4) for _ in range(rng.randint(0, 3 * HASH_BLOCK))]
        b = a[:rng.randint(0, len(a))] + [rng.randrange(4) for _ in range(rng.randint(0, 2 * HASH_BLOCK))]
        plain = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b, block_hashes(a), block_hashes(b)) == plain
