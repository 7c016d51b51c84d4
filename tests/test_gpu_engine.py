"""The engine on a CUDA GPU: steps replayed from CUDA graphs (decode steps whole, flat steps whole or in pieces) give
the same greedy tokens as eager steps, with both cache kinds: a dense Llama and a 4-bit Qwen3-Next whose kernels take
the Triton paths. Skipped without a GPU; run on the GPU machine. (A sequence's tokens may differ from its tokens alone:
a step's token-wise GEMMs run over all its tokens, and other row counts round differently.)"""

import pytest
import torch

import sluice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (1, 9, 70, 130, 33, 5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from helpers import save_hf_dir, tiny_llama
    from test_qwen3_next import qwen3_next, save

    from sluice.formats.convert import convert

    d = tmp_path_factory.mktemp("gpu_engine")
    llama = save_hf_dir(tiny_llama(seed=1, head_dim=64, hidden_size=128), d / "llama")  # dense weights
    qwen = convert(save(qwen3_next(seed=2, shared_expert_intermediate_size=32), d / "qwen"), d / "qwen4", bits=4,
                   group_size=32, quiet=True)
    return {"llama": llama, "qwen3_next": qwen}


def run(model, prompts, max_tokens=24):
    seqs = [model.engine.add_request(p, max_tokens=max_tokens, stop_ids=()) for p in prompts]
    model.engine.run(seqs)
    return [s.output for s in seqs]


def staggered(model, prompts, max_tokens=24):
    """Each request joins once the one before is prefilled: its prompt prefills alone, the decodes batch."""
    seqs = []
    for p in prompts:
        seqs.append(model.engine.add_request(p, max_tokens=max_tokens, stop_ids=()))
        while seqs[-1].prefilled < len(p):
            model.engine.step()
    model.engine.run(seqs)
    return [s.output for s in seqs]


@pytest.mark.parametrize("kind", ["dense", "turboquant4"])
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_graph_and_eager_decode_agree(checkpoints, name, kind):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (t,), generator=g).tolist() for t in LENGTHS]
    out = {}
    for graphs in (False, True):
        model = sluice.load(checkpoints[name], device="cuda", kv_cache=kind, graphs=graphs)
        out[graphs] = run(model, prompts)
        if graphs:
            assert model.engine.runner._graphs and model.engine.runner._flat_graphs, "no graph was captured"
    # a flat step is padded to its graph's size with graphs or without: the same shapes, the same sums
    assert out[True] == out[False]


@pytest.mark.parametrize("kind,whole", [("dense", True), ("dense", False), ("turboquant4", False)])
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_flat_graph_replays_the_eager_forward(checkpoints, name, kind, whole):
    """A flat step (decode tokens and prompt chunks of several sequences in one row of tokens) replayed from its
    graph (`engine/piecewise.py`: whole, static, or in pieces) gives the logits, bit for bit, of the same padded flat
    forward run eagerly on twin rows that hold the same caches, and leaves the same caches behind."""
    from sluice.engine.batch import FlatBatch
    from sluice.engine.piecewise import PiecewiseGraph, WholeGraph

    model = sluice.load(checkpoints[name], device="cuda", kv_cache=kind, max_batch=8, max_seq_len=256,
                        whole_graph_tokens=256 if whole else 0)
    runner = model.engine.runner
    runner.build_pool(8, 256)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (t,), generator=g).tolist() for t in (9, 70, 33, 40, 5)]
    twins = [[runner.pool.allocate() for _ in range(4)] for _ in range(2)]
    assert all(runner.pool.reserve(row, 256) for rows in twins for row in rows)  # a paged cache's blocks
    with torch.inference_mode():
        for rows in twins:  # two decoding sequences and one half-prefilled prompt in each set of rows
            runner.prefill([(rows[0], prompts[0], 0), (rows[1], prompts[1], 0), (rows[2], prompts[2][:20], 0)])
        logits = []
        for graphs, rows in zip((True, False), twins):
            decodes = [(rows[0], 9), (rows[1], 70)]
            chunks = [(rows[2], prompts[2][20:], 20), (rows[3], prompts[3], 0)]
            batch = FlatBatch(decodes, chunks, runner.pool.visible, n_pad=128, r_pad=runner._rows_max,
                              static=runner._static(128, chunks), pad_row=runner.pool.scratch_row)
            assert batch.static == whole
            ids, meta = batch.place(runner._flat, [11, 12])
            if graphs:
                graph = runner._flat_graph(128, batch.static)
                assert isinstance(graph, WholeGraph if whole else PiecewiseGraph)
                ids, meta = batch.place(runner._flat, [11, 12])  # (a capture overwrites the buffer)
                out = graph.run(meta)
            else:
                out = runner.module(ids, runner.pool, meta, runner.dtype, last_only=True)[0]
            logits.append(out[:batch.r].clone())
            # one decode step after it, reading what the flat step stored
            logits.append(runner.decode(rows, [10, 71, 33, 40], [1, 2, 3, 4]).clone())
    assert torch.isfinite(logits[0]).all()
    if kind == "dense":
        assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[3])
    else:  # the TurboQuant decode kernel's partial sums may meet in another order
        assert torch.allclose(logits[0], logits[2], rtol=1e-2, atol=1e-2)
        assert torch.allclose(logits[1], logits[3], rtol=1e-2, atol=1e-2)
        assert torch.equal(logits[0].argmax(-1), logits[2].argmax(-1))


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_static_flat_forward_matches_the_pieces_one(checkpoints, name):
    """A static flat forward (every token stored, then attended as a decode query; the recurrent and chunked rules
    over all the tokens) gives the logits of the same step's forward in pieces (decode kernel and prefill
    attention), on twin rows, to rounding."""
    from sluice.engine.batch import FlatBatch

    model = sluice.load(checkpoints[name], device="cuda", max_batch=8, max_seq_len=256)
    runner = model.engine.runner
    runner.build_pool(8, 256)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (t,), generator=g).tolist() for t in (9, 70, 33, 40)]
    twins = [[runner.pool.allocate() for _ in range(4)] for _ in range(2)]
    assert all(runner.pool.reserve(row, 256) for rows in twins for row in rows)  # a paged cache's blocks
    logits = []
    with torch.inference_mode():
        for static, rows in zip((True, False), twins):
            runner.prefill([(rows[0], prompts[0], 0), (rows[1], prompts[1], 0), (rows[2], prompts[2][:20], 0)])
            batch = FlatBatch([(rows[0], 9), (rows[1], 70)], [(rows[2], prompts[2][20:], 20), (rows[3], prompts[3], 0)],
                              runner.pool.visible, n_pad=128, r_pad=runner._rows_max, static=static,
                              pad_row=runner.pool.scratch_row)
            ids, meta = batch.place(runner._flat, [11, 12])
            logits.append(runner.module(ids, runner.pool, meta, runner.dtype, last_only=True)[0][:batch.r].float())
    assert torch.isfinite(logits[0]).all()
    assert torch.allclose(logits[0], logits[1], rtol=2e-2, atol=2e-2), (logits[0] - logits[1]).abs().max()


