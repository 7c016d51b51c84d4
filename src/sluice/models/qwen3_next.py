"""Qwen3-Next (`qwen3_next`) and Qwen3.5/3.6-MoE (`qwen3_5_moe`, text only): Gated DeltaNet layers interleaved
with gated full attention, sparse MoE with a sigmoid-gated shared expert. HF transformers' math; the layers pick
their Triton kernels on CUDA and the torch references elsewhere.

Checkpoint layouts undone at load: Qwen3-Next's interleaved in_proj_qkvz/in_proj_ba (reordered into Qwen3.5's
separate order), per-expert tensors (stacked), HF conv1d [C, 1, W], HF's zero-centred norms (1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from sluice.attention import make_attention
from sluice.cache.pool import CachePool, RecurrentStates
from sluice.errors import ModelFileError, UnsupportedError
from sluice.formats.convert import stacked_experts
from sluice.formats.validate import bounded_int, head_dim_default, parse_config
from sluice.kernels.moe import ExpertOutputs
from sluice.kernels.norm import add_rms_norm_fp32_scale
from sluice.kernels.rope import rope_cos_sin
from sluice.kernels.rope.reference import rope_inv_freq
from sluice.layers.attention import GatedAttention
from sluice.layers.gated_deltanet import GatedDeltaNet, ba_rows, qkvz_rows
from sluice.layers.linear import Linear, fuse_linears
from sluice.layers.moe import SparseMoE, SwiGLU, swiglu
from sluice.parallel import RowParallel, vocab_layers
from sluice.quant.affine import QuantizedTensor


TENSOR_PARALLEL = True  # the builders split the weights for `sluice.parallel` when the reader carries a rank


@dataclass
class Qwen3NextConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    layer_types: list[str]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    intermediate_size: int  # dense MLP layers (mlp_only_layers / decoder_sparse_step)
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    architecture: str = "qwen3_next"

    @property
    def num_kv_layers(self) -> int:
        return self.layer_types.count("full_attention")

    def is_moe(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, c: dict, where: str = "config.json") -> Qwen3NextConfig:
        return parse_config(lambda: cls._from_hf(c, where), where)

    @classmethod
    def _from_hf(cls, c: dict, where: str) -> Qwen3NextConfig:
        model_type = c.get("model_type")
        if model_type == "qwen3_5_moe":  # the multimodal wrapper: the language model's config is nested
            c = {**c.get("text_config", {}), "model_type": model_type}
        try:
            rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
            if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
                raise UnsupportedError(f"{model_type}: rope scaling {rope.get('rope_type')!r} is not supported yet.")
            partial = c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
            theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
            n = bounded_int(c["num_hidden_layers"], "num_layers", where)
            interval = c.get("full_attention_interval", 4)
            layer_types = c.get("layer_types") or [
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
            head_dim = c.get("head_dim") or head_dim_default(c["hidden_size"], c["num_attention_heads"], where)
            qwen35 = model_type in ("qwen3_5_moe", "qwen3_5_moe_text")
            cfg = cls(model_type=model_type, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=n,
                      num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], head_dim=head_dim,
                      rotary_dim=int(head_dim * partial), rope_theta=float(theta),
                      rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                      context_length=int(c.get("max_position_embeddings", 32768)),
                      tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), layer_types=list(layer_types),
                      linear_num_key_heads=c["linear_num_key_heads"],
                      linear_num_value_heads=c["linear_num_value_heads"],
                      linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
                      conv_kernel=c.get("linear_conv_kernel_dim", 4), num_experts=c["num_experts"],
                      top_k=c["num_experts_per_tok"], moe_intermediate_size=c["moe_intermediate_size"],
                      shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0),
                      norm_topk_prob=True if qwen35 else bool(c.get("norm_topk_prob", True)),
                      intermediate_size=c.get("intermediate_size", 0),
                      mlp_only_layers=[] if qwen35 else list(c.get("mlp_only_layers") or []),
                      decoder_sparse_step=1 if qwen35 else int(c.get("decoder_sparse_step", 1)),
                      architecture=model_type)
        except KeyError as e:
            raise ModelFileError(f"{where} of this {model_type} model lacks the key {e.args[0]!r}.") from e
        if len(cfg.layer_types) != n or set(cfg.layer_types) - {"linear_attention", "full_attention"}:
            raise ModelFileError(f"{where}: layer_types must list {n} entries of 'linear_attention' / "
                                 "'full_attention'.")
        return cfg


class Qwen3NextBlock(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, w: _Weights, i: int, kv_index: int, gdn_index: int):
        super().__init__()
        p = w.layer_prefix(i)
        eps = cfg.rms_norm_eps
        H = cfg.hidden_size
        self.register_buffer("input_norm", w.norm(p + "input_layernorm.weight", H))
        self.register_buffer("post_norm", w.norm(p + "post_attention_layernorm.weight", H))
        self.eps = eps
        if cfg.layer_types[i] == "full_attention":
            a = p + "self_attn."
            qd, kd, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
            shapes = {"q": (2 * qd, H), "k": (kd, H), "v": (kd, H), "o": (H, qd)}
            q, k, v, o = (w.get(a + f"{n}_proj.weight", shapes[n]) for n in "qkvo")
            if w.tp is not None:  # this rank's heads ([query | gate] rows a head), o row-parallel
                q, o = w.tp.col(q, "attention heads", 2 * D), w.tp.row(o)
                k, v = (w.tp.kv(x, cfg.num_kv_heads, D) for x in (k, v))
            o = Linear(o) if w.tp is None else RowParallel(Linear(o), w.tp)
            self.mixer = GatedAttention(Linear(q), Linear(k), Linear(v), o, w.norm(a + "q_norm.weight", D),
                                        w.norm(a + "k_norm.weight", D), cfg.num_heads // w.size,
                                        w.kv_heads(cfg.num_kv_heads), D, eps, kv_index)
        else:
            self.mixer = w.gated_deltanet(cfg, p + "linear_attn.", gdn_index)
        self.mlp = w.moe(cfg, p + "mlp.") if cfg.is_moe(i) else w.mlp(p + "mlp.", cfg.intermediate_size, H)
        self.tp = w.tp  # tensor-parallel: the MLP's (or MoE's) partial sums are summed over the ranks

    def forward(self, h, delta, cos, sin, cache, meta):
        """(h, delta) -> (h', delta'): the residual stream and the last sublayer's output not yet added to it
        (None at the first layer), so that every residual add runs in one kernel with the norm after it; on the
        GPU an MoE's delta is its experts' outputs not yet summed (`ExpertOutputs`), which that kernel sums too."""
        h, x = add_rms_norm_fp32_scale(h, delta, self.input_norm, self.eps)
        if isinstance(self.mixer, GatedAttention):
            mixed = self.mixer(x, cos, sin, cache, meta)
        else:
            mixed = self.mixer(x, cache, meta)
        h, x = add_rms_norm_fp32_scale(h, mixed, self.post_norm, self.eps)
        if self.tp is not None:
            return h, self.tp.all_reduce(self.mlp(x))
        return h, (self.mlp.unsummed(x) if isinstance(self.mlp, SparseMoE) else self.mlp(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, w: _Weights):
        super().__init__()
        self.cfg, self.tp = cfg, w.tp
        shape = (cfg.vocab_size, cfg.hidden_size)
        embed = w.get(w.prefix + "embed_tokens.weight", shape)
        head = None if cfg.tie_word_embeddings else w.get(w.head_name, shape)
        self.embed, self.lm_head = vocab_layers(embed, head, cfg.tie_word_embeddings, cfg.vocab_size, w.tp)
        blocks, kv, gdn = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            blocks.append(Qwen3NextBlock(cfg, w, i, kv, gdn))
            kv, gdn = kv + (kind == "full_attention"), gdn + (kind == "linear_attention")
        self.layers = nn.ModuleList(blocks)
        self.register_buffer("norm", w.norm(w.prefix + "norm.weight", cfg.hidden_size))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta), persistent=False)

    def new_cache(self, rows: int, capacity: int, dtype: torch.dtype, device, kind: str = "dense",
                  page: int | None = None, blocks: int | None = None) -> CachePool:
        """Caches for `rows` sequences of up to `capacity` positions (and the pool's scratch row); with `page`, KV in
        `blocks` blocks of `page` positions where the cache kind pages (`cache/blocks.py`)."""
        c, tp = self.cfg, self.tp
        size = 1 if tp is None else tp.size  # a rank holds its heads' caches
        kv_heads = c.num_kv_heads if tp is None else tp.kv_heads(c.num_kv_heads)
        attention = make_attention(kind, c.num_kv_layers, rows + 1, kv_heads, c.head_dim, capacity, dtype,
                                   device, page=page, blocks=blocks)
        nk, nv, dk, dv = (c.linear_num_key_heads // size, c.linear_num_value_heads // size, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        states = RecurrentStates(c.layer_types.count("linear_attention"), rows + 1, 2 * nk * dk + nv * dv,
                                 c.conv_kernel, nv, dk, dv, dtype, device)
        return CachePool(attention, states, rows)

    def check_cache_kind(self, kind: str) -> None:
        """ValueError when this model cannot use a KV cache of this kind."""
        self.new_cache(1, 1, torch.float32, "meta", kind)

    def forward(self, ids: torch.Tensor, cache: CachePool, meta, dtype: torch.dtype, last_only: bool = False):
        """Logits (float32) [B, T or 1, vocab] of ids [B, T] at meta's rows and positions, updating the caches."""
        h, delta = self.embed(ids, dtype), None
        cos, sin = rope_cos_sin(meta.positions, self.inv_freq, dtype)
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, cache, meta)
        if last_only and h.shape[1] > 1:
            last = meta.last_tokens
            if isinstance(delta, ExpertOutputs):
                delta = delta.combine().view(h.shape)
            h, delta = h[:, last], (None if delta is None else delta[:, last])
        return self.lm_head(add_rms_norm_fp32_scale(h, delta, self.norm, self.cfg.rms_norm_eps)[1]).float()


