"""Builders of tiny real-format checkpoints for tests (HF safetensors dirs, GGUF files, tokenizers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def byte_level_tokenizer_json(path: Path, vocab_size: int = 260) -> None:
    """A real (tiny) HF byte-level BPE tokenizer: the 256 byte symbols plus a few merges and <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))


def tiny_llama_config(**over):
    from transformers import LlamaConfig

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False)
    kw.update(over)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **over):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**over)).float().eval()
    with torch.no_grad():  # HF inits norms to 1 exactly; make them random so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def save_hf_dir(model, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    byte_level_tokenizer_json(path)
    return path


def _gguf_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf Q/K permutation (HF rotate-half layout -> ggml's interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_llama_gguf(model, path: Path, qtype=None) -> Path:
    """Write `model` as a llama GGUF the way llama.cpp's converter does (qtype: None = F32, or a GGMLQuantizationType
    applied to the 2-D weights)."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {})["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<|endoftext|>"] + sorted(ByteLevel.alphabet())
    tokens += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * 256 + [4] * (len(tokens) - 257))
    w.add_token_merges([])
    w.add_eos_token_id(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        t = t.float()
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            mod = rest.removesuffix(".weight")
            gname = f"blk.{i}.{per_layer[mod]}.weight"
            if mod == "self_attn.q_proj":
                t = _gguf_permute(t, cfg.num_attention_heads)
            elif mod == "self_attn.k_proj":
                t = _gguf_permute(t, cfg.num_key_value_heads)
        else:
            gname = names[name]
        arr = t.numpy().astype(np.float32)
        if qtype is not None and arr.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rel(a, b) -> float:
    """Relative error |a - b| / |b| (fp64)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def attention_reference(q, keys, values, scale):
    """q [Hq, D]; keys, values [Hkv, S, D] (the visible ones): fp64 softmax attention, GQA."""
    G = q.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(G, 0).double(), values.repeat_interleave(G, 0).double()
    p = torch.softmax((q.double()[:, None, :] * k).sum(-1) * scale, dim=-1)
    return (p[..., None] * v).sum(1)


def rewrite_checkpoint(src: Path, dst: Path, edit=None, config=None) -> Path:
    """A copy of an HF checkpoint directory (one model.safetensors) with its tensors passed through `edit` (a dict
    -> dict function) and its config.json through `config` (edits the dict in place)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if edit:
        tensors = edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst
