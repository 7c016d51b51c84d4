"""Llama: RMSNorm, RoPE, GQA attention, SwiGLU MLP (HF `LlamaForCausalLM` math), from GGUF or HF/MLX dirs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from sluice.attention import make_attention
from sluice.cache.pool import CachePool
from sluice.errors import ModelFileError, UnsupportedError
from sluice.formats.validate import head_dim_default, parse_config
from sluice.kernels.rope import rope_cos_sin
from sluice.kernels.rope.reference import rope_inv_freq
from sluice.layers.attention import Attention
from sluice.layers.linear import Linear, RMSNorm, fuse_linears
from sluice.parallel import RowParallel, TensorParallel, vocab_layers


TENSOR_PARALLEL = True  # the builders split the weights for `sluice.parallel` when the reader carries a rank


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    architecture: str = "llama"
    sliding_window: int | None = None  # Mistral-style: each query sees the last `sliding_window` positions

    @classmethod
    def from_gguf(cls, g) -> LlamaConfig:
        where = f"{g.path} (GGUF metadata)"
        return parse_config(lambda: cls._from_gguf(g, where), where)

    @classmethod
    def from_hf(cls, c: dict, where: str = "config.json") -> LlamaConfig:
        return parse_config(lambda: cls._from_hf(c, where), where)

    @classmethod
    def _from_gguf(cls, g, where: str) -> LlamaConfig:
        a = g.architecture
        hidden, heads = int(g.meta(f"{a}.embedding_length")), int(g.meta(f"{a}.attention.head_count"))
        head_dim = int(g.meta(f"{a}.attention.key_length", 0)) or head_dim_default(hidden, heads, where)
        if int(g.meta(f"{a}.rope.dimension_count", head_dim)) != head_dim:
            raise UnsupportedError("GGUF llama model with partial rotary embedding is not supported.")
        if g.meta(f"{a}.rope.scaling.type", "none") not in ("none", None):
            raise UnsupportedError(f"GGUF llama model with RoPE scaling '{g.meta(f'{a}.rope.scaling.type')}' is "
                                   "not supported yet.")
        vocab = g.meta(f"{a}.vocab_size", None) or len(g.fields["tokenizer.ggml.tokens"].data)
        return cls(vocab_size=int(vocab), hidden_size=hidden,
                   intermediate_size=int(g.meta(f"{a}.feed_forward_length")),
                   num_layers=int(g.meta(f"{a}.block_count")), num_heads=heads,
                   num_kv_heads=int(g.meta(f"{a}.attention.head_count_kv", heads)), head_dim=head_dim,
                   rope_theta=float(g.meta(f"{a}.rope.freq_base", 10000.0)),
                   rms_norm_eps=float(g.meta(f"{a}.attention.layer_norm_rms_epsilon")),
                   context_length=int(g.meta(f"{a}.context_length", 2048)),
                   tie_word_embeddings=not g.has("output.weight"),
                   sliding_window=_window(g.meta(f"{a}.attention.sliding_window", None)))

    @classmethod
    def _from_hf(cls, c: dict, where: str) -> LlamaConfig:
        rs = c.get("rope_scaling") or (c.get("rope_parameters") or {})
        if rs and rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
            raise UnsupportedError(f"Llama with rope_scaling {rs.get('rope_type', rs.get('type'))!r} is not "
                                   "supported yet.")
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise UnsupportedError("Llama with attention/MLP biases is not supported yet.")
        heads = c["num_attention_heads"]
        theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                   intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or head_dim_default(c["hidden_size"], heads, where),
                   rope_theta=float(theta),
                   rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   context_length=int(c.get("max_position_embeddings", 2048)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                   architecture=c.get("model_type", "llama"),
                   sliding_window=_window(c.get("sliding_window") if c.get("use_sliding_window", True) else None))


def _window(w) -> int | None:
    return int(w) if w else None


# HF parameter name -> GGUF tensor name (llama.cpp's convert_hf_to_gguf naming).
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        return f"blk.{i}.{_GGUF_NAMES[rest]}"
    return _GGUF_NAMES[hf_name]


def _unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves for ggml's RoPE)."""
    from sluice.quant.affine import QuantizedTensor

    def fix(t):
        rows = t.shape[0]
        return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(fix(w.weight), fix(w.scales), fix(w.biases), w.bits, w.group_size)
    return fix(w)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, get, i: int, tp: TensorParallel | None = None):
        """With `tp`, this rank's heads and MLP slice (`sluice/parallel`): q, k, v, gate and up column-parallel,
        o and down row-parallel."""
        super().__init__()
        p = f"model.layers.{i}."
        col = (lambda w, what, unit=1: w) if tp is None else tp.col  # noqa: E731
        row = (lambda w: w) if tp is None else tp.row  # noqa: E731
        kv = (lambda w: w) if tp is None else lambda w: tp.kv(w, cfg.num_kv_heads, cfg.head_dim)  # noqa: E731
        size = 1 if tp is None else tp.size
        self.attn_norm = RMSNorm(get(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(get(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        q = Linear(col(get(p + "self_attn.q_proj.weight"), "attention heads", cfg.head_dim))
        k, v = (Linear(kv(get(p + f"self_attn.{n}_proj.weight"))) for n in "kv")
        qkv = fuse_linears([q, k, v])
        o = Linear(row(get(p + "self_attn.o_proj.weight")))
        self.attn = Attention(qkv, o if tp is None else RowParallel(o, tp), cfg.num_heads // size,
                              cfg.num_kv_heads if tp is None else tp.kv_heads(cfg.num_kv_heads), cfg.head_dim, i)
        gate, up = (Linear(col(get(p + f"mlp.{n}_proj.weight"), "the MLP's intermediate size")) for n in ("gate", "up"))
        self.gate_up = fuse_linears([gate, up])
        down = Linear(row(get(p + "mlp.down_proj.weight")))
        self.down = down if tp is None else RowParallel(down, tp)
        self.intermediate_size = cfg.intermediate_size // size

    def forward(self, h, cos, sin, cache, meta):
        h = h + self.attn(self.attn_norm(h), cos, sin, cache, meta)
        x = self.mlp_norm(h)
        g, u = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return h + self.down(F.silu(g) * u)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, get, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        embed = get("model.embed_tokens.weight")
        head = None if cfg.tie_word_embeddings else get("lm_head.weight")
        self.embed, self.lm_head = vocab_layers(embed, head, cfg.tie_word_embeddings, cfg.vocab_size, tp)
        self.layers = nn.ModuleList(LlamaBlock(cfg, get, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(get("model.norm.weight"), cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def new_cache(self, rows: int, capacity: int, dtype: torch.dtype, device, kind: str = "dense",
                  page: int | None = None, blocks: int | None = None) -> CachePool:
        """Caches for `rows` sequences of up to `capacity` positions (and the pool's scratch row); with `page`, KV in
        `blocks` blocks of `page` positions where the cache kind pages (`cache/blocks.py`)."""
        c = self.cfg
        kv_heads = c.num_kv_heads if self.tp is None else self.tp.kv_heads(c.num_kv_heads)  # this rank's
        attention = make_attention(kind, c.num_layers, rows + 1, kv_heads, c.head_dim, capacity, dtype,
                                   device, window=c.sliding_window, page=page, blocks=blocks)
        return CachePool(attention, None, rows)

    def check_cache_kind(self, kind: str) -> None:
        """ValueError when this model cannot use a KV cache of this kind."""
        self.new_cache(1, 1, torch.float32, "meta", kind)

    def forward(self, ids: torch.Tensor, cache: CachePool, meta, dtype: torch.dtype, last_only: bool = False):
        """Logits (float32) [B, T or 1, vocab] of ids [B, T] at meta's rows and positions, updating the cache."""
        h = self.embed(ids, dtype)
        cos, sin = rope_cos_sin(meta.positions, self.inv_freq, dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, cache, meta)
        if last_only:
            h = h[:, meta.last_tokens]
        return self.lm_head(self.norm(h)).float()


def _prepare(t, dtype):
    return t if not isinstance(t, torch.Tensor) else t.to(dtype)


def expected_shape(cfg: LlamaConfig, hf_name: str) -> tuple[int, ...]:
    """The shape config.json (or the GGUF metadata) implies for a weight, under its HF name."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    leaf = hf_name.split(".")[-2]
    return {"embed_tokens": (V, H), "lm_head": (V, H), "norm": (H,), "input_layernorm": (H,),
            "post_attention_layernorm": (H,), "q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H),
            "o_proj": (H, q), "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}[leaf]


def checked(cfg: LlamaConfig, read, where):
    """`read(hf_name)` with each tensor's shape (and kind: norms dense) checked against the config before any
    kernel sees it."""
    def get(hf_name):
        t = read(hf_name)
        want, got = expected_shape(cfg, hf_name), tuple(t.shape)
        if got != want:
            raise ModelFileError(f"{where}: tensor '{hf_name}' has shape {got}, but the config implies {want}. The "
                                 "weights and the config do not belong together (or the file is corrupt).")
        if len(want) == 1 and not isinstance(t, torch.Tensor):
            raise ModelFileError(f"{where}: norm weight '{hf_name}' is quantized; sluice needs it dense.")
        return t
    return get


def build_from_gguf(g, dtype: torch.dtype) -> LlamaModel:
    cfg = LlamaConfig.from_gguf(g)
    read = checked(cfg, lambda hf_name: _prepare(g.tensor(_gguf_name(hf_name)), dtype), g.path)

    def get(hf_name):
        t = read(hf_name)
        if hf_name.endswith("q_proj.weight"):
            t = _unpermute_rows(t, cfg.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            t = _unpermute_rows(t, cfg.num_kv_heads)
        return t

    return LlamaModel(cfg, get, getattr(g, "tp", None))


def build_from_hf(d, dtype: torch.dtype) -> LlamaModel:
    cfg = LlamaConfig.from_hf(d.config, f"{d.path}/config.json")
    return LlamaModel(cfg, checked(cfg, lambda name: _prepare(d.tensor(name), dtype), d.path), getattr(d, "tp", None))
