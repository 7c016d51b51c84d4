"""DeepSeek-V3 (`deepseek_v3`; Kimi-K2's `kimi_k2`, Moonlight) and DeepSeek-V2 (`deepseek_v2`): multi-head latent
attention (`layers/mla.py`) over a latent cache (`cache/latent.py`), DeepSeekMoE (`layers/deepseek_moe.py`: group-
limited sigmoid / softmax router, routed and shared experts) after `first_k_dense_replace` dense MLP layers. HF
transformers' math (`DeepseekV3ForCausalLM`, `DeepseekV2ForCausalLM`).

Checkpoint layouts read: HF (per-expert `mlp.experts.E.{gate,up,down}_proj`, or transformers' fused
`experts.gate_up_proj` / `experts.down_proj`), MLX as mlx-lm writes it (stacked `switch_mlp`, kv_b_proj split per
head into `embed_q` [H, R, nope] = W_UK^T and `unembed_out` [H, v, R] = W_UV, or an older conversion's kv_b_proj;
the router dense). Undone at load: DeepSeek's interleaved RoPE pairs (the rope rows of q and of kv_a reordered so
that rotate-half RoPE gives HF's result); kv_b_proj is held dense in the model's dtype, per head (both attention
forms use it). Laid out at load: n > 1 shared experts' gate_up rows in n slots [g0 | u0 | g1 | u1 | ...]
(`layers.moe.swiglu`), which the MoE's decode GEMVs read as n more experts where they lie. The
multi-token-prediction layers (index >= num_hidden_layers) are not read; FP8 checkpoints (`weight_scale_inv`) are
refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from sluice.attention.mla import make_mla_attention
from sluice.cache.pool import CachePool
from sluice.errors import ModelFileError, UnsupportedError
from sluice.formats.convert import stacked_experts
from sluice.formats.validate import parse_config
from sluice.kernels.mla import chain
from sluice.kernels.moe import ExpertOutputs
from sluice.kernels.rope import rope_cos_sin
from sluice.kernels.rope.reference import rope_inv_freq
from sluice.layers.deepseek_moe import DeepseekMoE, Routing
from sluice.layers.linear import Linear, RMSNorm, fuse_linears
from sluice.layers.mla import MLA, yarn_inv_freq, yarn_mscale
from sluice.layers.moe import SwiGLU, swiglu
from sluice.parallel import RowParallel, vocab_layers
from sluice.quant.affine import QuantizedTensor

TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
SCORING_FUNCS = ("sigmoid", "softmax")


TENSOR_PARALLEL = True  # the builders split the weights for `sluice.parallel` when the reader carries a rank


@dataclass
class DeepseekConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # = num_heads (MLA has no KV head groups; the cache is one latent a token)
    head_dim: int  # the query / key head: qk_nope_head_dim + qk_rope_head_dim
    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_interleave: bool  # DeepSeek's RoPE rotates adjacent pairs (HF `rope_interleave`; always for V2)
    rope_type: str  # "default" | "yarn"
    rope_factor: float
    rope_original_max_positions: int
    rope_beta_fast: float
    rope_beta_slow: float
    rope_truncate: bool
    rope_attention_factor: float  # YaRN's factor on cos / sin
    softmax_scale: float  # head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    intermediate_size: int  # the dense MLP layers
    moe_intermediate_size: int
    num_experts: int  # routed experts (0: every layer dense)
    top_k: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint (not loaded)
    architecture: str = "deepseek_v3"

    def is_moe(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def routing(self) -> Routing:
        return Routing(self.scoring_func, self.topk_method, self.n_group, self.topk_group, self.norm_topk_prob,
                       self.routed_scaling_factor)

    def describe(self) -> str:
        """The attention and MoE shape in one line (`sluice info`)."""
        q = f"q LoRA {self.q_lora_rank}" if self.q_lora_rank else "plain q"
        rope = f"YaRN x{self.rope_factor:g}" if self.rope_type == "yarn" else "RoPE"
        moe = "no MoE"
        if self.num_experts:
            groups = f", {self.topk_group} of {self.n_group} groups" if self.n_group > 1 else ""
            moe = (f"{self.num_experts} experts of {self.moe_intermediate_size} ({self.top_k} active{groups}, "
                   f"{self.scoring_func}, {self.topk_method}) + {self.n_shared_experts} shared, first "
                   f"{self.first_k_dense_replace} layer(s) dense")
        return (f"MLA: {self.num_heads} heads, {q}, latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim} "
                f"cached a token, qk {self.qk_nope_head_dim}+{self.qk_rope_head_dim} / v {self.v_head_dim}, {rope}; "
                f"MoE: {moe}")

    @classmethod
    def from_hf(cls, c: dict, where: str = "config.json") -> DeepseekConfig:
        return parse_config(lambda: cls._from_hf(c, where), where)

    @classmethod
    def _from_hf(cls, c: dict, where: str) -> DeepseekConfig:
        model_type = c.get("model_type")
        v2 = model_type == "deepseek_v2"
        try:
            if c.get("attention_bias"):
                raise UnsupportedError(f"{model_type} with attention biases is not supported yet.")
            if c.get("hidden_act", "silu") != "silu":
                raise UnsupportedError(f"{model_type} with hidden_act {c.get('hidden_act')!r} is not supported.")
            rp = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
            rope_type = rp.get("rope_type", rp.get("type")) or "default"
            if rope_type not in ("default", "yarn"):
                raise UnsupportedError(f"{model_type}: rope scaling {rope_type!r} is not supported (default or yarn).")
            max_pos = int(c.get("max_position_embeddings", 4096))
            nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            head_dim = nope + rope
            factor, original, attention_factor, scale = 1.0, max_pos, 1.0, head_dim ** -0.5
            if rope_type == "yarn":
                original = int(c.get("original_max_position_embeddings")
                               or rp.get("original_max_position_embeddings") or max_pos)
                factor = float(rp["factor"] if rp.get("factor") is not None else max_pos / original)
                mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
                attention_factor = rp.get("attention_factor")
                if attention_factor is None:
                    attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                                        if mscale and mscale_all_dim else yarn_mscale(factor))
                if mscale_all_dim:
                    scale *= yarn_mscale(factor, mscale_all_dim) ** 2
            heads = c["num_attention_heads"]
            cfg = cls(model_type=model_type, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                      num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                      q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=v,
                      rope_theta=float(c.get("rope_theta", rp.get("rope_theta", 10000.0))),
                      rope_interleave=True if v2 else bool(c.get("rope_interleave", True)), rope_type=rope_type,
                      rope_factor=factor, rope_original_max_positions=original,
                      rope_beta_fast=float(rp.get("beta_fast") or 32), rope_beta_slow=float(rp.get("beta_slow") or 1),
                      rope_truncate=bool(rp.get("truncate", True)), rope_attention_factor=float(attention_factor),
                      softmax_scale=float(scale), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                      context_length=max_pos, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                      intermediate_size=c.get("intermediate_size") or 0,
                      moe_intermediate_size=c.get("moe_intermediate_size") or 1,
                      num_experts=c.get("n_routed_experts") or 0, top_k=c.get("num_experts_per_tok") or 0,
                      n_shared_experts=c.get("n_shared_experts") or 0, n_group=c.get("n_group") or 1,
                      topk_group=c.get("topk_group") or 1,
                      topk_method=c.get("topk_method") or ("greedy" if v2 else "noaux_tc"),
                      scoring_func=c.get("scoring_func") or ("softmax" if v2 else "sigmoid"),
                      norm_topk_prob=bool(c.get("norm_topk_prob", not v2)),
                      routed_scaling_factor=c.get("routed_scaling_factor", 1.0 if v2 else 2.5),
                      first_k_dense_replace=c.get("first_k_dense_replace") or 0,
                      moe_layer_freq=c.get("moe_layer_freq") or 1,
                      num_nextn_predict_layers=c.get("num_nextn_predict_layers") or 0,
                      architecture=model_type)
        except KeyError as e:
            raise ModelFileError(f"{where} of this {model_type} model lacks the key {e.args[0]!r}.") from e
        return cfg


class DeepseekBlock(nn.Module):
    def __init__(self, cfg: DeepseekConfig, w: _Weights, i: int):
        super().__init__()
        p = f"model.layers.{i}."
        H = cfg.hidden_size
        self.attn_norm = RMSNorm(w.get(p + "input_layernorm.weight", (H,)), cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(w.get(p + "post_attention_layernorm.weight", (H,)), cfg.rms_norm_eps)
        self.attn = w.mla(cfg, p + "self_attn.", i)
        self.mlp = w.moe(cfg, p + "mlp.") if cfg.is_moe(i) else w.mlp(p + "mlp.", cfg.intermediate_size, H)
        self.tp = w.tp  # tensor-parallel: the MLP's (or MoE's) partial sums are summed over the ranks

    def forward(self, h, delta, cos, sin, cache, meta):
        """(h, delta) -> (h', delta'): the residual stream and the last sublayer's output not yet added to it (None
        at the first layer), so that on the GPU every residual add runs in one launch with the norm after it
        (`kernels/mla/chain.py`), and delta may be what the kernels before left unsummed: o_proj's and the dense
        MLP's split-K partials, the MoE experts' outputs (`ExpertOutputs`). On the CPU the same ops as before."""
        h, x, _ = chain.add_rms_norm(h, delta, self.attn_norm)
        if self.tp is not None:  # the plain path: o_proj's output and the MLP's summed over the ranks
            h, x, _ = chain.add_rms_norm(h, self.attn(x, cos, sin, cache, meta), self.mlp_norm)
            return h, self.tp.all_reduce(self.mlp(x))
        fused = chain.applies(h)
        mixed = self.attn(x, cos, sin, cache, meta, unsummed=fused)
        moe = isinstance(self.mlp, DeepseekMoE)
        h, x, x32 = chain.add_rms_norm(h, mixed, self.mlp_norm, out32=moe and fused)
        if moe:
            return h, self.mlp.unsummed(x, x32)
        if fused:
            y = chain.swiglu_gemv(self.mlp, x.reshape(-1, x.shape[-1]))
            if y is not None:
                return h, chain.Partials(y, x.dtype)
        return h, self.mlp(x)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: DeepseekConfig, w: _Weights):
        super().__init__()
        self.cfg, self.tp = cfg, w.tp
        shape = (cfg.vocab_size, cfg.hidden_size)
        embed = w.get("model.embed_tokens.weight", shape)
        head = None if cfg.tie_word_embeddings else w.get("lm_head.weight", shape)
        self.embed, self.lm_head = vocab_layers(embed, head, cfg.tie_word_embeddings, cfg.vocab_size, w.tp)
        self.layers = nn.ModuleList(DeepseekBlock(cfg, w, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(w.get("model.norm.weight", (cfg.hidden_size,)), cfg.rms_norm_eps)
        c = cfg
        if c.rope_type == "yarn":
            inv_freq = yarn_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_factor, c.rope_original_max_positions,
                                     c.rope_beta_fast, c.rope_beta_slow, c.rope_truncate)
        else:
            inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def new_cache(self, rows: int, capacity: int, dtype: torch.dtype, device, kind: str = "dense",
                  page: int | None = None, blocks: int | None = None) -> CachePool:
        """Caches for `rows` sequences of up to `capacity` positions (and the pool's scratch row): the latent cache,
        in `blocks` blocks of `page` positions when `page` is given (`cache/blocks.py`)."""
        c = self.cfg
        attention = make_mla_attention(kind, c.num_layers, rows + 1, c.kv_lora_rank, c.qk_rope_head_dim, capacity,
                                       dtype, device, page, blocks)
        return CachePool(attention, None, rows)

    def check_cache_kind(self, kind: str) -> None:
        """ValueError when this model cannot use a KV cache of this kind."""
        self.new_cache(1, 1, torch.float32, "meta", kind)

    def forward(self, ids: torch.Tensor, cache: CachePool, meta, dtype: torch.dtype, last_only: bool = False):
        """Logits (float32) [B, T or 1, vocab] of ids [B, T] at meta's rows and positions, updating the cache."""
        h = self.embed(ids, dtype)
        cos, sin = rope_cos_sin(meta.positions, self.inv_freq, dtype)
        if self.cfg.rope_attention_factor != 1.0:  # YaRN: HF scales the fp32 tables, then casts
            af = self.cfg.rope_attention_factor
            cos, sin = ((t.float() * af).to(dtype) for t in (cos, sin))
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, cache, meta)
        last = meta.last_tokens
        if last_only and not (h.shape[1] == 1 and isinstance(last, slice)):  # (a decode step's one token: as is)
            if isinstance(delta, ExpertOutputs):
                delta = delta.combine().view(h.shape)
            elif isinstance(delta, chain.Partials):
                delta = delta.sum().view(h.shape)
            h, delta = h[:, last], (None if delta is None else delta[:, last])
        return self.lm_head(chain.add_rms_norm(h, delta, self.norm)[1]).float()


class _Weights:
    """Reads one checkpoint's tensors under HF names, checks their shapes, undoes the layout quirks."""

    def __init__(self, src, cfg: DeepseekConfig, dtype: torch.dtype):
        self.src, self.cfg, self.dtype = src, cfg, dtype
        self.tp = getattr(src, "tp", None)  # this rank's part of a tensor-parallel model (`sluice.parallel`)
        self.size = 1 if self.tp is None else self.tp.size

    def get(self, name: str, shape: tuple | None = None, keep_dtype: bool = False):
        """A tensor (model dtype) or QuantizedTensor; `shape` (logical, as config.json implies) is checked."""
        t = self.src.tensor(name)
        got = tuple(t.shape)
        if shape is not None and got != tuple(shape):
            raise ModelFileError(f"{self.src.path}: tensor '{name}' has shape {got}, but config.json implies "
                                 f"{tuple(shape)}. The checkpoint and its config.json do not belong together.")
        if len(got) == 1 and not isinstance(t, torch.Tensor):
            raise ModelFileError(f"{self.src.path}: '{name}' is quantized; sluice needs it dense.")
        return t.to(self.dtype) if isinstance(t, torch.Tensor) and not keep_dtype else t

    def dense(self, name: str, shape: tuple) -> torch.Tensor:
        """A weight in the model's dtype, dequantized when the checkpoint quantized it."""
        t = self.get(name, shape)
        return t.dequantize(self.dtype) if isinstance(t, QuantizedTensor) else t

    def mlp(self, p: str, intermediate: int, hidden: int, slots: int = 1, like=None) -> SwiGLU:
        """A SwiGLU MLP (tensor-parallel: this rank's slice, `layers.moe.swiglu`). slots = n > 1 (the shared experts,
        intermediate n * I): gate_up's rows in n slots (`layers.moe.swiglu`), so that the MoE's decode GEMVs read it
        as n more experts, when that can be: not tensor-parallel, and stored as the stacked experts `like` are
        (all dense, or quantized alike)."""
        gate, up = (self.get(p + f"{n}_proj.weight", (intermediate, hidden)) for n in ("gate", "up"))
        down = self.get(p + "down_proj.weight", (hidden, intermediate))
        if slots > 1 and (self.tp is not None or not _stored_like(like, (gate, up, down))):
            slots = 1
        return swiglu(gate, up, down, self.tp, slots)

    def mla(self, cfg: DeepseekConfig, p: str, index: int) -> MLA:
        H, Hn, R = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        nope, rope, v, qlr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        q_rows = Hn * (nope + rope)
        # the rope rows of every q head and of kv_a: interleaved pairs -> rotate-half halves
        q_perm = _rope_rows(Hn, nope, rope) if cfg.rope_interleave else None
        kv_perm = _rope_rows(1, R, rope) if cfg.rope_interleave else None
        # tensor-parallel: this rank's heads of q and of kv_b, o_proj row-parallel; the latent (kv_a, its norm, the
        # latent cache) whole on every rank
        heads = (lambda w, unit: w) if self.tp is None else lambda w, unit: self.tp.col(w, "attention heads", unit)  # noqa: E731
        kv_a = Linear(_take_rows(self.get(p + "kv_a_proj_with_mqa.weight", (R + rope, H)), kv_perm))
        q_a_norm = q_b = None
        if qlr:
            q_a = Linear(self.get(p + "q_a_proj.weight", (qlr, H)))
            q_a_norm = self.get(p + "q_a_layernorm.weight", (qlr,))
            q_b = Linear(heads(_take_rows(self.get(p + "q_b_proj.weight", (q_rows, qlr)), q_perm), nope + rope))
            proj_a = fuse_linears([q_a, kv_a])
        else:
            q = heads(_take_rows(self.get(p + "q_proj.weight", (q_rows, H)), q_perm), nope + rope)
            proj_a = fuse_linears([Linear(q), kv_a])
        if self.src.has(p + "kv_b_proj.weight"):
            kv_b = self.dense(p + "kv_b_proj.weight", (Hn * (nope + v), R))
        elif self.src.has(p + "embed_q.weight"):  # mlx-lm: W_UK^T [H, R, nope] and W_UV [H, v, R]
            w_uk = self.dense(p + "embed_q.weight", (Hn, R, nope)).transpose(1, 2)
            w_uv = self.dense(p + "unembed_out.weight", (Hn, v, R))
            kv_b = torch.cat([w_uk, w_uv], dim=1).reshape(Hn * (nope + v), R)
        else:
            raise ModelFileError(f"{self.src.path}: tensor '{p}kv_b_proj.weight' is missing from the checkpoint.")
        o = self.get(p + "o_proj.weight", (H, Hn * v))
        o = Linear(o) if self.tp is None else RowParallel(Linear(self.tp.row(o, "attention heads")), self.tp)
        return MLA(proj_a, q_a_norm, q_b, self.get(p + "kv_a_layernorm.weight", (R,)),
                   Linear(heads(kv_b, nope + v).contiguous()), o, Hn // self.size, qlr, R, nope, rope, v,
                   cfg.softmax_scale, index)

    def moe(self, cfg: DeepseekConfig, p: str) -> DeepseekMoE:
        H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        read = None
        if self.src.has(p + "switch_mlp.gate_proj.weight"):  # MLX: stacked per projection
            gate = self.get(p + "switch_mlp.gate_proj.weight", (E, I, H))
            up = self.get(p + "switch_mlp.up_proj.weight", (E, I, H))
            gate_up, down = _cat_rows([gate, up]), self.get(p + "switch_mlp.down_proj.weight", (E, H, I))
        elif self.src.has(p + "experts.gate_up_proj"):  # transformers' fused [E, 2I, H] and [E, H, I]
            gate_up = self.get(p + "experts.gate_up_proj", (E, 2 * I, H))
            down = self.get(p + "experts.down_proj", (E, H, I))
        else:  # per-expert tensors (the published checkpoints, transformers' save_pretrained), stacked; expert
            # parallel: this rank's alone are read
            read = self.tp.experts_to_read(E) if self.tp is not None else range(E)
            gate_up = _stack([_cat_rows([self.get(p + f"experts.{e}.{n}_proj.weight", (I, H)) for n in ("gate", "up")])
                              for e in read])
            down = _stack([self.get(p + f"experts.{e}.down_proj.weight", (H, I)) for e in read])
        if self.tp is not None:  # each expert's intermediate size split, or (expert parallel) the experts
            gate_up, down = self.tp.experts(gate_up, down, I, read)
        router = self.get(p + "gate.weight", (E, H), keep_dtype=True)
        router = Linear(router.float() if isinstance(router, torch.Tensor) else router)  # HF keeps the gate fp32
        bias = None
        if cfg.topk_method == "noaux_tc":
            bias = self.get(p + "gate.e_score_correction_bias", (E,), keep_dtype=True).float()
        shared = None
        if cfg.n_shared_experts:
            shared = self.mlp(p + "shared_experts.", I * cfg.n_shared_experts, H, cfg.n_shared_experts, gate_up)
        moe = DeepseekMoE(router, bias, gate_up, down, cfg.top_k, cfg.routing, shared)
        if self.tp is not None and self.tp.expert_parallel:
            moe.hold(*self.tp.expert_range(E))
        return moe