class _Weights:
    """Reads one checkpoint's tensors under HF names and undoes its layout quirks."""

    def __init__(self, src, cfg: Qwen3NextConfig, dtype: torch.dtype):
        self.src, self.cfg, self.dtype = src, cfg, dtype
        # Text model prefix: Qwen3-Next "model."; Qwen3.5 HF "model.language_model."; Qwen3.5 MLX
        # "language_model.model."
        self.prefix = next((p for p in ("model.language_model.", "language_model.model.", "model.")
                            if src.has(p + "embed_tokens.weight")), "model.")
        self.head_name = ("language_model.lm_head.weight" if src.has("language_model.lm_head.weight")
                          else "lm_head.weight")
        # HF stores zero-centred norm weights (scale = 1 + w); MLX checkpoints store the scale itself.
        self.norm_offset = 0.0 if getattr(src, "is_mlx", False) else 1.0
        self.tp = getattr(src, "tp", None)  # this rank's part of a tensor-parallel model (`sluice.parallel`)
        self.size = 1 if self.tp is None else self.tp.size

    def kv_heads(self, n: int) -> int:
        return n if self.tp is None else self.tp.kv_heads(n)

    def layer_prefix(self, i: int) -> str:
        return f"{self.prefix}layers.{i}."

    def get(self, name: str, shape: tuple | None = None, keep_dtype: bool = False):
        """A tensor (model dtype) or QuantizedTensor; `shape` (logical, as config.json implies) is checked."""
        t = self.src.tensor(name)
        got = tuple(t.shape)
        if shape is not None and got != tuple(shape):
            raise ModelFileError(f"{self.src.path}: tensor '{name}' has shape {got}, but config.json implies "
                                 f"{tuple(shape)}. The checkpoint and its config.json do not belong together.")
        return t.to(self.dtype) if isinstance(t, torch.Tensor) and not keep_dtype else t

    def norm(self, name: str, size: int) -> torch.Tensor:
        return self.get(name, (size,), keep_dtype=True).float() + self.norm_offset

    def mlp(self, p: str, intermediate: int, hidden: int) -> SwiGLU:
        """A SwiGLU MLP (tensor-parallel: this rank's slice, `layers.moe.swiglu`)."""
        gate, up = (self.get(p + f"{n}_proj.weight", (intermediate, hidden)) for n in ("gate", "up"))
        return swiglu(gate, up, self.get(p + "down_proj.weight", (hidden, intermediate)), self.tp)

    def moe(self, cfg: Qwen3NextConfig, p: str) -> SparseMoE:
        H, read = cfg.hidden_size, None
        if self.src.has(p + "switch_mlp.gate_proj.weight"):  # MLX: stacked per projection
            gate, up = self.get(p + "switch_mlp.gate_proj.weight"), self.get(p + "switch_mlp.up_proj.weight")
            gate_up, down = _cat_rows([gate, up]), self.get(p + "switch_mlp.down_proj.weight")
        elif self.src.has(p + "experts.gate_up_proj"):  # Qwen3.5: fused [E, 2I, H] and [E, H, I]
            gate_up, down = self.get(p + "experts.gate_up_proj"), self.get(p + "experts.down_proj")
        else:  # per-expert tensors, stacked (expert parallel: this rank's alone are read)
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            read = range(E) if self.tp is None else self.tp.experts_to_read(E)
            gate_up = torch.stack([torch.cat([self.get(p + f"experts.{e}.{n}_proj.weight", (I, H))
                                              for n in ("gate", "up")]) for e in read])
            down = torch.stack([self.get(p + f"experts.{e}.down_proj.weight", (H, I)) for e in read])
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        n = len(read) if read is not None else E
        for name, t, shape in (("gate_up", gate_up, (n, 2 * I, H)), ("down", down, (n, H, I))):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else t.shape
            if got != shape:
                raise ModelFileError(f"{p}experts {name}: shape {got}, config.json implies {shape}.")
        if self.tp is not None:  # each expert's intermediate size split, or (expert parallel) the experts
            gate_up, down = self.tp.experts(gate_up, down, I, read)
        shared = shared_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = self.mlp(p + "shared_expert.", cfg.shared_expert_intermediate_size, H)
            shared_gate = Linear(self.get(p + "shared_expert_gate.weight", (1, H)))
        moe = SparseMoE(Linear(self.get(p + "gate.weight", (E, H))), gate_up, down, cfg.top_k, cfg.norm_topk_prob,
                         shared, shared_gate)
        if self.tp is not None and self.tp.expert_parallel:
            moe.hold(*self.tp.expert_range(E))
        return moe

    def gated_deltanet(self, cfg: Qwen3NextConfig, p: str, index: int) -> GatedDeltaNet:
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        H, kd, vd = cfg.hidden_size, nk * dk, nv * dv
        seg = lambda start, a, b, d: torch.arange(start + a * d, start + b * d)  # noqa: E731  rows of heads a..b-1
        (k0, k1), (v0, v1) = (0, nk), (0, nv)
        if self.tp is not None:  # this rank's key heads and the value heads that read them
            (k0, k1), (v0, v1) = self.tp.split(nk, "linear-attention key heads"), self.tp.split(nv, "value heads")
        # rows of [q | k | v] (and the conv's channels), of z, and of b or a: this rank's (all of them alone)
        qkv = torch.cat([seg(0, k0, k1, dk), seg(kd, k0, k1, dk), seg(2 * kd, v0, v1, dv)])
        z, ba = seg(0, v0, v1, dv), torch.arange(v0, v1)
        if self.src.has(p + "in_proj_qkvz.weight"):  # Qwen3-Next: interleaved per k-group
            qkvz = self.get(p + "in_proj_qkvz.weight", (2 * kd + 2 * vd, H))
            w_ba = self.get(p + "in_proj_ba.weight", (2 * nv, H))
            parts = [_take_rows(qkvz, qkvz_rows(nk, dk, nv, dv)[torch.cat([qkv, 2 * kd + vd + z])]),
                     _take_rows(w_ba, ba_rows(nk, nv)[torch.cat([ba, nv + ba])])]
        else:  # Qwen3.5: already separate
            shapes = {"qkv": (2 * kd + vd, H), "z": (vd, H), "b": (nv, H), "a": (nv, H)}
            take = _take_rows if self.tp is not None else lambda w, rows: w  # noqa: E731  (all rows: as they are)
            parts = [take(self.get(p + f"in_proj_{n}.weight", shapes[n]), rows)
                     for n, rows in (("qkv", qkv), ("z", z), ("b", ba), ("a", ba))]
        conv = self.src.tensor(p + "conv1d.weight")
        C = 2 * nk * dk + nv * dv
        if conv.numel() != C * cfg.conv_kernel:
            raise ModelFileError(f"{p}conv1d.weight: shape {tuple(conv.shape)}, expected [{C}, 1, {cfg.conv_kernel}].")
        conv = conv.reshape(C, cfg.conv_kernel)  # HF [C, 1, W]; MLX [C, W, 1]
        if self.tp is not None:
            conv = conv[qkv.to(conv.device)]
        A_log, dt_bias = (self.get(p + n, (nv,), True).float()[v0:v1] for n in ("A_log", "dt_bias"))
        out = self.get(p + "out_proj.weight", (H, vd))
        if self.tp is not None:  # out_proj row-parallel: this rank's value heads' columns, a partial sum summed
            out = RowParallel(Linear(self.tp.row(out, "value heads")), self.tp)
        else:
            out = Linear(out)
        return GatedDeltaNet(fuse_linears([Linear(w) for w in parts]), conv.to(self.dtype), A_log, dt_bias,
                             self.get(p + "norm.weight", (dv,)), out, (k1 - k0), (v1 - v0), dk, dv,
                             cfg.rms_norm_eps, index)


