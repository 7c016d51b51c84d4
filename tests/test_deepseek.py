"""DeepSeek-V3 / V2 (multi-head latent attention, DeepSeekMoE) against HF transformers: random tiny configs, fp32,
CPU; the latent cache through the engine; MLX 4-bit checkpoints; dummy weights of the benchmark configs; bad
configs."""

import copy
import json
from pathlib import Path

import pytest
import torch

import sluice
from helpers import byte_level_tokenizer_json
from sluice.errors import ModelFileError, UnsupportedError

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"


def rel_max(a, b) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF inits norms to 1 and the correction bias to 0: make them random
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, max_position_embeddings=512)


def v3(seed=0, **over):
    kw = dict(BASE, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5)
    kw.update(over)
    torch.manual_seed(seed)
    return randomize(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).float().eval(), seed)


def v2(seed=0, **over):
    kw = dict(BASE, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.5)
    kw.update(over)
    torch.manual_seed(seed)
    return randomize(transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kw)).float().eval(), seed)


def yarn(factor=4.0, mscale=1.0, mscale_all_dim=1.0, **more):
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim, **more}


CASES = [
    ("v3-lora-groups", v3, {}),
    ("v3-plain-q-yarn-dense0", v3, dict(q_lora_rank=None, rope_parameters=yarn(), n_group=1, topk_group=1,
                                        num_experts_per_tok=2, first_k_dense_replace=0)),
    ("v3-yarn-mscale-nonorm", v3, dict(rope_parameters=yarn(8.0, mscale=0.707, mscale_all_dim=1.0), n_group=2,
                                       topk_group=1, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2)),
    ("v3-no-interleave-topk4", v3, dict(rope_interleave=False, n_group=8, topk_group=3, num_experts_per_tok=2,
                                        n_routed_experts=16)),
    ("v2-greedy-yarn", v2, dict(q_lora_rank=None, rope_parameters=yarn(40.0, mscale=0.707, mscale_all_dim=0.707))),
    ("v2-group-limited", v2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  first_k_dense_replace=0)),
]


def save(model, path):
    model.save_pretrained(path, safe_serialization=True)
    byte_level_tokenizer_json(Path(path))
    return Path(path)


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    name, make, over = request.param
    hf = make(seed=len(name), **over)
    return hf, sluice.load(save(hf, tmp_path_factory.mktemp("m")), device="cpu")


@pytest.mark.parametrize("T", [1, 45])
def test_logits_match_transformers(pair, T):
    hf, ours = pair
    ids = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_max(ours.logits(ids), ref) < 1e-4


def test_chunked_prefill_and_absorbed_decode_equal_full_forward(pair):
    """Prefill chunks (K/V decompressed from the cached latents) and decode steps (the absorbed form over the
    latents) give the full forward's logits."""
    _, ours = pair
    ids = torch.randint(0, 300, (1, 60), generator=torch.Generator().manual_seed(1))
    full = ours.logits(ids)[0]
    cache = ours.new_cache(60)
    parts = [ours.forward(ids[:, s:min(s + 16, 50)], cache, s)[0] for s in range(0, 50, 16)]
    parts += [ours.forward(ids[:, t:t + 1], cache, t)[0] for t in range(50, 60)]
    assert rel_max(torch.cat(parts), full) < 1e-5


def test_greedy_generation_matches_transformers(pair):
    hf, ours = pair
    prompt = [5, 17, 42, 99, 7, 250, 3]
    got = list(ours.generate_ids(prompt, max_tokens=16, temperature=0.0, stop_ids=()))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref


def test_absorbed_equals_decompressed_attention():
    from sluice.kernels.mla.reference import absorbed_attention, decompressed_attention

    g = torch.Generator().manual_seed(0)
    B, T, S, H, nope, rope, v, R = 2, 5, 12, 3, 8, 4, 6, 16
    q_nope, q_pe = torch.randn(B, T, H, nope, generator=g), torch.randn(B, T, H, rope, generator=g)
    c, k_pe = torch.randn(B, S, R, generator=g), torch.randn(B, S, rope, generator=g)
    w_uk, w_uv = torch.randn(H, nope, R, generator=g), torch.randn(H, v, R, generator=g)
    ref = decompressed_attention(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.3)
    positions = torch.arange(S - T, S).expand(B, T)
    got = absorbed_attention(q_nope, q_pe, torch.cat([c, k_pe], -1), w_uk, w_uv, 0.3, positions)
    assert rel_max(got, ref) < 1e-5


# -- the engine: the latent cache in flat steps -----------------------------------------------------------------

def test_batch_of_chunked_prompts_equals_each_alone(tmp_path):
    """Prompts of different lengths in one engine (prefill chunks of 8 tokens beside decode tokens in one flat
    forward) get the greedy tokens each gets alone."""
    model = sluice.load(save(v3(seed=21), tmp_path / "m"), device="cpu", prefill_chunk=8, decode_prefill_chunk=8,
                        max_batch=4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 11, 20, 29)]

    def alone(ids):
        seq = model.engine.add_request(ids, max_tokens=12, stop_ids=())
        model.engine.run([seq])
        return seq.output

    solo = [alone(p) for p in prompts]
    seqs = [model.engine.add_request(p, max_tokens=12, stop_ids=()) for p in prompts]
    model.engine.run(seqs)
    assert [s.output for s in seqs] == solo
    assert model.engine.rows.free_rows == model.engine.runner.pool.rows
    texts = ["the cat", "a much longer prompt that takes a few chunks", "x"]
    assert model.generate_batch(texts, max_tokens=6, temperature=0) == [model.generate(t, max_tokens=6, temperature=0)
                                                                        for t in texts]