def _rope_rows(heads: int, before: int, rope: int) -> torch.Tensor:
    """Row order that turns each head's `rope` rows (after `before` others) from interleaved pairs (x0, x1), (x2, x3),
    ... into halves (x0, x2, ... | x1, x3, ...)."""
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head = torch.cat([torch.arange(before), before + pairs])
    return (torch.arange(heads)[:, None] * (before + rope) + head[None]).reshape(-1)


def _take_rows(w, rows: torch.Tensor | None):
    if rows is None:
        return w
    if isinstance(w, QuantizedTensor):
        words = w.weight.view(torch.int32)[rows.to(w.weight.device)].view(torch.uint32)  # no uint32 gather on CUDA
        return QuantizedTensor(words, w.scales[rows.to(w.scales.device)], w.biases[rows.to(w.biases.device)], w.bits,
                               w.group_size)
    return w[rows.to(w.device)]


def _stored_like(stacked, ws) -> bool:
    """Whether weights ws are stored as the stacked experts are: all dense, or quantized alike (bits, group size,
    scales' dtype)."""
    if not isinstance(stacked, QuantizedTensor):
        return isinstance(stacked, torch.Tensor) and all(isinstance(w, torch.Tensor) for w in ws)
    return all(isinstance(w, QuantizedTensor) and (w.bits, w.group_size, w.scales.dtype)
               == (stacked.bits, stacked.group_size, stacked.scales.dtype) for w in ws)


