"""Llama against HF transformers (random-init tiny configs, fp32) through every checkpoint path."""

import gguf
import numpy as np
import pytest
import torch

import sluice
from helpers import save_hf_dir, save_llama_gguf, tiny_llama

pytest.importorskip("transformers")


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama(seed=1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 300, (2, 37), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("over", [{}, {"num_key_value_heads": 4},
                                  {"num_key_value_heads": 1, "tie_word_embeddings": True}])
def test_hf_dir_logits_match_transformers(tmp_path, ids, over):
    hf = tiny_llama(seed=2, **over)
    model = sluice.load(save_hf_dir(hf, tmp_path / "m"), device="cpu")
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(model.logits(ids), ref) < 1e-4


def test_gguf_f32_matches_transformers(tmp_path, hf_model, ids):
    model = sluice.load(save_llama_gguf(hf_model, tmp_path / "m.gguf"), device="cpu")
    with torch.no_grad():
        ref = hf_model(ids).logits
    assert rel_err(model.logits(ids), ref) < 1e-4


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q4_0])
def test_gguf_quantized_matches_transformers_on_dequantized_weights(tmp_path, hf_model, ids, qtype):
    """A quantized GGUF equals HF run on the same weights dequantized (the quantization itself is the only loss)."""
    path = save_llama_gguf(hf_model, tmp_path / "m.gguf", qtype=qtype)
    model = sluice.load(path, device="cpu")
    reader = gguf.GGUFReader(path)
    deq = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(
        tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    ref_model = tiny_llama(seed=1)
    cfg = ref_model.config
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            from sluice.models.llama import _gguf_name, _unpermute_rows

            t = deq[_gguf_name(name)]
            if "q_proj" in name:
                t = _unpermute_rows(t, cfg.num_attention_heads)
            elif "k_proj" in name:
                t = _unpermute_rows(t, cfg.num_key_value_heads)
            p.copy_(t)
        ref = ref_model(ids).logits
    assert rel_err(model.logits(ids), ref) < 1e-4


def test_mlx_quantized_dir_matches_transformers_on_dequantized_weights(tmp_path, hf_model, ids):
    """An MLX-layout quantized directory (weight uint32 + scales + biases) gives HF's logits on the dequantized
    weights."""
    import json

    from safetensors.torch import save_file

    from helpers import byte_level_tokenizer_json
    from sluice.quant.affine import quantize

    d = tmp_path / "mlx"
    d.mkdir()
    tensors, ref_model = {}, tiny_llama(seed=1)
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                qt = quantize(p.detach(), bits=4, group_size=32)
                mod = name.removesuffix(".weight")
                tensors[name], tensors[mod + ".scales"], tensors[mod + ".biases"] = qt.weight, qt.scales, qt.biases
                p.copy_(qt.dequantize(torch.float32))
            else:
                tensors[name] = p.detach().clone()
        ref = ref_model(ids).logits
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "mlx"})
    cfg = ref_model.config.to_dict()
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    byte_level_tokenizer_json(d)
    model = sluice.load(d, device="cpu")
    assert rel_err(model.logits(ids), ref) < 1e-4


def test_incremental_decode_equals_full_forward(tmp_path, hf_model):
    model = sluice.load(save_hf_dir(hf_model, tmp_path / "m"), device="cpu")
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(9))
    full = model.logits(ids)[0]
    cache = model.new_cache(20)
    steps = [model.forward(ids[:, :7], cache, 0, last_only=False)[0]]
    steps.append(model.forward(ids[:, 7:12], cache, 7, last_only=False)[0])  # a chunk against a cache
    for t in range(12, 20):
        steps.append(model.forward(ids[:, t:t + 1], cache, t, last_only=False)[0])
    assert rel_err(torch.cat(steps), full) < 1e-5


def test_greedy_generation_matches_transformers(tmp_path, hf_model):
    model = sluice.load(save_hf_dir(hf_model, tmp_path / "m"), device="cpu")
    prompt = [5, 17, 42, 99, 7]
    ours = list(model.generate_ids(prompt, max_tokens=24, temperature=0.0, stop_ids=()))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