def test_latent_cache_layout_and_kinds(pair):
    _, ours = pair
    cfg = ours.config
    kv = ours.new_cache(7, rows=2).kv
    assert tuple(kv.latent.shape) == (cfg.num_layers, 3, 7, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert ours.info()["kv_cache_bytes_per_token"] == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_turboquant_cache_is_refused(tmp_path):
    src = save(v3(seed=3, num_hidden_layers=2), tmp_path / "m")
    with pytest.raises(UnsupportedError, match="latent"):
        sluice.load(src, device="cpu", kv_cache="turboquant4")


# -- checkpoint layouts -------------------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, edit=None, config=None) -> Path:
    from helpers import rewrite_checkpoint

    return rewrite_checkpoint(src, dst, edit, config)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    hf = v3(seed=5, num_hidden_layers=2)
    return hf, save(hf, tmp_path_factory.mktemp("small") / "m")


def test_fused_experts_and_mtp_layer_load(small, tmp_path):
    """transformers' fused expert tensors read like per-expert ones; a multi-token-prediction layer past
    num_hidden_layers is left alone."""
    hf, src = small
    E = hf.config.n_routed_experts

    def fuse_and_add_mtp(t):
        p = "model.layers.1.mlp."
        t[p + "experts.gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}experts.{e}.gate_proj.weight"),
                                                               t.pop(f"{p}experts.{e}.up_proj.weight")])
                                                    for e in range(E)])
        t[p + "experts.down_proj"] = torch.stack([t.pop(f"{p}experts.{e}.down_proj.weight") for e in range(E)])
        for name in [n for n in t if n.startswith("model.layers.1.")]:
            t[name.replace("model.layers.1.", "model.layers.2.")] = t[name].clone()
        t["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
        t["model.layers.2.enorm.weight"] = torch.ones(64)
        return t

    d = _rewrite(src, tmp_path / "m", fuse_and_add_mtp, lambda c: c.update(num_nextn_predict_layers=1))
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_max(sluice.load(d, device="cpu").logits(ids), ref) < 1e-4


def dequantized_reference(hf_model, mlx_dir):
    """The HF model with the MLX checkpoint's weights, dequantized (kv_b_proj rebuilt from embed_q / unembed_out,
    or from a quantized kv_b_proj)."""
    from sluice.formats.hf import HFDirectory

    d = HFDirectory(mlx_dir)
    cfg = hf_model.config
    H, nope, v, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".mlp.experts." in name:
                layer = name[: name.index("experts.")]
                if name.endswith("gate_up_proj"):
                    t = torch.cat([_deq(d, layer + "switch_mlp.gate_proj.weight"),
                                   _deq(d, layer + "switch_mlp.up_proj.weight")], dim=1)
                else:
                    t = _deq(d, layer + "switch_mlp.down_proj.weight")
            elif name.endswith("kv_b_proj.weight") and not d.has(name):
                a = name.removesuffix("kv_b_proj.weight")
                t = torch.cat([_deq(d, a + "embed_q.weight").transpose(1, 2), _deq(d, a + "unembed_out.weight")], 1)
                t = t.reshape(H * (nope + v), R)
            else:
                t = _deq(d, name)
            p.copy_(t.reshape(p.shape))
    return ref


def _deq(d, name):
    t = d.tensor(name)
    return t if isinstance(t, torch.Tensor) else t.dequantize(torch.float32)


QUANT = dict(hidden_size=64, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=3)


def test_convert_to_mlx_4bit_matches_dequantized_reference(tmp_path):
    from sluice.cli import main
    from sluice.formats.hf import HFDirectory
    from sluice.quant.affine import QuantizedTensor

    hf = v3(seed=7, **QUANT)
    assert main(["convert", str(save(hf, tmp_path / "hf")), str(tmp_path / "mlx"), "--bits", "4",
                 "--group-size", "32"]) == 0
    d = HFDirectory(tmp_path / "mlx")
    names = set(d.names())
    assert "model.layers.1.mlp.switch_mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate.scales" not in names  # the router stays dense, as mlx-lm leaves it
    assert "model.layers.0.self_attn.embed_q.scales" in names and not any("kv_b_proj" in n for n in names)
    assert isinstance(d.tensor("model.layers.0.self_attn.embed_q.weight"), QuantizedTensor)
    model = sluice.load(tmp_path / "mlx", device="cpu")
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = dequantized_reference(hf, tmp_path / "mlx")(ids).logits
        plain = hf(ids).logits
    got = model.logits(ids)
    assert rel_max(got, ref) < 1e-4
    assert rel_max(got, plain) < 0.5  # 4-bit weights: close to the original, not equal

    # an older mlx-lm conversion: kv_b_proj kept (quantized) instead of embed_q / unembed_out
    from sluice.quant.affine import quantize

    def old_layout(t):
        for i in range(hf.config.num_hidden_layers):
            a = f"model.layers.{i}.self_attn."
            for n in ("embed_q", "unembed_out"):
                for f in ("weight", "scales", "biases"):
                    t.pop(f"{a}{n}.{f}")
            qt = quantize(hf.state_dict()[a + "kv_b_proj.weight"], bits=4, group_size=32)
            t.update({a + "kv_b_proj.weight": qt.weight, a + "kv_b_proj.scales": qt.scales,
                      a + "kv_b_proj.biases": qt.biases})
        return t

    old = _rewrite(tmp_path / "mlx", tmp_path / "old", old_layout)
    with torch.no_grad():
        ref_old = dequantized_reference(hf, old)(ids).logits
    assert rel_max(sluice.load(old, device="cpu").logits(ids), ref_old) < 1e-4


# -- dummy weights of the benchmark configs -----------------------------------------------------------------------

def _bench_config(name, **over):
    cfg = json.loads((CONFIGS / name).read_text())
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("name,over", [
    ("deepseek-v3.json", dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16, vocab_size=4096)),
    ("kimi-k2.json", dict(num_hidden_layers=2, n_routed_experts=16, vocab_size=4096)),
    ("deepseek-v2-lite.json", dict(num_hidden_layers=2)),
], ids=["deepseek-v3", "kimi-k2", "deepseek-v2-lite"])
def test_dummy_checkpoint_is_what_the_loader_reads(name, over):
    """Every tensor of the dummy MLX checkpoint (the real attention shapes, 4-bit) is read by the loader, at the
    shape it expects, and nothing else is asked for."""
    from sluice.formats.dummy import DummyCheckpoint
    from sluice.models import deepseek_v3

    src = DummyCheckpoint(CONFIGS, config=_bench_config(name, **over))
    read = []
    make = src.tensor
    src.tensor = lambda n, device="cpu": (read.append(n), make(n, device))[1]
    module = deepseek_v3.build_from_hf(src, torch.bfloat16)
    stored = {n for n in src.specs if not n.endswith((".scales", ".biases"))}
    assert set(read) == stored
    assert module.layers[1].mlp.top_k == module.cfg.top_k
    assert src.tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16  # dense, as mlx-lm leaves it