def _cat_rows(ws):
    """Concatenate [..., rows, in] weights along the rows (dense or quantized alike)."""
    if any(isinstance(w, QuantizedTensor) for w in ws):
        if any(not isinstance(w, QuantizedTensor) or (w.bits, w.group_size) != (ws[0].bits, ws[0].group_size)
               for w in ws):
            raise ModelFileError("expert gate and up projections are quantized differently; sluice needs them alike.")
        parts = (torch.cat([getattr(w, f) for w in ws], dim=-2) for f in ("weight", "scales", "biases"))
        return QuantizedTensor(*parts, ws[0].bits, ws[0].group_size)
    return torch.cat(ws, dim=-2)


def _stack(ws):
    if isinstance(ws[0], QuantizedTensor):
        if any(not isinstance(w, QuantizedTensor) or (w.bits, w.group_size) != (ws[0].bits, ws[0].group_size)
               for w in ws):
            raise ModelFileError("the routed experts are quantized differently; sluice needs them alike.")
        return QuantizedTensor(*(torch.stack([getattr(w, f) for w in ws]) for f in ("weight", "scales", "biases")),
                               ws[0].bits, ws[0].group_size)
    if any(isinstance(w, QuantizedTensor) for w in ws):
        raise ModelFileError("the routed experts are quantized differently; sluice needs them alike.")
    return torch.stack(ws)