def _cat_rows(ws):
    """Concatenate [..., rows, in] weights along the rows (dense or quantized alike)."""
    if any(isinstance(w, QuantizedTensor) for w in ws):
        if any(not isinstance(w, QuantizedTensor) or (w.bits, w.group_size) != (ws[0].bits, ws[0].group_size)
               for w in ws):
            raise ModelFileError("expert gate and up projections are quantized differently; sluice needs them alike.")
        return QuantizedTensor(*(torch.cat([getattr(w, f) for w in ws], dim=-2)
                                 for f in ("weight", "scales", "biases")), ws[0].bits, ws[0].group_size)
    return torch.cat(ws, dim=-2)


def _take_rows(w, rows: torch.Tensor):
    if isinstance(w, QuantizedTensor):
        words = w.weight.view(torch.int32)[rows].view(torch.uint32)  # CUDA has no uint32 gather: the same bits
        return QuantizedTensor(words, w.scales[rows], w.biases[rows], w.bits, w.group_size)
    return w[rows]


def build_from_hf(d, dtype: torch.dtype) -> Qwen3NextModel:
    cfg = Qwen3NextConfig.from_hf(d.config, f"{d.path}/config.json")
    return Qwen3NextModel(cfg, _Weights(d, cfg, dtype))


def build_from_gguf(g, dtype):
    raise UnsupportedError(f"GGUF {g.architecture} models are not supported yet; use an HF or MLX directory.")


