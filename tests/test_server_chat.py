"""The reply parser (server/chat.py): reasoning, content and tool calls come out the same however the text is cut into
pieces, and no tag reaches the content."""

import json
import random

import pytest

from sluice.server.chat import Delta, ReplyParser, prompt_opens_reasoning

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <3"}}\n</tool_call>'


def parse(text: str, tools=True, in_reasoning=False, seed=0) -> Delta:
    """The parser fed `text` in random pieces (1-6 characters)."""
    rng, parser, out, i = random.Random(seed), ReplyParser(tools, in_reasoning), Delta(), 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        out += parser.feed(text[i:j])
        i = j
    out += parser.finish()
    return out


@pytest.mark.parametrize("seed", range(20))
def test_reasoning_content_and_calls_whatever_the_pieces(seed):
    text = "<think>\nIs 1 < 2? Use </thin and <tool.\n</think>\n\nChecking a<b.\n" + CALL + "\n" + CALL
    out = parse(text, seed=seed)
    assert out.reasoning == "\nIs 1 < 2? Use </thin and <tool.\n"
    assert out.content == "Checking a<b.\n"
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"city": "Paris <3"}] * 2
    assert all(c["function"]["name"] == "get_weather" and c["id"].startswith("call_") for c in out.tool_calls)


def test_streaming_never_shows_a_tag():
    parser, shown = ReplyParser(tools=True), []
    for ch in "Sure." + CALL:
        shown.append(parser.feed(ch).content)
    assert "".join(shown) == "Sure." and all("<" not in s for s in shown)


@pytest.mark.parametrize("seed", range(5))
def test_what_is_not_a_call_stays_content(seed):
    bad = "<tool_call>\nnot json\n</tool_call>"
    assert parse("a " + bad, seed=seed).content == "a " + bad
    assert parse("a " + CALL, tools=False, seed=seed).content == "a " + CALL  # no tools offered: no parsing
    cut = parse("x" + CALL[:30], seed=seed)  # cut off by max_tokens
    assert cut.content == "x" + CALL[:30] and not cut.tool_calls
    assert parse("<b>bold</b> <", seed=seed).content == "<b>bold</b> <"


def test_open_think_from_the_prompt():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = parse("thinking...</think>\n\nanswer", in_reasoning=True)
    assert (out.reasoning, out.content) == ("thinking...", "answer")
    unfinished = parse("still thinking", in_reasoning=True)
    assert (unfinished.reasoning, unfinished.content) == ("still thinking", "")
    assert parse("  <think>r</think>c").reasoning == "r"
    assert parse("no think here <think>x</think>").content == "no think here <think>x</think>"
