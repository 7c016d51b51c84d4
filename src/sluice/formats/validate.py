"""Untrusted checkpoint settings, checked in one place before anything is allocated from them.

* `untrusted(what)`: a parse of damaged or hostile file contents whose wrong types or values surface deep inside
  (TypeError, ValueError, KeyError, ...; a panic of the Rust `tokenizers` library) becomes a ModelFileError naming
  `what`.
* `parse_config(parse, where)`: both of these around a config's parse.
* `check_config(cfg, where)`: a model's normalised config (a dataclass, whether it came from config.json or from
  GGUF metadata) against the limits below: integers of the right type in range, finite floats in range, and the
  relations between fields (heads divisible by KV heads, an even head_dim, a rotary part no wider than a head,
  top-k no larger than the expert count, ...). The limits are generous for real models (the largest dims of
  today's open models are well inside) and keep a hostile config from asking for gigabytes through the RoPE
  table, the cache probe or the cache pool.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

from sluice.errors import ModelFileError, SluiceError

# field of a normalised config -> (least, most) allowed
INT_LIMITS = {
    "vocab_size": (1, 1 << 21),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (0, 1 << 18),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "rotary_dim": (2, 1024),
    "context_length": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "linear_num_key_heads": (1, 1024),
    "linear_num_value_heads": (1, 1024),
    "linear_key_head_dim": (1, 1024),
    "linear_value_head_dim": (1, 1024),
    "conv_kernel": (1, 64),
    "num_experts": (0, 4096),
    "top_k": (0, 64),
    "moe_intermediate_size": (1, 1 << 18),
    "shared_expert_intermediate_size": (0, 1 << 18),
    "decoder_sparse_step": (1, 1024),
    # multi-head latent attention and DeepSeekMoE (models/deepseek_v3.py)
    "q_lora_rank": (0, 1 << 16),
    "kv_lora_rank": (1, 1 << 14),
    "qk_nope_head_dim": (1, 1024),
    "qk_rope_head_dim": (2, 1024),
    "v_head_dim": (1, 1024),
    "n_shared_experts": (0, 64),
    "n_group": (1, 4096),
    "topk_group": (1, 4096),
    "first_k_dense_replace": (0, 1024),
    "moe_layer_freq": (1, 1024),
    "rope_original_max_positions": (1, 1 << 24),
    "num_nextn_predict_layers": (0, 64),
}
FLOAT_LIMITS = {"rope_theta": (1e-3, 1e12), "rms_norm_eps": (1e-12, 1.0), "routed_scaling_factor": (1e-6, 1e6),
                "rope_factor": (1e-3, 1e6), "rope_beta_fast": (1e-3, 1e6), "rope_beta_slow": (1e-3, 1e6),
                "rope_attention_factor": (1e-3, 1e3), "softmax_scale": (1e-6, 1e3)}
MAX_ATTENTION_WIDTH = 1 << 17  # num_heads * head_dim, num_kv_heads * head_dim

_PARSE_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError,
                 ZeroDivisionError)


def is_rust_panic(e: BaseException) -> bool:
    """A panic inside a Rust extension (`tokenizers`) arrives as pyo3's PanicException, a BaseException."""
    return type(e).__name__ == "PanicException"