def _refuse_unsupported_quantization(d) -> None:
    """FP8 (and other non-MLX) quantized checkpoints: a clear error before anything is read."""
    qc = d.config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    fp8 = method == "fp8" or any(n.endswith("weight_scale_inv") for n in d.names())
    if fp8 or (method is not None and not getattr(d, "is_mlx", False)):
        what = "FP8 block-quantized (weight_scale_inv)" if fp8 else f"{method!r}-quantized"
        raise UnsupportedError(f"{d.path}: {what} checkpoints are not supported; use a bf16 checkpoint (e.g. "
                               "DeepSeek's fp8_cast_bf16.py), then `sluice convert` it, or an MLX-quantized one.")


def build_from_hf(d, dtype: torch.dtype) -> DeepseekModel:
    _refuse_unsupported_quantization(d)
    cfg = DeepseekConfig.from_hf(d.config, f"{d.path}/config.json")
    return DeepseekModel(cfg, _Weights(d, cfg, dtype))


def build_from_gguf(g, dtype):
    raise UnsupportedError(f"GGUF {g.architecture} models are not supported yet; use an HF or MLX directory.")


# -- MLX format (what mlx-lm's sanitize() produces; used by `sluice convert`) ------------------------------------

def mlx_quant_override(module: str) -> dict | bool | None:
    """The router stays dense: mlx-lm's MoEGate is no Linear, its quantization leaves it out (False)."""
    return False if module.endswith("mlp.gate") else None


