"""Structured output through llguidance: `response_format` (json_object, json_schema) and forced tool calls
(`tool_choice` "required" or a named function) become a grammar; each request gets a matcher over it, which the
engine asks for the allowed tokens before every draw (`GrammarConstraint`, the engine's `TokenConstraint`).

JSON is generated compact (no free whitespace between tokens), so a schema whose strings and numbers are bounded
always ends within a bounded number of tokens."""

from __future__ import annotations

import json
import threading

import torch

from sluice.server.chat import TOOL_CLOSE, TOOL_OPEN
from sluice.server.protocol import APIError

JSON_OPTIONS = {"whitespace_flexible": False}
_SHIFTS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Grammars for one model's tokenizer (its llguidance tokenizer is built on first use, once)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=sorted(self.tokenizer.stop_ids) or None)
            return self._lltok

    # -- grammars from requests -----------------------------------------------------------------------------
    @staticmethod
    def for_response_format(fmt) -> str | None:
        """The grammar of a `response_format` (None for text)."""
        from llguidance import LLMatcher

        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            schema = {"type": "object"}
        else:
            if fmt.json_schema is None or not fmt.json_schema.schema_:
                raise APIError(400, "response_format json_schema needs json_schema.schema.",
                               param="response_format.json_schema")
            schema = fmt.json_schema.schema_
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None

    def for_tool_call(self, tools, name: str | None) -> str:
        """One `<tool_call>{"name": ..., "arguments": ...}</tool_call>` of the named tool (None: any offered tool),
        its arguments following the tool's parameter schema. A tag that is one token of the vocabulary (Qwen's) is
        that token, else its text."""
        if not tools:
            raise APIError(400, "tool_choice asks for a tool call but the request offers no tools.", param="tools")
        chosen = [t for t in tools if name is None or t.function.name == name]
        if not chosen:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools offered.",
                           param="tool_choice")
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        return f'start: {self._tag(TOOL_OPEN)} "\\n" %json {body} "\\n" {self._tag(TOOL_CLOSE)}\n'

    def _tag(self, text: str) -> str:
        """A lark item for a tag: its token (`<[id]>`) when the vocabulary has it whole, else the string."""
        token = self.tokenizer.token_to_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    # -- matchers -------------------------------------------------------------------------------------------
    def constraint(self, grammar: str, param: str) -> GrammarConstraint:
        """A fresh matcher over `grammar`; a grammar llguidance rejects (a bad schema) is a 400 naming `param`."""
        from llguidance import LLMatcher

        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if failed:
            raise APIError(400, f"{param}: the grammar library rejects it: {'; '.join(messages)}", param=param)
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise APIError(400, f"{param}: {matcher.get_error()}", param=param)
        return GrammarConstraint(matcher, self.vocab_size, self.tokenizer.stop_ids)


class GrammarConstraint:
    """The engine's TokenConstraint over an llguidance matcher."""

    def __init__(self, matcher, vocab_size: int, stop_ids):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.stop = torch.zeros(vocab_size, dtype=torch.bool)
        self.stop[sorted(stop_ids)] = True
        self._bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        if self.matcher.is_error():  # cannot happen with tokens it allowed; end the request rather than loop
            return self.stop
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)  # into our int32 words
        mask = ((self._bits[:, None] >> _SHIFTS) & 1).bool().flatten()[:self.vocab_size]
        return mask if mask.any() else self.stop

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)
