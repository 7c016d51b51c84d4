"""Dummy weights: a checkpoint reader that needs only config.json (`sluice.load(path, load_format="dummy")`).

`DummyCheckpoint` answers like an `HFDirectory` over the MLX-format checkpoint of that config (as mlx-lm's
`convert` / mlx-community repos lay it out: same tensor names, shapes, dtypes and bit widths, including the
per-module entries of config.json's `quantization` block such as the 8-bit router `mlp.gate` and
`shared_expert_gate`), but makes each tensor when asked for, on the device asked for, from a fixed seed and the
tensor's name, so runs are reproducible and no tensor is kept. Without a `quantization` block the weights are
dense, in config.json's dtype.

The values keep a deep model's activations finite and of order one: a weight matrix with `fan_in` inputs has
std 1/sqrt(fan_in) (quantized: random codes, one scale s per tensor with that std, biases -s (2^bits - 1) / 2 so
the codes are centred), norms are 1, depthwise conv taps have std 0.5/sqrt(taps), and the Gated DeltaNet decay
parameters follow the architectures' own initialisation (A_log = log U(1, 16), dt_bias = 1).

Architectures: `qwen3_next`, `qwen3_5_moe` (nested `text_config`), `qwen3_5_moe_text`, `llama`, `mistral`,
`deepseek_v3`, `kimi_k2`, `deepseek_v2` (MLA and DeepSeekMoE as mlx-lm lays them out: `_deepseek_params`).
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.errors import ModelFileError, UnsupportedError
from sluice.formats.hf import mlx_quantization

SEED = 0

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: its stored shape and dtype, and how its values are made (`fill`: "words"
    random uint32 codes, "const" every element `value`, "normal" N(0, value^2), "A_log" log U(1, 16))."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str
    value: float = 0.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Param:
    """A parameter as the model names it: logical shape, kind ("linear": a weight [..., out, in] that an MLX
    checkpoint may quantize; "dense": a weight left unquantized; "norm", "conv", "A_log", "dt_bias", "zeros"),
    and a dtype that overrides the checkpoint's."""

    name: str
    shape: tuple[int, ...]
    kind: str
    dtype: torch.dtype | None = None


def _qwen3_next_params(config: dict) -> list[_Param]:
    from sluice.models.qwen3_next import Qwen3NextConfig

    c = Qwen3NextConfig.from_hf(config)
    nested = config.get("model_type") == "qwen3_5_moe"  # MLX: language_model.model.* / language_model.lm_head
    qwen35 = c.model_type in ("qwen3_5_moe", "qwen3_5_moe_text")
    prefix = "language_model.model." if nested else "model."
    H, V = c.hidden_size, c.vocab_size
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    kd, vd = nk * dk, nv * dv
    ps = [_Param(prefix + "embed_tokens.weight", (V, H), "linear")]
    for i, kind in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        ps += [_Param(p + "input_layernorm.weight", (H,), "norm"),
               _Param(p + "post_attention_layernorm.weight", (H,), "norm")]
        if kind == "full_attention":
            a, qd, kvd = p + "self_attn.", c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            ps += [_Param(a + "q_proj.weight", (2 * qd, H), "linear"), _Param(a + "k_proj.weight", (kvd, H), "linear"),
                   _Param(a + "v_proj.weight", (kvd, H), "linear"), _Param(a + "o_proj.weight", (H, qd), "linear"),
                   _Param(a + "q_norm.weight", (c.head_dim,), "norm"),
                   _Param(a + "k_norm.weight", (c.head_dim,), "norm")]
        else:
            g = p + "linear_attn."
            if qwen35:
                ps += [_Param(g + "in_proj_qkv.weight", (2 * kd + vd, H), "linear"),
                       _Param(g + "in_proj_z.weight", (vd, H), "linear"),
                       _Param(g + "in_proj_b.weight", (nv, H), "linear"),
                       _Param(g + "in_proj_a.weight", (nv, H), "linear")]
            else:
                ps += [_Param(g + "in_proj_qkvz.weight", (2 * kd + 2 * vd, H), "linear"),
                       _Param(g + "in_proj_ba.weight", (2 * nv, H), "linear")]
            ps += [_Param(g + "conv1d.weight", (2 * kd + vd, c.conv_kernel, 1), "conv"),  # MLX: channels last
                   # mlx-lm's Qwen3.5 cast_predicate keeps A_log in fp32
                   _Param(g + "A_log", (nv,), "A_log", torch.float32 if qwen35 else None),
                   _Param(g + "dt_bias", (nv,), "dt_bias"), _Param(g + "norm.weight", (dv,), "norm"),
                   _Param(g + "out_proj.weight", (H, vd), "linear")]
        m = p + "mlp."
        if c.is_moe(i):
            E, I, S = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            ps += [_Param(m + "gate.weight", (E, H), "linear"),
                   _Param(m + "switch_mlp.gate_proj.weight", (E, I, H), "linear"),
                   _Param(m + "switch_mlp.up_proj.weight", (E, I, H), "linear"),
                   _Param(m + "switch_mlp.down_proj.weight", (E, H, I), "linear")]
            if S:
                ps += [_Param(m + "shared_expert.gate_proj.weight", (S, H), "linear"),
                       _Param(m + "shared_expert.up_proj.weight", (S, H), "linear"),
                       _Param(m + "shared_expert.down_proj.weight", (H, S), "linear"),
                       _Param(m + "shared_expert_gate.weight", (1, H), "linear")]
        else:
            ps += _mlp(m, c.intermediate_size, H)
    ps.append(_Param(prefix + "norm.weight", (H,), "norm"))
    if not c.tie_word_embeddings:
        ps.append(_Param("language_model.lm_head.weight" if nested else "lm_head.weight", (V, H), "linear"))
    return ps