def mlx_plan(hf) -> list[tuple[str, object]]:
    """[(MLX name, loader)] for an HF checkpoint: drops the MTP layers (index >= num_hidden_layers), rotary tables
    and a tied lm_head; stacks experts into switch_mlp; splits kv_b_proj into embed_q / unembed_out per head."""
    _refuse_unsupported_quantization(hf)
    cfg = DeepseekConfig.from_hf(hf.config, f"{hf.path}/config.json")
    nope, v, R, Hn, E, I = (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.num_heads, cfg.num_experts,
                            cfg.moe_intermediate_size)
    plan, done = [], set()
    for name in sorted(hf.names()):
        if name.startswith("model.layers."):
            i = name.split(".")[2]
            if not i.isdigit() or int(i) >= cfg.num_layers:
                continue
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if ".mlp.experts." in name:
            layer = name[: name.index(".mlp.experts.")] + ".mlp."
            if layer in done:
                continue
            done.add(layer)
            plan += stacked_experts(hf, layer, layer + "switch_mlp.", I, E)
        elif name.endswith("kv_b_proj.weight"):
            p = name.removesuffix("kv_b_proj.weight")

            def per_head(n=name):
                return hf.tensor(n).reshape(Hn, nope + v, R)

            plan += [(p + "embed_q.weight", lambda f=per_head: f()[:, :nope].transpose(1, 2).contiguous()),
                     (p + "unembed_out.weight", lambda f=per_head: f()[:, nope:].contiguous())]
        else:
            plan.append((name, lambda n=name: hf.tensor(n)))
    return plan
