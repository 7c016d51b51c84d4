"""Streamed experts (issue #27): routed experts in host memory, a per-layer slot cache on the device. On the CPU the
same classes run with the torch policy (`kernels/expert_cache/reference.py`); the logits must be identical to the
model with all its experts in place, decode (from slots, with misses and evictions) and prefill (whole layers)."""

import pytest
import torch

import sluice
from sluice.errors import InvalidOptionError, SluiceError
from sluice.experts.placement import parse_bytes
from test_qwen3_next import qwen3_next, save


@pytest.fixture(scope="module")
def mlx_dir(tmp_path_factory):
    from sluice.formats.convert import convert

    d = tmp_path_factory.mktemp("stream")
    src = save(qwen3_next(seed=21, num_experts=16, num_experts_per_tok=2), d / "hf")
    return convert(src, d / "mlx", bits=4, group_size=32, quiet=True)


def test_streamed_experts_give_identical_logits(mlx_dir):
    whole = sluice.load(mlx_dir, device="cpu")
    streamed = sluice.load(mlx_dir, device="cpu", expert_slots=6)
    p = streamed.placement
    assert whole.placement is None and p is not None
    assert (p.layers, p.experts, p.slots, p.max_cached_tokens) == (4, 16, 6, 3)
    moe = streamed.module.layers[0].mlp
    assert moe.gate_up.weight.shape[0] == 6 and moe.expert_cache.experts[0].weight.shape[0] == 16
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 300, (1, 9), generator=g)
    caches = [m.new_cache(64) for m in (whole, streamed)]
    # prefill: 9 tokens x 2 experts > 6 slots: whole layers, read from the host experts
    ref, got = (m.forward(prompt, c, 0) for m, c in zip((whole, streamed), caches))
    assert torch.equal(ref, got)
    # decode, one token a step: from the slots; 16 experts through 6 slots miss and evict
    tok = ref[:, -1].argmax(-1, keepdim=True)
    for pos in range(9, 30):
        ref, got = (m.forward(tok, c, pos) for m, c in zip((whole, streamed), caches))
        assert torch.equal(ref, got), pos
        tok = ref[:, -1].argmax(-1, keepdim=True)
    hits, misses = (sum(int(c.stats[i]) for c in p.caches) for i in range(2))
    assert misses > 16 and hits > 0  # evictions happened (more misses than experts) and some reuse
    assert 0 < p.hit_rate() < 1
    assert streamed.info()["placement"]["slots_per_layer"] == 6
    assert streamed.info()["parameters"] == whole.info()["parameters"]


def test_greedy_generation_is_identical_through_the_engine(mlx_dir):
    whole = sluice.load(mlx_dir, device="cpu", max_batch=4)
    streamed = sluice.load(mlx_dir, device="cpu", expert_slots=6, max_batch=4)
    prompts = [[5, 6, 7], [9, 1, 200, 3], [42]]
    kw = dict(max_tokens=12, temperature=0)
    assert whole.generate_batch(prompts, **kw) == streamed.generate_batch(prompts, **kw)


def test_budgets_too_small_or_malformed_are_refused(mlx_dir):
    with pytest.raises(InvalidOptionError, match="use 6 \\(3 x top-k.*\\) to 16"):
        sluice.load(mlx_dir, device="cpu", expert_slots=4)
    with pytest.raises(InvalidOptionError, match="smallest budget that works is"):
        sluice.load(mlx_dir, device="cpu", gpu_memory="1MiB")
    with pytest.raises(InvalidOptionError, match="24GiB"):
        sluice.load(mlx_dir, device="cpu", gpu_memory="lots")
    assert sluice.load(mlx_dir, device="cpu", gpu_memory="64GiB").placement is None  # it fits: nothing streams
    assert (parse_bytes("24GiB"), parse_bytes("1.5GB"), parse_bytes(4096)) == (24 << 30, 1_500_000_000, 4096)


def test_a_model_without_experts_cannot_stream(tmp_path):
    from helpers import save_hf_dir, tiny_llama

    path = save_hf_dir(tiny_llama(seed=4), tmp_path / "m")
    with pytest.raises(SluiceError, match="no routed experts"):
        sluice.load(path, device="cpu", expert_slots=6)
    assert sluice.load(path, device="cpu", gpu_memory="64GiB").placement is None


