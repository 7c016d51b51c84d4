"""Tool calling and reasoning through the server, on a tiny random Llama whose tokenizer carries a Qwen3-style chat
template (tools in the system prompt, <tool_call> / <tool_response> blocks, <think>): a forced tool call is parsed
into `tool_calls` (also while streaming, no tags in `content`), the call and its result go back through the template,
and a reply inside an open <think> lands in `reasoning_content`."""

import json

import jsonschema
import pytest
from helpers import tiny_llama

import sluice
from sluice.server import Server, ServerConfig

openai = pytest.importorskip("openai")

QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
{%- set call = tool_call.function %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def qwen_style_tokenizer(path):
    """A byte-level BPE tokenizer with Qwen's chat tokens (special) and tag tokens (plain added tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "chat_template": QWEN3_TEMPLATE}))
    return tok.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_style")
    vocab = qwen_style_tokenizer(path)
    tiny_llama(seed=3, vocab_size=vocab, max_position_embeddings=2048, bos_token_id=None, eos_token_id=vocab - 5,
               pad_token_id=None).save_pretrained(path, safe_serialization=True)
    return sluice.load(path, device="cpu", max_seq_len=1024, max_batch=4)


@pytest.fixture(scope="module")
def client(model):
    with Server(model, ServerConfig(port=0, log_level="warning")) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        yield c, c.models.list().data[0].id


def check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_forced_tool_call(client):
    c, name = client
    r = c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=120, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], WEATHER)


def test_streamed_tool_call_keeps_tags_out_of_content(client):
    c, name = client
    content, calls, reason = [], {}, None
    for chunk in c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, temperature=0.8, seed=5, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or ():
            calls.setdefault(tc.index, tc)
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and "tool_call" not in "".join(content) and list(calls) == [0]
    check_call(calls[0], WEATHER)


def test_tool_call_round_trip(client, model):
    c, name = client
    first = c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], tool_choice="required",
                                      max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    r = c.chat.completions.create(model=name, messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result went through the template: the prompt is exactly this rendering
    rendered = model.tokenizer.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}], tools=[WEATHER])
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}' in rendered
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in rendered
    assert r.usage.prompt_tokens == len(model.tokenizer.encode(rendered, add_special=False))


def test_reply_inside_open_think_is_reasoning(client, model):
    c, name = client
    kw = {"model": name, "messages": ASK, "max_tokens": 12, "temperature": 0}
    r = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    prompt = model.tokenizer.apply_chat_template(ASK, enable_thinking=True)
    assert prompt.endswith("<think>\n")
    raw = c.completions.create(model=name, prompt=model.tokenizer.encode(prompt, add_special=False), max_tokens=12,
                               temperature=0).choices[0].text
    message = r.choices[0].message
    reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
    if "</think>" in raw:
        before, after = raw.split("</think>", 1)
        assert reasoning == before and message.content == after.lstrip()
    else:
        assert reasoning == raw and message.content == ""
    plain = c.chat.completions.create(**kw).choices[0].message  # no open <think>: all content
    assert not (plain.model_extra or {}).get("reasoning_content")