def test_moonlight_dummy_runs(tmp_path):
    """Moonlight-16B-A3B's config cut to two layers (one dense, one MoE), 4-bit dummy weights: loads and
    generates."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_bench_config("moonlight-16b-a3b.json", num_hidden_layers=2)))
    model = sluice.load(path, load_format="dummy", device="cpu", max_batch=2)
    out = model.logits([[1, 2, 3, 4]])
    assert out.shape == (1, 4, 163840) and torch.isfinite(out).all()
    assert len(list(model.generate_ids([5, 6, 7], max_tokens=3, temperature=0, stop_ids=()))) == 3
    info = model.info()
    assert info["architecture"] == "deepseek_v3" and info["kv_cache_bytes_per_token"] == 2 * 576 * 4


def test_info_and_run_cli(small, capsys):
    from sluice.cli import main

    _, src = small
    assert main(["info", str(src)]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v3" in out and "MLA: 4 heads, q LoRA 48, latent 32 + rope 16" in out and "latent" in out
    assert main(["run", "the cat", "--model", str(src), "--max-tokens", "4", "--temperature", "0"]) == 0


# -- bad checkpoints ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit,match", [
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(topk_group=5), "topk_group"),
    (dict(n_group=3), "n_group"),
    (dict(topk_method="bogus"), "topk_method"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
    (dict(num_experts_per_tok=7), "num_experts_per_tok"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(routed_scaling_factor="big"), "routed_scaling_factor"),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else None)
def test_bad_config_is_a_clear_error(small, tmp_path, edit, match):
    _, src = small
    d = _rewrite(src, tmp_path / "m", config=lambda c: c.update(edit))
    with pytest.raises(ModelFileError, match=match):
        sluice.load(d, device="cpu")


def test_fp8_checkpoint_missing_and_misshapen_tensors(small, tmp_path):
    _, src = small
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    d = _rewrite(src, tmp_path / "a", config=lambda c: c.update(quantization_config=fp8))
    with pytest.raises(UnsupportedError, match="FP8"):
        sluice.load(d, device="cpu")

    def scale_inv(t):
        t["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
        return t

    with pytest.raises(UnsupportedError, match="weight_scale_inv"):
        sluice.load(_rewrite(src, tmp_path / "b", scale_inv), device="cpu")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    d = _rewrite(src, tmp_path / "c", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ModelFileError, match=name.replace(".", r"\.")):
        sluice.load(d, device="cpu")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    d = _rewrite(src, tmp_path / "d", lambda t: {**t, name: torch.zeros(31, 64)})
    with pytest.raises(ModelFileError, match=name.replace(".", r"\.")):
        sluice.load(d, device="cpu")


# -- streamed experts and the GPU -----------------------------------------------------------------------------------

QUANT16 = dict(QUANT, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def quant16(tmp_path_factory):
    from sluice.formats.convert import convert

    d = tmp_path_factory.mktemp("q16")
    hf = v3(seed=9, **QUANT16)
    src = save(hf, d / "hf")
    return hf, src, convert(src, d / "mlx", bits=4, group_size=32, quiet=True)


def test_streamed_experts_give_identical_tokens(quant16):
    """The routed experts in host memory with 6 device slots a layer (misses, evictions): the same logits and
    greedy tokens as with every expert in place."""
    _, _, mlx = quant16
    whole = sluice.load(mlx, device="cpu", max_batch=3)
    streamed = sluice.load(mlx, device="cpu", expert_slots=6, max_batch=3)
    assert streamed.placement is not None and streamed.placement.slots == 6
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(4))
    assert torch.equal(whole.logits(ids), streamed.logits(ids))
    prompts = [[5, 6, 7], [9, 1, 200, 3], [42]]
    kw = dict(max_tokens=12, temperature=0)
    assert whole.generate_batch(prompts, **kw) == streamed.generate_batch(prompts, **kw)
    disk = sluice.load(mlx, device="cpu", expert_slots=6, expert_store="disk")
    assert torch.equal(whole.logits(ids), disk.logits(ids))
    dense = sluice.load(mlx, device="cpu", keep_quantized=False)
    assert rel_max(dense.logits(ids), whole.logits(ids)) < 1e-4


def test_latent_cache_prefix_copy(small):
    """A row's first positions copied into another row (what a prefix cache does) continue as the original."""
    ours = sluice.load(small[1], device="cpu")
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(6))
    cache = ours.new_cache(20, rows=2)
    ours.forward(ids[:, :15], cache, 0)
    cache.kv.copy_prefix(0, 1, 12, cache.kv)
    from sluice.engine.batch import ForwardMeta

    a = ours.module(ids[:, 15:], cache, ForwardMeta.prefill(0, 1, 15, 5, "cpu"), torch.float32)
    b = ours.module(ids[:, 12:], cache, ForwardMeta.prefill(1, 1, 12, 8, "cpu"), torch.float32)
    assert cache.kv.supports_prefix and rel_max(b[:, 3:], a) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu(quant16):
    """fp32 dense weights on the GPU (eager: the experts' reference loop): HF's logits and greedy tokens. 4-bit
    experts on the GPU: the Triton MoE kernels fed the torch router, CUDA graphs for decode steps and flat steps
    (cut at the latent attention): the CPU's logits, the same tokens with graphs and without."""
    hf, src, mlx = quant16
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    dense = sluice.load(src, device="cuda", dtype="float32")
    assert not dense.engine.runner.uses_graphs
    assert rel_max(dense.logits(ids), ref) < 1e-4
    prompt = [5, 17, 42, 99, 7, 250, 3]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert list(dense.generate_ids(prompt, max_tokens=16, temperature=0, stop_ids=())) == want

    cpu = sluice.load(mlx, device="cpu").logits(ids)
    errors = {}
    for dtype in ("float32", "bfloat16"):
        gpu = sluice.load(mlx, device="cuda", dtype=dtype, max_batch=4, prefill_chunk=16, decode_prefill_chunk=8)
        assert gpu.engine.runner.uses_graphs
        errors[dtype] = float((gpu.logits(ids) - cpu).norm() / cpu.norm())
    print(f"|gpu - cpu| / |cpu|: {errors}")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 11, 20, 29)]

    def run(model, batch):
        seqs = [model.engine.add_request(p, max_tokens=12, stop_ids=()) for p in batch]
        model.engine.run(seqs)
        return [s.output for s in seqs]

    gpu = sluice.load(mlx, device="cuda", dtype="float32", max_batch=4, prefill_chunk=16, decode_prefill_chunk=8)
    graphs = run(gpu, prompts)
    assert graphs == run(gpu.with_engine(graphs=False), prompts)
    assert errors["float32"] < 1e-3 and errors["bfloat16"] < 3e-2  # as tests/test_gpu_models.py holds Qwen3-Next