def _mlp(p: str, intermediate: int, hidden: int) -> list[_Param]:
    return [_Param(p + "gate_proj.weight", (intermediate, hidden), "linear"),
            _Param(p + "up_proj.weight", (intermediate, hidden), "linear"),
            _Param(p + "down_proj.weight", (hidden, intermediate), "linear")]


def _llama_params(config: dict) -> list[_Param]:
    from sluice.models.llama import LlamaConfig

    c = LlamaConfig.from_hf(config)
    H, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    ps = [_Param("model.embed_tokens.weight", (c.vocab_size, H), "linear")]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        ps += [_Param(p + "input_layernorm.weight", (H,), "norm"),
               _Param(p + "post_attention_layernorm.weight", (H,), "norm"),
               _Param(p + "self_attn.q_proj.weight", (qd, H), "linear"),
               _Param(p + "self_attn.k_proj.weight", (kvd, H), "linear"),
               _Param(p + "self_attn.v_proj.weight", (kvd, H), "linear"),
               _Param(p + "self_attn.o_proj.weight", (H, qd), "linear")]
        ps += _mlp(p + "mlp.", c.intermediate_size, H)
    ps.append(_Param("model.norm.weight", (H,), "norm"))
    if not c.tie_word_embeddings:
        ps.append(_Param("lm_head.weight", (c.vocab_size, H), "linear"))
    return ps


def _deepseek_params(config: dict) -> list[_Param]:
    """DeepSeek-V3 / V2 / Kimi-K2 as mlx-lm's sanitize leaves them: kv_b_proj split per head into embed_q
    [H, R, nope] and unembed_out [H, v, R] (V3; V2 keeps kv_b_proj), experts stacked in switch_mlp, the router dense
    (no Linear, so mlx-lm does not quantize it), e_score_correction_bias fp32; no MTP layer."""
    from sluice.models.deepseek_v3 import DeepseekConfig

    c = DeepseekConfig.from_hf(config)
    H, V, Hn, R = c.hidden_size, c.vocab_size, c.num_heads, c.kv_lora_rank
    nope, rope, v, qlr = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank
    ps = [_Param("model.embed_tokens.weight", (V, H), "linear")]
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        ps += [_Param(p + "input_layernorm.weight", (H,), "norm"),
               _Param(p + "post_attention_layernorm.weight", (H,), "norm")]
        if qlr:
            ps += [_Param(a + "q_a_proj.weight", (qlr, H), "linear"),
                   _Param(a + "q_a_layernorm.weight", (qlr,), "norm"),
                   _Param(a + "q_b_proj.weight", (Hn * (nope + rope), qlr), "linear")]
        else:
            ps.append(_Param(a + "q_proj.weight", (Hn * (nope + rope), H), "linear"))
        ps += [_Param(a + "kv_a_proj_with_mqa.weight", (R + rope, H), "linear"),
               _Param(a + "kv_a_layernorm.weight", (R,), "norm")]
        if c.model_type == "deepseek_v2":
            ps.append(_Param(a + "kv_b_proj.weight", (Hn * (nope + v), R), "linear"))
        else:
            ps += [_Param(a + "embed_q.weight", (Hn, R, nope), "linear"),
                   _Param(a + "unembed_out.weight", (Hn, v, R), "linear")]
        ps.append(_Param(a + "o_proj.weight", (H, Hn * v), "linear"))
        m = p + "mlp."
        if c.is_moe(i):
            E, I = c.num_experts, c.moe_intermediate_size
            ps += [_Param(m + "gate.weight", (E, H), "dense"),
                   _Param(m + "switch_mlp.gate_proj.weight", (E, I, H), "linear"),
                   _Param(m + "switch_mlp.up_proj.weight", (E, I, H), "linear"),
                   _Param(m + "switch_mlp.down_proj.weight", (E, H, I), "linear")]
            if c.topk_method == "noaux_tc":
                ps.append(_Param(m + "gate.e_score_correction_bias", (E,), "zeros", torch.float32))
            if c.n_shared_experts:
                ps += _mlp(m + "shared_experts.", I * c.n_shared_experts, H)
        else:
            ps += _mlp(m, c.intermediate_size, H)
    ps.append(_Param("model.norm.weight", (H,), "norm"))
    if not c.tie_word_embeddings:
        ps.append(_Param("lm_head.weight", (V, H), "linear"))
    return ps


