"""The engine on a CUDA GPU: decode steps replayed from CUDA graphs give the same greedy tokens as eager steps, a
batch of up to 4 gives each sequence what it gets alone, with both cache kinds: a dense Llama and a 4-bit
Qwen3-Next whose kernels take the Triton paths. Skipped without a GPU; run on the GPU machine."""

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
            assert model.engine.runner._graphs, "no graph was captured"
            # decode batches of up to 4 rows take per-row GEMVs and per-token MoE launches: a sequence's tokens do
            # not depend on the batch (more rows run the tensor-core GEMMs, whose sums round differently: so do
            # prompts prefilled packed together, which is why each prompt here is in before the next one comes)
            four = staggered(model, prompts[:4])
            assert four == [run(model, [p])[0] for p in prompts[:4]]
    assert out[True] == out[False]


@pytest.mark.parametrize("kind", ["dense", "turboquant4"])
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_chunk_graph_prefill_agrees_with_eager(checkpoints, name, kind):
    """A prompt joining running decodes prefills in chunks of decode_prefill_chunk tokens replayed from the chunk
    graph (pieces cut at each attention, `engine/chunk_graph.py`): its logits equal the eager prefill's, and the
    whole run's greedy tokens equal a run without graphs."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (t,), generator=g).tolist() for t in (9, 5, 70)]
    out = {}
    for graphs in (False, True):
        model = sluice.load(checkpoints[name], device="cuda", kv_cache=kind, graphs=graphs, prefill_chunk=64,
                            decode_prefill_chunk=16, max_batch=4, max_seq_len=256)
        out[graphs] = staggered(model, prompts)
        runner = model.engine.runner
        assert (runner._chunk_graph is not None) == graphs
    assert out[True] == out[False]
    # the same chunks in two fresh rows, one replayed, one eager
    with torch.inference_mode():
        rows = runner.pool.allocate(), runner.pool.allocate()
        for start in (0, 16, 32):
            ids = prompts[2][start:start + 16]
            replayed = runner.prefill([(rows[0], ids, start)]).clone()
            assert torch.equal(replayed, runner.prefill_eager([(rows[1], ids, start)])), start


@pytest.mark.parametrize("kind", ["dense", "turboquant4"])
def test_decode_attention_returns_the_activations_dtype(kind):
    """A bf16 model's decode attention hands bf16 to its output projection (an fp32 output sent the o-projection
    down fp32 tensor-core paths: batch-8 TurboQuant steps took twice as long)."""
    from sluice.cache.kv import DenseKVCache
    from sluice.cache.turboquant import TurboQuantKVCache
    from sluice.engine.batch import ForwardMeta

    make = DenseKVCache if kind == "dense" else TurboQuantKVCache
    cache = make(1, 2, 2, 64, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = cache.attend(0, q, k, v, ForwardMeta.decode_host([0, 1], [0, 0], 1, "cuda"), 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and torch.isfinite(out.float()).all()
