"""Qwen3-Next and Qwen3.5-MoE against HF transformers: random-init small configs, fp32, CPU."""

import pytest
import torch

import sluice
from helpers import byte_level_tokenizer_json

transformers = pytest.importorskip("transformers")


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def randomize_norms(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF inits zero-centred norms to 0 and the gated norm to 1: make them random
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("linear_attn.norm.weight")
                                                                  else 0.0))


def qwen3_next(seed=0, **over):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, full_attention_interval=2,
              max_position_embeddings=512, norm_topk_prob=True)
    kw.update(over)
    torch.manual_seed(seed)
    m = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**kw)).float().eval()
    randomize_norms(m, seed)
    return m


def qwen3_5_moe(seed=0, **over):
    kw = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, full_attention_interval=2, max_position_embeddings=512)
    kw.update(over)
    torch.manual_seed(seed)
    m = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw)).float().eval()
    randomize_norms(m, seed)
    return m


def save(model, path):
    model.save_pretrained(path, safe_serialization=True)
    byte_level_tokenizer_json(path)
    return path


CASES = [
    ("next-gva2", qwen3_next, {}),
    ("next-gva1", qwen3_next, dict(linear_num_value_heads=2)),
    ("next-gva4-interval3-nonorm", qwen3_next, dict(linear_num_key_heads=1, num_hidden_layers=3,
                                                    full_attention_interval=3, norm_topk_prob=False,
                                                    linear_key_head_dim=24, num_experts_per_tok=3)),
    ("next-mlp-only", qwen3_next, dict(mlp_only_layers=[1], decoder_sparse_step=1)),
    ("3.5-moe", qwen3_5_moe, {}),
    ("3.5-moe-gva4", qwen3_5_moe, dict(linear_num_key_heads=1, head_dim=16, num_experts=6, num_experts_per_tok=4)),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    _, make, over = request.param
    hf = make(seed=len(request.param[0]), **over)
    ours = sluice.load(save(hf, tmp_path_factory.mktemp("m")), device="cpu")
    return hf, ours


@pytest.mark.parametrize("T", [1, 70, 133])
def test_logits_match_transformers(pair, T):
    hf, ours = pair
    ids = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(ours.logits(ids), ref) < 1e-4


def test_chunked_prefill_and_decode_equal_full_forward(pair):
    _, ours = pair
    ids = torch.randint(0, 300, (1, 90), generator=torch.Generator().manual_seed(1))
    full = ours.logits(ids)[0]
    cache = ours.new_cache(90)
    parts = [ours.forward(ids[:, s:min(s + 32, 80)], cache, s)[0] for s in range(0, 80, 32)]
    for t in range(80, 90):
        parts.append(ours.forward(ids[:, t:t + 1], cache, t, last_only=False)[0])
    assert rel_err(torch.cat(parts), full) < 1e-5


@pytest.mark.parametrize("name,more", [("next-gva4-interval3-nonorm", {}), ("3.5-moe-gva4", {}),
                                       ("next-gva2", {"linear_value_head_dim": 32})],
                         ids=["next-gva4-interval3-nonorm", "3.5-moe-gva4", "next-gva2-dv32"])
def test_gdn_triton_kernels_in_the_layer(name, more, tmp_path, monkeypatch):
    """The GatedDeltaNet layer on the Triton kernels (interpreter on CPU): logits as HF's, and chunked prefill +
    decode steps (the state updated in place in the cache, the gated norm in the recurrent launch: with dv = 32
    two programs a head, the last one normalising) equal to the full forward."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the layer takes the kernels by itself: tests/test_gpu_models.py")
    from sluice.kernels.gdn import triton as gdn_triton
    monkeypatch.setattr("sluice.layers.gated_deltanet.gdn_kernels", lambda x, dims: gdn_triton)
    _, make, over = next(c for c in CASES if c[0] == name)
    hf = make(seed=len(name), **over, **more)
    ours = sluice.load(save(hf, tmp_path), device="cpu")
    ids = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(ours.logits(ids), ref) < 1e-4
    full = ours.logits(ids[:1])[0]
    cache = ours.new_cache(70)
    parts = [ours.forward(ids[:1, s:min(s + 32, 66)], cache, s)[0] for s in range(0, 66, 32)]
    for t in range(66, 70):
        parts.append(ours.forward(ids[:1, t:t + 1], cache, t, last_only=False)[0])
    assert rel_err(torch.cat(parts), full) < 1e-5


def test_greedy_generation_matches_transformers(pair):
    hf, ours = pair
    prompt = [5, 17, 42, 99, 7, 250]
    got = list(ours.generate_ids(prompt, max_tokens=32, temperature=0.0, stop_ids=()))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref


def dequantized_reference(hf_model, mlx_dir):
    """HF model whose parameters are the converted MLX checkpoint's, dequantized (inverse of mlx_plan)."""
    import copy

    from sluice.formats.hf import HFDirectory

    d = HFDirectory(mlx_dir)
    ref = copy.deepcopy(hf_model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if ".mlp.experts." in name:
                layer = name[: name.index("experts.")]
                if name.endswith("gate_up_proj"):
                    t = torch.cat([_deq(d, layer + "switch_mlp.gate_proj.weight"),
                                   _deq(d, layer + "switch_mlp.up_proj.weight")], dim=1)
                else:
                    t = _deq(d, layer + "switch_mlp.down_proj.weight")
            elif name.endswith("conv1d.weight"):
                t = d.tensor(name).moveaxis(1, 2)
            elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
                t = d.tensor(name) - 1.0
            else:
                t = _deq(d, name)
            p.copy_(t.reshape(p.shape))
    return ref


def _deq(d, name):
    t = d.tensor(name)
    return t if isinstance(t, torch.Tensor) else t.dequantize(torch.float32)


@pytest.mark.parametrize("make,bits,gs", [(qwen3_next, 4, 32), (qwen3_next, 8, 64), (qwen3_5_moe, 4, 32)])
def test_converted_model_matches_hf_on_dequantized_weights(tmp_path, make, bits, gs):
    from sluice.cli import main

    hf = make(seed=7)
    src = save(hf, tmp_path / "hf")
    assert main(["convert", str(src), str(tmp_path / "mlx"), "--bits", str(bits), "--group-size", str(gs)]) == 0
    model = sluice.load(tmp_path / "mlx", device="cpu")
    ids = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = dequantized_reference(hf, tmp_path / "mlx")(ids).logits
    assert rel_err(model.logits(ids), ref) < 1e-4
    again = sluice.load(tmp_path / "mlx", device="cpu")  # loads back from disk identically
    assert torch.equal(again.logits(ids), model.logits(ids))


def test_convert_refuses_existing_destination_and_bad_bits(tmp_path, capsys):
    from sluice.cli import main

    src = save(qwen3_next(seed=1), tmp_path / "hf")
    assert main(["convert", str(src), str(tmp_path / "hf"), "--bits", "4"]) == 2
    with pytest.raises(SystemExit) as exit_:  # argparse: --bits takes 2, 3, 4, 5, 6 or 8
        main(["convert", str(src), str(tmp_path / "out"), "--bits", "7"])
    assert exit_.value.code == 2 and "--bits: invalid choice: 7" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _edit_checkpoint(src, dst, drop=None, reshape=None, config=None):
    """Copy an HF dir, dropping or replacing one tensor, or editing config.json."""
    from helpers import rewrite_checkpoint

    def edit(tensors):
        if drop:
            del tensors[drop]
        if reshape:
            name, shape = reshape
            tensors[name] = torch.zeros(shape)
        return tensors

    return rewrite_checkpoint(src, dst, edit, config)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return save(qwen3_next(seed=3), tmp_path_factory.mktemp("good") / "m")


def test_missing_tensor_is_named(good_dir, tmp_path, capsys):
    from sluice.cli import main

    name = "model.layers.1.self_attn.k_proj.weight"
    d = _edit_checkpoint(good_dir, tmp_path / "m", drop=name)
    assert main(["info", str(d)]) == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("name,shape", [("model.layers.1.self_attn.q_proj.weight", (200, 64)),
                                        ("model.layers.0.linear_attn.in_proj_ba.weight", (8, 32)),
                                        ("model.layers.0.mlp.experts.3.down_proj.weight", (64, 31)),
                                        ("model.layers.2.linear_attn.conv1d.weight", (128, 1, 3))])
def test_shape_disagreeing_with_config_is_named(good_dir, tmp_path, name, shape):
    from sluice.errors import ModelFileError

    d = _edit_checkpoint(good_dir, tmp_path / "m", reshape=(name, shape))
    with pytest.raises(ModelFileError, match="conv1d|experts|" + name.replace(".", r"\.")):
        sluice.load(d, device="cpu")


def test_missing_config_key_and_unknown_model_type(good_dir, tmp_path):
    from sluice.errors import ModelFileError, UnsupportedError

    d = _edit_checkpoint(good_dir, tmp_path / "a", config=lambda c: c.pop("linear_num_value_heads"))
    with pytest.raises(ModelFileError, match="linear_num_value_heads"):
        sluice.load(d, device="cpu")
    d = _edit_checkpoint(good_dir, tmp_path / "b", config=lambda c: c.update(model_type="qwen9_next"))
    with pytest.raises(UnsupportedError, match="qwen9_next"):
        sluice.load(d, device="cpu")


def test_wrong_quantization_block(tmp_path):
    import json

    from sluice.errors import ModelFileError

    src = save(qwen3_next(seed=5), tmp_path / "hf")
    from sluice.formats.convert import convert

    d = convert(src, tmp_path / "mlx", bits=4, group_size=32, quiet=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"]["group_size"] = 64  # disagrees with the stored scales
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="quantization"):
        sluice.load(d, device="cpu")


def test_cli_run_and_info_on_a_hybrid_model(good_dir, capsys):
    from sluice.cli import main

    assert main(["run", "the cat", "--model", str(good_dir), "--max-tokens", "4", "--temperature", "0"]) == 0
    assert main(["info", str(good_dir)]) == 0
    assert "qwen3_next" in capsys.readouterr().out


def test_multimodal_layout_qwen3_5_moe(tmp_path):
    """Qwen3.5/3.6 checkpoints as published: model_type qwen3_5_moe with a nested text_config, the text model
    under model.language_model.*, vision weights beside it (ignored). Loads, and converts to MLX's
    language_model.* naming."""
    import json

    from safetensors.torch import load_file, save_file

    hf = qwen3_5_moe(seed=9)
    src = save(hf, tmp_path / "text")
    d = tmp_path / "vl"
    d.mkdir()
    tensors = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(d / "model.safetensors"))
    text_cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text_cfg,
                                               "vision_config": {"depth": 1}}))
    byte_level_tokenizer_json(d)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(sluice.load(d, device="cpu").logits(ids), ref) < 1e-4

    from sluice.formats.convert import convert
    from sluice.formats.hf import HFDirectory

    out = convert(d, tmp_path / "mlx", bits=8, group_size=32, quiet=True)
    names = set(HFDirectory(out).names())
    assert "language_model.model.embed_tokens.weight" in names and "language_model.lm_head.weight" in names
    assert not any(n.startswith(("model.visual", "mtp.")) for n in names)
    assert rel_err(sluice.load(out, device="cpu").logits(ids), ref) < 2e-2  # 8-bit weights: close, not equal


def test_keep_quantized_false_dequantizes_experts(tmp_path):
    from sluice.formats.convert import convert
    from sluice.quant.affine import QuantizedTensor

    q = convert(save(qwen3_next(seed=6), tmp_path / "hf"), tmp_path / "q", bits=4, group_size=32, quiet=True)
    packed, dense = sluice.load(q, device="cpu"), sluice.load(q, device="cpu", keep_quantized=False)
    assert not any(isinstance(getattr(m, "gate_up", None), QuantizedTensor) for m in dense.module.modules())
    ids = torch.randint(0, 300, (1, 33), generator=torch.Generator().manual_seed(0))
    assert rel_err(dense.logits(ids), packed.logits(ids)) < 1e-5