@contextmanager
def untrusted(what: str):
    """Turn the errors a malformed file provokes inside this block into a ModelFileError naming `what`."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, SluiceError) or not (isinstance(e, _PARSE_ERRORS) or is_rust_panic(e)):
            raise
        if isinstance(e, KeyError):
            raise ModelFileError(f"{what}: the key {e.args[0]!r} is missing or malformed.") from e
        raise ModelFileError(f"{what}: malformed ({type(e).__name__}: {e}). Download or convert the model "
                             "again.") from e


# normalised field -> its config.json key, where the two differ (GGUF keys are named after neither)
SOURCE_KEYS = {"num_kv_heads": "num_key_value_heads", "num_layers": "num_hidden_layers",
               "num_heads": "num_attention_heads", "context_length": "max_position_embeddings",
               "rotary_dim": "head_dim * partial_rotary_factor", "top_k": "num_experts_per_tok",
               "conv_kernel": "linear_conv_kernel_dim"}


def _bad(where: str, name: str, value, want: str) -> ModelFileError:
    key = f"{name} ({SOURCE_KEYS[name]})" if name in SOURCE_KEYS else name
    return ModelFileError(f"{where}: {key} = {value!r} is not valid; it must be {want}.")


def parse_config(parse, where: str):
    """`parse()` (a config's parse from untrusted contents) under `untrusted(where)`, then `check_config`."""
    with untrusted(where):
        cfg = parse()
    check_config(cfg, where)
    return cfg


def check_config(cfg, where: str) -> None:
    """Raise ModelFileError when a field of the config dataclass `cfg` is of the wrong type, out of range, or
    inconsistent with another; `where` names the source (config.json's path, or the GGUF file's metadata)."""
    for f in dataclasses.fields(cfg):
        name, v = f.name, getattr(cfg, f.name)
        if name in INT_LIMITS:
            lo, hi = INT_LIMITS[name]
            if v is None and name == "sliding_window":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise _bad(where, name, v, f"an integer from {lo} to {hi}")
        elif name in FLOAT_LIMITS:
            lo, hi = FLOAT_LIMITS[name]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
                raise _bad(where, name, v, f"a finite number from {lo:g} to {hi:g}")
    c = cfg
    if c.num_heads % c.num_kv_heads:
        raise _bad(where, "num_key_value_heads", c.num_kv_heads, f"a divisor of num_attention_heads ({c.num_heads})")
    mla = hasattr(c, "kv_lora_rank")
    if c.head_dim % 2 and not mla:
        raise _bad(where, "head_dim", c.head_dim, "even (RoPE rotates pairs)")
    if max(c.num_heads, c.num_kv_heads) * c.head_dim > MAX_ATTENTION_WIDTH:
        raise _bad(where, "num_attention_heads * head_dim", c.num_heads * c.head_dim, f"at most {MAX_ATTENTION_WIDTH}")
    rotary = getattr(c, "rotary_dim", None)
    if rotary is not None and (rotary > c.head_dim or rotary % 2):
        raise _bad(where, "head_dim * partial_rotary_factor", rotary, f"even and at most head_dim ({c.head_dim})")
    if hasattr(c, "num_experts"):
        if c.num_experts and not 1 <= c.top_k <= c.num_experts:
            raise _bad(where, "num_experts_per_tok", c.top_k, f"from 1 to num_experts ({c.num_experts})")
    if hasattr(c, "linear_num_key_heads"):
        if c.linear_num_value_heads % c.linear_num_key_heads:
            raise _bad(where, "linear_num_value_heads", c.linear_num_value_heads,
                       f"a multiple of linear_num_key_heads ({c.linear_num_key_heads})")
        if not all(isinstance(i, int) and 0 <= i < c.num_layers for i in c.mlp_only_layers):
            raise _bad(where, "mlp_only_layers", c.mlp_only_layers, f"layer indices below {c.num_layers}")
    if mla:
        _check_mla(c, where)


def _check_mla(c, where: str) -> None:
    """DeepSeek-V2/V3 (multi-head latent attention, DeepSeekMoE): the relations between their fields."""
    from sluice.models.deepseek_v3 import SCORING_FUNCS, TOPK_METHODS

    if c.qk_rope_head_dim % 2:
        raise _bad(where, "qk_rope_head_dim", c.qk_rope_head_dim, "even (RoPE rotates pairs)")
    if c.topk_method not in TOPK_METHODS:
        raise _bad(where, "topk_method", c.topk_method, f"one of {', '.join(TOPK_METHODS)}")
    if c.scoring_func not in SCORING_FUNCS:
        raise _bad(where, "scoring_func", c.scoring_func, f"one of {', '.join(SCORING_FUNCS)}")
    if c.first_k_dense_replace > c.num_layers:
        raise _bad(where, "first_k_dense_replace", c.first_k_dense_replace,
                   f"at most num_hidden_layers ({c.num_layers})")
    if any(not c.is_moe(i) for i in range(c.num_layers)) and c.intermediate_size < 1:
        raise _bad(where, "intermediate_size", c.intermediate_size, "at least 1 (the model has dense MLP layers)")
    if not c.num_experts:
        return
    if c.num_experts % c.n_group:
        raise _bad(where, "n_group", c.n_group, f"a divisor of n_routed_experts ({c.num_experts})")
    if c.topk_group > c.n_group:
        raise _bad(where, "topk_group", c.topk_group, f"at most n_group ({c.n_group})")
    per_group = c.num_experts // c.n_group
    if c.topk_method == "noaux_tc" and c.n_group > 1 and per_group < 2:
        raise _bad(where, "n_group", c.n_group, f"at most n_routed_experts / 2 ({c.num_experts // 2}): noaux_tc "
                   "ranks a group by its two best experts")
    if c.topk_method != "greedy" and c.n_group > 1 and c.top_k > c.topk_group * per_group:
        raise _bad(where, "num_experts_per_tok", c.top_k, f"at most the experts of topk_group groups "
                   f"({c.topk_group * per_group})")


def bounded_int(value, name: str, where: str) -> int:
    """`value` when it is an integer within INT_LIMITS[name] (for a field needed before the whole check runs,
    e.g. a layer count that sizes a list)."""
    lo, hi = INT_LIMITS[name]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _bad(where, name, value, f"an integer from {lo} to {hi}")
    return value


def head_dim_default(hidden: int, heads: int, where: str) -> int:
    """hidden_size / num_attention_heads, for configs without head_dim: it must divide evenly."""
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden > 0 and hidden % heads == 0):
        raise ModelFileError(f"{where}: hidden_size ({hidden!r}) must be a positive multiple of "
                             f"num_attention_heads ({heads!r}) when head_dim is not given.")
    return hidden // heads