def test_info_and_bench_print_the_placement(mlx_dir, capsys):
    from sluice.cli import main

    assert main(["info", "--model", str(mlx_dir), "--expert-slots", "8"]) == 0
    out = capsys.readouterr().out
    assert "placement:    8 of 16 routed experts a layer in device slots" in out
    assert main(["bench", "--model", str(mlx_dir), "--device", "cpu", "--expert-slots", "6", "--prompt-tokens", "8",
                 "--gen-tokens", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "placement (dense): 6 of 16 routed experts" in out and "hit rate" in out
    assert main(["info", "--model", str(mlx_dir), "--gpu-memory", "2KiB"]) == 2
    assert "smallest budget that works" in capsys.readouterr().err


def test_experts_streamed_from_disk_give_identical_logits(mlx_dir):
    """The disk store: experts never read at load (meta tensors), misses read from the safetensors files with
    parallel preads, prefill reads whole layers; the same logits as the resident model."""
    whole = sluice.load(mlx_dir, device="cpu")
    disk = sluice.load(mlx_dir, device="cpu", expert_slots=6, expert_store="disk")
    p = disk.placement
    assert p.store == "disk" and p.disk_bytes_read() == 0
    assert disk.module.layers[0].mlp.expert_cache.experts[0].weight.is_meta
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 300, (1, 7), generator=g)
    caches = [m.new_cache(64) for m in (whole, disk)]
    ref, got = (m.forward(prompt, c, 0) for m, c in zip((whole, disk), caches))
    assert torch.equal(ref, got)
    assert p.disk_bytes_read() == p.host_bytes  # the prefill read every layer once
    tok = ref[:, -1].argmax(-1, keepdim=True)
    for pos in range(7, 20):
        ref, got = (m.forward(tok, c, pos) for m, c in zip((whole, disk), caches))
        assert torch.equal(ref, got), pos
        tok = ref[:, -1].argmax(-1, keepdim=True)
    misses = sum(int(c.stats[1]) for c in p.caches)
    assert p.disk_bytes_read() == p.host_bytes + misses * p.expert_bytes  # a miss reads one expert, nothing more
    kw = dict(max_tokens=10, temperature=0)
    assert disk.generate_batch([[5, 6, 7], [42]], **kw) == whole.generate_batch([[5, 6, 7], [42]], **kw)


def test_disk_store_needs_files(mlx_dir):
    with pytest.raises(InvalidOptionError, match="write them to disk first"):
        sluice.load(mlx_dir / "config.json", load_format="dummy", device="cpu", expert_store="disk", expert_slots=6)
    with pytest.raises(InvalidOptionError, match="expert_store='nowhere'"):
        sluice.load(mlx_dir, device="cpu", expert_store="nowhere", expert_slots=6)


def test_dummy_checkpoint_written_to_disk_reads_back_the_same(mlx_dir, tmp_path):
    """`DummyCheckpoint.write` (how the GPU benchmark makes a checkpoint to stream from disk) writes the same
    weights the dummy loader makes, in the MLX layout."""
    from sluice.formats.dummy import DummyCheckpoint

    out = DummyCheckpoint(mlx_dir / "config.json").write(tmp_path / "d", shard_bytes=100_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    dummy = sluice.load(mlx_dir / "config.json", load_format="dummy", device="cpu")
    files = sluice.load(out, device="cpu", expert_slots=6, expert_store="disk")
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert files.format == "mlx" and torch.equal(dummy.logits(ids), files.logits(ids))


def test_the_smallest_budget_named_is_accepted(mlx_dir):
    import re

    with pytest.raises(InvalidOptionError) as e:
        sluice.load(mlx_dir, device="cpu", gpu_memory="1MiB")
    smallest = re.search(r"smallest budget that works is ([0-9.]+) GiB", str(e.value)).group(1)
    sluice.load(mlx_dir, device="cpu", gpu_memory=f"{smallest}GiB")  # works (here: it even fits whole)


def test_disk_store_without_a_budget_and_with_every_slot(mlx_dir):
    """Off the GPU with no budget a disk store gets a slot for every expert; then no step restages a layer: its
    distinct experts always fit (at most E)."""
    disk = sluice.load(mlx_dir, device="cpu", expert_store="disk")
    p = disk.placement
    assert p.slots == p.experts == 16 and p.max_cached_tokens >= 1 << 20
    disk.logits([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])  # 12 tokens x 2 > 16 slots, but at most 16 experts
    assert p.disk_bytes_read() <= p.host_bytes  # each expert read at most once, no whole-layer staging


def test_a_failed_disk_read_empties_the_slots_it_took(mlx_dir, monkeypatch):
    from sluice.errors import ModelFileError
    from sluice.experts import store

    disk = sluice.load(mlx_dir, device="cpu", expert_slots=6, expert_store="disk")
    cache = disk.placement.caches[0]

    def broken(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.os, "preadv", broken)
    with pytest.raises(ModelFileError, match="MoE layer 0.*Input/output error"):
        cache.for_step(torch.tensor([[3, 7]], dtype=torch.int32), 2)
    assert (cache.slot_of == -1).all() and (cache.expert_in == -1).all() and (cache.stamp == 0).all()
    monkeypatch.undo()
    gate_up, down, slots = cache.for_step(torch.tensor([[3, 7]], dtype=torch.int32), 2)  # read now, and right
    ref = disk.placement.caches[0].store.layer()[0].weight
    assert torch.equal(gate_up.weight[slots[0, 0]].view(torch.int32), ref[3].view(torch.int32))


def test_few_experts_stream_with_as_many_slots(tmp_path):
    """Fewer experts than 3 x top-k: the smallest slot count is all of them."""
    from sluice.formats.convert import convert

    src = save(qwen3_next(seed=3, num_experts=4, num_experts_per_tok=2), tmp_path / "hf")
    q = convert(src, tmp_path / "q", bits=4, group_size=32, quiet=True)
    assert sluice.load(q, device="cpu", expert_slots=4).placement.slots == 4
    with pytest.raises(InvalidOptionError, match="use 4"):
        sluice.load(q, device="cpu", expert_slots=3)


def test_gguf_models_are_held_to_the_budget(tmp_path):
    from helpers import save_llama_gguf, tiny_llama

    path = save_llama_gguf(tiny_llama(seed=2), tmp_path / "t.gguf")
    with pytest.raises(SluiceError, match="no routed experts"):
        sluice.load(path, device="cpu", expert_slots=6)
    with pytest.raises(InvalidOptionError, match="more than the .* GiB given"):
        sluice.load(path, device="cpu", gpu_memory="1KiB")


def test_dequantized_weights_cannot_stream(mlx_dir):
    with pytest.raises(InvalidOptionError, match="keep_quantized=False"):
        sluice.load(mlx_dir, device="cpu", expert_slots=6, keep_quantized=False)


def test_the_server_reports_the_placement_live(mlx_dir):
    httpx = pytest.importorskip("httpx")
    from sluice.server import Server, ServerConfig

    model = sluice.load(mlx_dir, device="cpu", expert_slots=6, max_batch=2, max_seq_len=64)
    with Server(model, ServerConfig(port=0, log_level="warning")) as s:
        assert httpx.get(s.url + "/health").json()["experts"]["hit_rate"] is None  # nothing looked up yet
        body = {"model": mlx_dir.name, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        experts = httpx.get(s.url + "/health").json()["experts"]
        assert experts["slots_per_layer"] == 6 and 0 <= experts["hit_rate"] <= 1


def test_a_big_step_with_few_distinct_experts_runs_from_the_slots(mlx_dir):
    """More routed pairs than slots, but few distinct experts: the slots, not a whole layer (which would read every
    expert of the layer for a step that needs two)."""
    streamed = sluice.load(mlx_dir, device="cpu", expert_slots=6, expert_store="disk")
    cache = streamed.placement.caches[0]
    ids = torch.tensor([[1, 2], [2, 1], [1, 2], [2, 1]], dtype=torch.int32)  # 8 pairs > 6 slots, 2 experts
    gate_up, down, slots = cache.for_step(ids, 2)
    assert gate_up.weight.shape[0] == 6 and streamed.placement.disk_bytes_read() == 2 * cache.expert_bytes
    whole = cache.store.layer()[0].weight.view(torch.int32)
    for e in (1, 2):
        s = int(slots[ids == e][0])
        assert torch.equal(gate_up.weight[s].view(torch.int32), whole[e])
    many = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)  # 8 distinct: the whole layer
    assert cache.for_step(many, 2)[0].weight.shape[0] == 16


def test_expert_slots_must_be_an_integer(mlx_dir):
    with pytest.raises(InvalidOptionError, match="expert_slots='six': use an integer"):
        sluice.load(mlx_dir, device="cpu", expert_slots="six")