# -- MLX format (what mlx-lm's sanitize() produces; used by `sluice convert`) ------------------------------------

_PLUS_ONE_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def mlx_quant_override(module: str) -> dict | None:
    """Router and shared-expert gates stay at 8 bits (mlx-lm's quant_predicate for these models)."""
    if module.endswith("mlp.gate") or module.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": 8}
    return None


def mlx_plan(hf) -> list[tuple[str, object]]:
    """[(MLX name, loader)] for an HF checkpoint: drops mtp/visual tensors (and a tied lm_head), stacks experts into
    switch_mlp, moves conv1d to [C, W, 1], bakes +1 into the zero-centred norms, renames Qwen3.5's prefix."""
    cfg = Qwen3NextConfig.from_hf(hf.config)
    nested = hf.has("model.language_model.embed_tokens.weight")  # Qwen3.5's multimodal layout -> language_model.*
    plan, done = [], set()

    def rename(n: str) -> str:
        if n.startswith("model.language_model."):
            return "language_model.model." + n.removeprefix("model.language_model.")
        if nested and n == "lm_head.weight":
            return "language_model.lm_head.weight"
        return n

    for name in sorted(hf.names()):
        if "mtp." in name or name.startswith("model.visual.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if ".mlp.experts." in name:
            layer = name[: name.index(".mlp.experts.")] + ".mlp."
            if layer in done:
                continue
            done.add(layer)
            plan += stacked_experts(hf, layer, rename(layer) + "switch_mlp.", cfg.moe_intermediate_size,
                                    cfg.num_experts)
        elif name.endswith("conv1d.weight"):
            plan.append((rename(name), lambda n=name: hf.tensor(n).moveaxis(2, 1).contiguous()))
        elif name.endswith(_PLUS_ONE_NORMS) or name.endswith("model.norm.weight") \
                or name == "model.language_model.norm.weight":
            plan.append((rename(name), lambda n=name: hf.tensor(n) + 1.0))
        else:
            plan.append((rename(name), lambda n=name: hf.tensor(n)))
    return plan