_LAYOUTS = {"qwen3_next": _qwen3_next_params, "qwen3_5_moe": _qwen3_next_params,
            "qwen3_5_moe_text": _qwen3_next_params, "llama": _llama_params, "mistral": _llama_params,
            "deepseek_v3": _deepseek_params, "kimi_k2": _deepseek_params, "deepseek_v2": _deepseek_params}


def _config_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelFileError(f"{path.parent}: no config.json. Dummy weights need the model's config.json: pass "
                                 "it, or the directory holding it.")
    elif not path.is_file():
        raise ModelFileError(f"{path}: no such file or directory. Pass a config.json, or the directory holding it.")
    return path


def _checkpoint_dtype(config: dict) -> torch.dtype:
    """The dtype of the checkpoint's dense tensors and quantization scales: config.json's `torch_dtype` / `dtype`
    (the text config's for a nested one), bfloat16 when it names none."""
    for c in (config.get("text_config") or {}, config):
        name = c.get("torch_dtype") or c.get("dtype")
        if name is not None:
            if name not in _DTYPES:
                raise UnsupportedError(f"config.json: dtype {name!r} is not supported for dummy weights; use one of "
                                       f"{', '.join(_DTYPES)}.")
            return _DTYPES[name]
    return torch.bfloat16


def byte_level_tokenizer(vocab_size: int = 256):
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab_size` tokens (no special tokens): the 256 bytes, then pairs
    of bytes, then a pair and a byte, each one merge: any text encodes, and every id decodes to the bytes it stands
    for, so random weights stream text at every token (a server's time to its first token is then measurable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    byte = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(byte)}
    merges = []
    pairs = ((a, b) for a in byte for b in byte)
    triples = ((a + b, c) for a in byte for b in byte for c in byte)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class DummyCheckpoint:
    """A checkpoint reader (the `HFDirectory` interface) over config.json alone; see the module docstring.
    `specs` maps every tensor name to its `TensorSpec`; `total_bytes` is the checkpoint's size."""

    format = "dummy"
    is_mlx = True  # MLX layout: norms hold their scale (HF's zero-centred norms +1 baked in), conv1d [C, W, 1]
    reads_to_device = True

    def __init__(self, path: str | Path, seed: int = SEED, config: dict | None = None):
        """`path`: a config.json (any name) or the directory holding config.json; `config`, when given, is used
        instead of reading the file (`path` then names the directory a tokenizer.json is looked for in)."""
        if config is None:
            cfg_file = _config_file(Path(path).expanduser())
            self.path = cfg_file.parent
            try:
                config = json.loads(cfg_file.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelFileError(f"{cfg_file}: not valid JSON ({e}).") from e
        else:
            self.path = Path(path).expanduser()
        self.config, self.seed = config, seed
        model_type = self.config.get("model_type", "<missing model_type>")
        layout = _LAYOUTS.get(model_type)
        if layout is None:
            raise UnsupportedError(f"dummy weights are not available for model_type {model_type!r}; they are for: "
                                   f"{', '.join(sorted(_LAYOUTS))}.")
        self.dtype = _checkpoint_dtype(self.config)
        self.specs: dict[str, TensorSpec] = {}
        self._quant: dict[str, tuple[int, int]] = {}
        for p in layout(self.config):
            self._add(p)

    def _add(self, p: _Param) -> None:
        from sluice.quant.affine import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

        dtype = p.dtype or self.dtype
        if p.kind == "conv":  # [C, W, 1]
            self.specs[p.name] = TensorSpec(p.shape, dtype, "normal", 0.5 / math.sqrt(p.shape[1]))
            return
        std = 1.0 / math.sqrt(p.shape[-1])
        if p.kind == "dense":  # a weight the checkpoint keeps unquantized (a router mlx-lm does not quantize)
            self.specs[p.name] = TensorSpec(p.shape, dtype, "normal", std)
            return
        if p.kind != "linear":
            fill = "A_log" if p.kind == "A_log" else "const"
            self.specs[p.name] = TensorSpec(p.shape, dtype, fill, 0.0 if p.kind == "zeros" else 1.0)
            return
        module = p.name.removesuffix(".weight")
        bits, gs = self.quantization(module) or (None, None)
        if bits is not None and (bits not in SUPPORTED_BITS or gs not in SUPPORTED_GROUP_SIZES):
            raise UnsupportedError(f"config.json quantizes {module} with bits={bits}, group_size={gs}; sluice "
                                   f"supports bits {SUPPORTED_BITS} and group sizes {SUPPORTED_GROUP_SIZES}.")
        if bits is None or p.shape[-1] % gs:  # not quantized (mlx-lm skips inputs that are not whole groups)
            self.specs[p.name] = TensorSpec(p.shape, dtype, "normal", std)
            return
        levels = 1 << bits
        scale = std / math.sqrt((levels * levels - 1) / 12)  # codes uniform on [0, levels): std = scale * that root
        *lead, n_in = p.shape
        self.specs[p.name] = TensorSpec((*lead, n_in * bits // 32), torch.uint32, "words")
        self.specs[module + ".scales"] = TensorSpec((*lead, n_in // gs), dtype, "const", scale)
        self.specs[module + ".biases"] = TensorSpec((*lead, n_in // gs), dtype, "const", -scale * (levels - 1) / 2)
        self._quant[module] = (bits, gs)

    def has(self, name: str) -> bool:
        return name in self.specs

    def names(self):
        return self.specs.keys()

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def tensor_nbytes(self) -> dict[str, int]:
        """Every tensor's name and size in bytes (as `HFDirectory` says it)."""
        return {name: s.nbytes for name, s in self.specs.items()}

    def quantization(self, module: str):
        """(bits, group_size) for a module, from config.json's `quantization` block, as `HFDirectory` says it."""
        return mlx_quantization(self.config, module)

    def tensor(self, name: str, device: str | torch.device = "cpu"):
        """The tensor (a QuantizedTensor for a quantized `<module>.weight`), made on `device`."""
        from sluice.quant.affine import QuantizedTensor

        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self._quant:
            return QuantizedTensor(*(self._make(n, device) for n in (name, module + ".scales", module + ".biases")),
                                   *self._quant[module])
        return self._make(name, device)

    def _make(self, name: str, device) -> torch.Tensor:
        s = self.specs.get(name)
        if s is None:
            raise ModelFileError(f"{self.path}: the dummy checkpoint of this config.json has no tensor '{name}'.")
        if s.fill == "const":
            return torch.full(s.shape, s.value, dtype=s.dtype, device=device)
        g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        if s.fill == "words":
            return torch.randint(-(1 << 31), 1 << 31, s.shape, dtype=torch.int32, generator=g,
                                 device=device).view(torch.uint32)
        if s.fill == "normal":
            return (torch.randn(s.shape, generator=g, device=device) * s.value).to(s.dtype)
        return torch.empty(s.shape, device=device).uniform_(1.0, 16.0, generator=g).log_().to(s.dtype)  # A_log

    def write(self, out: str | Path, device: str | torch.device = "cpu", shard_bytes: int = 4 << 30) -> Path:
        """Write this dummy checkpoint to directory `out` as an MLX checkpoint directory (config.json,
        tokenizer.json, safetensors shards of about `shard_bytes` marked {"format": "mlx"}): the same weights,
        read back from files (tensors made on `device`, then moved to the host shard by shard)."""
        from safetensors.torch import save_file

        out = Path(out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config, indent=2))
        if (self.path / "tokenizer.json").is_file():
            (out / "tokenizer.json").write_bytes((self.path / "tokenizer.json").read_bytes())
        else:
            byte_level_tokenizer(self.vocab_size).save(str(out / "tokenizer.json"))
        shard, size, index = {}, 0, 0
        names = list(self.specs)
        for i, name in enumerate(names):
            shard[name] = self._make(name, device).cpu()
            size += self.specs[name].nbytes
            if size >= shard_bytes or i == len(names) - 1:
                index += 1
                save_file(shard, str(out / f"model-{index:05d}.safetensors"), metadata={"format": "mlx"})
                shard, size = {}, 0
        return out

    def tokenizer(self):
        """The model's tokenizer: tokenizer.json beside config.json when there is one, else a byte-level stand-in
        of the model's vocabulary (`byte_level_tokenizer`) with no end-of-generation token, so generation runs to
        max_tokens."""
        from sluice.formats.tokenizer import Tokenizer

        if (self.path / "tokenizer.json").is_file():
            return Tokenizer.from_hf_dir(self.path)
        return Tokenizer(byte_level_tokenizer(self.vocab_size), vocab_size=self.vocab_size, bos_id=None, eos_id=None)

    @property
    def vocab_size(self) -> int:
        c = self.config
        return int(c.get("vocab_size") or c.get("text_config", {}).get("vocab_size") or 256)
