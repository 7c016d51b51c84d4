"""A chat reply's text taken apart as it streams in (Qwen3-family conventions, as vLLM and llama-server read them):
`<think>...</think>` at the start is reasoning (`reasoning_content`), `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks are tool calls, the rest is content. Text that may be the start of a tag is held back until the
next piece tells, so no tag reaches `content`; the JSON of a call is read by `json.loads`."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

START, REASONING, CONTENT, TOOL = "start", "reasoning", "content", "tool"


@dataclass
class Delta:
    """What one piece of text added: reasoning text, content text, complete tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "type", "function": {"name", "arguments"}}

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __iadd__(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open (thinking templates start the reply inside it)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReplyParser:
    """feed(text) -> Delta for each piece of the reply, finish() -> Delta for what was held back."""

    def __init__(self, tools: bool, in_reasoning: bool = False):
        self.tools = tools  # parse <tool_call> blocks (only when the request offered tools)
        self.state = REASONING if in_reasoning else START
        self.pending = ""  # text not yet given out
        self.calls = 0  # tool calls parsed so far
        self.strip = False  # drop the whitespace that follows </think> or a tool call

    def feed(self, text: str) -> Delta:
        self.pending += text
        out = Delta()
        while self.pending:
            before = (self.state, len(self.pending))
            out += self._step()
            if (self.state, len(self.pending)) == before:
                break  # waiting for more text
        return out

    def finish(self) -> Delta:
        """The held-back text: an unclosed reasoning block stays reasoning, an unclosed tool call becomes content."""
        out = self.feed("")
        rest, self.pending = self.pending, ""
        if self.state == REASONING:
            out.reasoning += rest
        elif self.state == TOOL:
            out.content += TOOL_OPEN + rest
        elif not self.strip:
            out.content += rest
        return out

    def _step(self) -> Delta:
        if self.state == START:
            head = self.pending.lstrip()
            if head.startswith(THINK_OPEN):
                self.pending, self.state = head[len(THINK_OPEN):], REASONING
            elif head and not THINK_OPEN.startswith(head):
                self.state = CONTENT
            return Delta()
        if self.state == REASONING:
            text, found = self._until(THINK_CLOSE)
            if found:
                self.state, self.strip = CONTENT, True
            return Delta(reasoning=text)
        if self.state == CONTENT:
            if self.strip:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return Delta()
                self.strip = False
            if not self.tools:
                text, self.pending = self.pending, ""
                return Delta(content=text)
            text, found = self._until(TOOL_OPEN)
            if found:
                self.state = TOOL
            return Delta(content=text)
        end = self.pending.find(TOOL_CLOSE)  # TOOL: wait for the whole call
        if end < 0:
            return Delta()
        body, self.pending = self.pending[:end], self.pending[end + len(TOOL_CLOSE):]
        self.state = CONTENT
        call = self._call(body)
        if call is None:
            return Delta(content=TOOL_OPEN + body + TOOL_CLOSE)
        self.strip = True
        return Delta(tool_calls=[call])

    def _until(self, tag: str) -> tuple[str, bool]:
        """The pending text before `tag` (consumed with it), or, without it, all but a tail that may start it."""
        at = self.pending.find(tag)
        if at >= 0:
            text, self.pending = self.pending[:at], self.pending[at + len(tag):]
            return text, True
        keep = _partial_tag(self.pending, tag)
        text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return text, False

    def _call(self, body: str) -> dict | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        self.calls += 1
        return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": obj["name"],
                             "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
