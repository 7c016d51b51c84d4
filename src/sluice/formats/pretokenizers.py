"""The pre-tokenizers of GGUF byte-level BPE vocabularies: for each `tokenizer.ggml.pre` name, the regexes llama.cpp
applies in order, each splitting the pieces of the one before (its `regex_exprs`, transcribed from
`src/llama-vocab.cpp`), and the BOS and merge defaults that go with them. `formats/tokenizer.py` builds a
`tokenizers.Tokenizer` from them.
"""

from __future__ import annotations

import warnings
from typing import Iterable

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
               r"|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_MINICPM5 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class PreTokenizer:
    """How llama.cpp pre-tokenizes and what it defaults for one `tokenizer.ggml.pre` group."""

    def __init__(self, regexes: list[str], ignore_merges: bool = False, add_bos: bool = False,
                 has_bos: bool = True):
        self.regexes, self.ignore_merges, self.add_bos, self.has_bos = regexes, ignore_merges, add_bos, has_bos


_PRE_GPT2 = PreTokenizer([_GPT2])
_PRE_DEFAULT = PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _register(names: Iterable[str], pre: PreTokenizer) -> None:
    for n in names:
        _PRE_TOKENIZERS[n] = pre


_register(["default"], _PRE_DEFAULT)
# "gpt2" is not a llama.cpp name (it says "gpt-2"), but some writers use it; it can only mean the GPT-2 regex.
_register(["gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
           "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-v1-en",
           "jina-v2-code", "roberta-bpe"], _PRE_GPT2)
_register(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
          PreTokenizer([r"\p{N}", _GPT2]))
_register(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
           "jina-v5-nano"], PreTokenizer([_LLAMA3], ignore_merges=True, add_bos=True))
_register(["dbrx", "smaug-bpe"], PreTokenizer([_LLAMA3]))
_register(["glm4", "chatglm-bpe"], PreTokenizer([_LLAMA3], has_bos=False))
_register(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
           "grok-2"], PreTokenizer([_QWEN2]))
_register(["qwen35"], PreTokenizer([_QWEN35]))
_register(["seed-coder"], PreTokenizer([_SEED_CODER]))
_register(["bailingmoe", "bailingmoe2", "llada-moe"], PreTokenizer([_BAILINGMOE]))
_register(["ufakzeka"], PreTokenizer([_UFAKZEKA]))
_register(["minicpm5"], PreTokenizer([r"\p{N}{1,3}", _MINICPM5], ignore_merges=True))
_register(["falcon"], PreTokenizer([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]))
_register(["deepseek-coder"], PreTokenizer(["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                                           "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"]))
_register(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
          PreTokenizer([r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3]))
_register(["poro-chat", "bloom", "gpt3-finnish"],
          PreTokenizer([" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"]))

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))


def pre_for(name: str | None) -> tuple[str, PreTokenizer]:
    """The pre-tokenizer of a GGUF's `tokenizer.ggml.pre` (and the name it goes by): llama.cpp's 'default' when it
    has none, GPT-2's when sluice does not know it, with a warning either way."""
    if not name:
        warnings.warn("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer (as llama.cpp "
                      "does). Tokenization may differ from the original model's; consider re-converting the model.",
                      stacklevel=3)
        return "default", _PRE_DEFAULT
    pre = _PRE_TOKENIZERS.get(name)
    if pre is None:
        warnings.warn(f"GGUF pre-tokenizer '{name}' is not supported by sluice; falling back to the GPT-2 "
                      "pre-tokenizer. Tokenization may differ from the original model's (digits, whitespace, "
                      "CJK), which can degrade output quality.", stacklevel=3)
        return "gpt2", _PRE_GPT2
    return name, pre
