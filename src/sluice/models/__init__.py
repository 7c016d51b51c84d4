"""Registry: GGUF `general.architecture` / HF `model_type` -> the module that builds the model."""

from sluice.errors import UnsupportedError

# name -> module path; each module has build_from_gguf(gguf_file, dtype) and build_from_hf(hf_dir, dtype).
ARCHITECTURES = {
    "llama": "sluice.models.llama",
    "mistral": "sluice.models.llama",  # Llama math with a sliding window
    "qwen3_next": "sluice.models.qwen3_next",
    "qwen3_5_moe": "sluice.models.qwen3_next",
    "qwen3_5_moe_text": "sluice.models.qwen3_next",
    "deepseek_v3": "sluice.models.deepseek_v3",
    "deepseek_v2": "sluice.models.deepseek_v3",  # the same layers: softmax router, greedy or group-limited top-k
    "kimi_k2": "sluice.models.deepseek_v3",  # Kimi-K2's config.json names DeepseekV3ForCausalLM
}


def architecture_module(name: str):
    import importlib

    mod = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if mod is None:
        raise UnsupportedError(f"unsupported model architecture {name!r}; sluice supports: "
                               f"{', '.join(sorted(ARCHITECTURES))}.")
    return importlib.import_module(mod)
