"""Log probabilities in OpenAI's two shapes: chat (`{"token", "logprob", "bytes", "top_logprobs"}` per token) and
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A token's bytes are its own, also when it
holds part of a UTF-8 character (byte-level BPE vocabularies: the vocabulary entry mapped back through GPT-2's
byte alphabet)."""

from __future__ import annotations

import functools

from sluice.engine.engine import StepOutput


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256 + n in order
    printable = [b for b in range(256) if chr(b) in ByteLevel.alphabet()]
    chars, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], n = chr(256 + n), n + 1
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """Text and bytes of single tokens of one tokenizer (each worked out once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]

    def bytes(self, token: int) -> list[int]:
        if token not in self._bytes:
            piece, table = self.tokenizer.id_to_token(token) or "", _byte_decoder()
            if piece and all(c in table for c in piece) and self.text(token) != piece:
                self._bytes[token] = [table[c] for c in piece]
            else:
                self._bytes[token] = list(self.text(token).encode("utf-8"))
        return self._bytes[token]

    def entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": self.bytes(token)}

    # -- the two shapes -------------------------------------------------------------------------------------
    def chat(self, out: StepOutput) -> dict:
        return {**self.entry(out.token, out.logprob),
                "top_logprobs": [self.entry(t, lp) for t, lp in out.top_logprobs or ()]}

    def completion(self, outs: list[StepOutput], offset: int) -> dict:
        """The completions-API logprobs of these tokens; `offset`: characters of the text before the first one."""
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for out in outs:
            result["tokens"].append(self.text(out.token))
            result["token_logprobs"].append(out.logprob)
            result["top_logprobs"].append({self.text(t): lp for t, lp in out.top_logprobs or ()})
            result["text_offset"].append(offset)
            offset += len(result["tokens"][-1])
        return result