@pytest.mark.parametrize("kind,whole", [("dense", 256), ("dense", 0), ("turboquant4", 256)])
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_prompts_joining_decodes_with_and_without_graphs(checkpoints, name, kind, whole):
    """Prompts joining running decodes, each step one flat forward: replayed from graphs and eager (padded to the
    same token count), the same greedy tokens."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (t,), generator=g).tolist() for t in (9, 5, 70, 130)]
    out = {}
    for graphs in (False, True):
        model = sluice.load(checkpoints[name], device="cuda", kv_cache=kind, graphs=graphs, prefill_chunk=64,
                            decode_prefill_chunk=16, max_batch=4, max_seq_len=256, whole_graph_tokens=whole)
        out[graphs] = staggered(model, prompts)
        assert bool(model.engine.runner._flat_graphs) == graphs
    assert out[True] == out[False]


@pytest.mark.parametrize("kind", ["dense", "turboquant4"])
def test_decode_attention_returns_the_activations_dtype(kind):
    """A bf16 model's decode attention hands bf16 to its output projection (an fp32 output sent the o-projection
    down fp32 tensor-core paths: batch-8 TurboQuant steps took twice as long)."""
    from sluice.attention import make_attention
    from sluice.engine.batch import ForwardMeta

    cache = make_attention(kind, 1, 2, 2, 64, 128, torch.bfloat16, "cuda")
    q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = cache.forward(0, q, k, v, ForwardMeta.decode_host([0, 1], [0, 0], 1, "cuda"), 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name, dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                         ("qwen3_next", torch.float32)])
def test_prefix_cache_gives_the_tokens_of_no_cache(checkpoints, name, dtype):
    """A chat's turns (each prompt the last one + its reply + new text) with graphs: the next turn resumes where
    the last left its row (`engine/prefix.py`), and its greedy tokens are those of an engine without the cache;
    the same for a prompt that shares an earlier prompt whole (a snapshot of the recurrent states). (The 4-bit
    Qwen3-Next in bf16 is left out: a prefill that starts at another position chunks Gated DeltaNet's rule
    differently, which rounds differently in bf16; one of its four replies differed on an H200.)"""
    g = torch.Generator().manual_seed(7)
    new = lambda n: torch.randint(0, 300, (n,), generator=g).tolist()  # noqa: E731
    cached = sluice.load(checkpoints[name], device="cuda", dtype=dtype, max_batch=4, max_seq_len=512)
    plain = cached.with_engine(prefix_cache=False)
    history, hits, same = new(90), [], []
    for _ in range(3):
        a, b = run(cached, [history])[0], run(plain, [history])[0]
        hits.append(cached.engine.rows.stats.cached_tokens)
        same.append(a == b)
        history = history + a + new(40)
    first = new(70)
    run(cached, [first])
    other = first + new(11)
    same.append(run(cached, [other]) == run(plain, [other]))
    assert hits[1] > 0 and hits[2] > hits[1]
    assert all(same), same
