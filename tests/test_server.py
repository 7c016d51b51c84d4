"""`sluice serve` on the demo model (CPU), through the real `openai` client and raw HTTP: replies equal
Model.generate token for token, streaming and not; stop strings, usage and finish reasons; logprobs; seeded
sampling; structured output; every bad request gets its status and the server keeps serving; a client that goes away
frees its sequence; the API key."""

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest

import sluice
from sluice.server import Server, ServerConfig, free_port

openai = pytest.importorskip("openai")

CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
         [{"role": "user", "content": "Write a haiku about rivers."}]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(demo_gguf_path):
    """A second copy of the demo model: what Model.generate gives, computed outside the server's engine."""
    return sluice.load(demo_gguf_path, device="cpu")


@pytest.fixture(scope="module")
def server(demo_gguf_path):
    model = sluice.load(demo_gguf_path, device="cpu", max_seq_len=512, max_batch=8)
    with Server(model, ServerConfig(port=0, log_level="warning")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def name(client):
    return client.models.list().data[0].id


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def stream_chat(client, name, messages, **kw):
    """(content, finish_reason, usage) of a streamed chat reply."""
    parts, reason, use = [], None, None
    for chunk in client.chat.completions.create(model=name, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            use = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(parts), reason, use


def test_models_and_health(server, client, name):
    assert name == "SmolLM2-135M-Instruct.Q4_1"
    h = health(server)
    assert h["status"] == "ok" and h["cache_rows"] == 8 and h["running"] == 0


@pytest.mark.parametrize("messages", CHATS)
def test_chat_equals_generate(client, name, reference, messages):
    want_ids = list(reference.generate_ids(reference.encode_prompt(messages), max_tokens=MAX_TOKENS))
    want = reference.generate(messages, max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True)
    choice = r.choices[0]
    assert choice.message.content == want
    assert [t.token for t in choice.logprobs.content] == [reference.tokenizer.decode([t]) for t in want_ids]
    assert r.usage.completion_tokens == len(want_ids)
    assert r.usage.prompt_tokens == len(reference.encode_prompt(messages))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.finish_reason == ("length" if len(want_ids) == MAX_TOKENS else "stop")
    text, reason, use = stream_chat(client, name, messages, max_tokens=MAX_TOKENS, temperature=0)
    assert (text, reason) == (want, choice.finish_reason)
    # the same prompt again: the prefix cache holds all of it but its last token
    assert use.prompt_tokens_details.cached_tokens == use.prompt_tokens - 1
    use.prompt_tokens_details = r.usage.prompt_tokens_details
    assert use.model_dump() == r.usage.model_dump()


def test_a_chat_turn_starts_from_the_last(server, client, name, reference):
    """The next turn of a conversation prefills only what is new (usage's cached_tokens, /health's hit counters),
    and its reply is Model.generate's."""
    messages = [{"role": "user", "content": "Tell me about the Loire river."}]
    first = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    before = health(server)["prefix_cache"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the Rhone?"}]
    second = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert second.choices[0].message.content == reference.generate(messages, max_tokens=MAX_TOKENS, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens
    after = health(server)["prefix_cache"]
    assert after["hits"] == before["hits"] + 1 and after["cached_tokens"] == before["cached_tokens"] + cached
    assert 0 < after["hit_rate"] <= 1 and after["cached_prefixes"] >= 1


def test_completions_equal_generate(client, name, reference):
    prompt = "The capital of France is"
    want = reference.generate(prompt, max_tokens=12, temperature=0)
    r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    ids = reference.tokenizer.encode(prompt)
    assert client.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0).choices[0].text == want


def test_concurrent_requests_equal_each_alone(server, name, reference):
    want = [reference.generate(m, max_tokens=MAX_TOKENS, temperature=0) for m in CHATS]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        replies = await asyncio.gather(*[aclient.chat.completions.create(
            model=name, messages=m, max_tokens=MAX_TOKENS, temperature=0) for m in CHATS * 2])
        await aclient.close()
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(run()) == want * 2


def test_stop_strings_usage_and_finish_reason(client, name, reference):
    messages = CHATS[0]
    full = reference.generate(messages, max_tokens=MAX_TOKENS, temperature=0)
    stop = full.split()[3]  # a word in the middle of the reply
    cut = full[:full.index(stop)]
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=["\u00e9t\u00e9", stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert stream_chat(client, name, messages, max_tokens=MAX_TOKENS, temperature=0, stop=stop)[:2] == (cut, "stop")
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_logprobs(client, name):
    r = client.chat.completions.create(model=name, messages=CHATS[0], max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 6 and "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the likeliest
        assert e.logprob == e.top_logprobs[0].logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(e.bytes).decode() == e.token
    r = client.completions.create(model=name, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_seeded_sampling_and_penalties(client, name):
    kw = dict(model=name, messages=CHATS[2], max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    first = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == first
    penalised = client.chat.completions.create(**kw, presence_penalty=1.5, frequency_penalty=1.0,
                                               extra_body={"repetition_penalty": 1.2, "top_k": 40, "min_p": 0.02})
    assert penalised.choices[0].message.content and penalised.usage.completion_tokens <= 16


def test_json_schema(client, name):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "sunny", "temperature"],
              "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"},
                             "temperature": {"type": "integer", "minimum": -50, "maximum": 60}}}
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Describe today's weather in Paris as JSON."}],
        max_tokens=64, temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "weather", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=name, messages=CHATS[0], max_tokens=48, temperature=0.7, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


def post(server, body, headers=None, path="/v1/chat/completions"):
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json",
                                                                    **(headers or {})})
    return httpx.post(server.url + path, json=body, headers=headers)


def chat_body(**over):
    return {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            **over}


BAD_REQUESTS = {
    "malformed JSON": (b'{"model": "x", "messages": [', 400, None),
    "not an object": (b'[1, 2]', 400, None),
    "unknown model": (chat_body(model="gpt-9"), 404, "model"),
    "negative max_tokens": (chat_body(max_tokens=-1), 400, "max_tokens"),
    "max_tokens past the context": (chat_body(max_tokens=100000), 400, "messages"),
    "prompt over the context": (chat_body(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages"),
    "temperature below 0": (chat_body(temperature=-0.5), 400, "temperature"),
    "top_p above 1": (chat_body(top_p=1.5), 400, "top_p"),
    "presence_penalty out of range": (chat_body(presence_penalty=3), 400, "presence_penalty"),
    "n > 1": (chat_body(n=2), 400, "n"),
    "logit_bias": (chat_body(logit_bias={"5": 10}), 400, "logit_bias"),
    "wrong type": (chat_body(messages="hello"), 422, "messages"),
    "unknown role": (chat_body(messages=[{"role": "robot", "content": "x"}]), 422, "messages.0.role"),
    "top_logprobs above 20": (chat_body(logprobs=True, top_logprobs=50), 422, "top_logprobs"),
    "schema the grammar library rejects": (chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), 400,
        "response_format"),
    "tool_choice without tools": (chat_body(tool_choice="required"), 400, "tools"),
    "two prompts": ({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": ["a", "b"]}, 400, "prompt"),
    "echo": ({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "a", "echo": True}, 400, "echo"),
    "token id past the vocabulary": ({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": [1, 10**6]}, 400, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_then_a_good_one(server, client, name, case):
    body, status, param = BAD_REQUESTS[case]
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    r = post(server, body, path=path)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    ok = client.chat.completions.create(model=name, messages=CHATS[1], max_tokens=4, temperature=0)
    assert ok.choices[0].message.content


def test_http_errors(server):
    assert httpx.get(server.url + "/v1/nowhere").status_code == 404
    assert httpx.get(server.url + "/v1/nowhere").json()["error"]["type"] == "not_found_error"
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (9 << 20) + b'"}]}'
    r = post(server, big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert post(server, chat_body()).status_code == 200


def wait_for(server, predicate, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(server)
        if predicate(h) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_sequence(server, name):
    before = health(server)
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=chat_body(max_tokens=400, temperature=0, stream=True)) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # the role chunk, then tokens: the sequence is decoding
        assert got[0].startswith("data: ")
        assert health(server)["running"] == 1
    h = wait_for(server, lambda h: h["aborted"] == before["aborted"] + 1 and h["running"] == 0)
    assert h["aborted"] == before["aborted"] + 1 and h["running"] == 0 and h["waiting"] == 0
    assert h["cache_rows_free"] == h["cache_rows"]


def test_disconnect_while_waiting_for_a_whole_reply(server):
    before = health(server)
    body = json.dumps(chat_body(max_tokens=400, temperature=0)).encode()
    with socket.create_connection((server.config.host, server.config.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(server, lambda h: h["running"] == 1)
    h = wait_for(server, lambda h: h["aborted"] == before["aborted"] + 1 and h["running"] == 0)
    assert h["aborted"] == before["aborted"] + 1 and h["running"] == 0
    assert h["cache_rows_free"] == h["cache_rows"]


def test_cli_serve_with_api_key(demo_gguf_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--model", str(demo_gguf_path), "--port",
                             str(port), "--api-key", "s3cret", "--max-batch", "2", "--max-seq-len", "256",
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                assert httpx.get(url + "/health").json()["status"] == "ok"  # /health needs no key
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/chat/completions", json=chat_body()).status_code == 401
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        name = keyed.models.list().data[0].id
        assert keyed.chat.completions.create(model=name, messages=CHATS[1], max_tokens=3).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(30)


def test_server_sent_events_stay_one_line_whatever_the_text():
    """Generated text holding characters that Python's splitlines (httpx's aiter_lines) takes for line ends stays
    inside one event, and decodes back to itself."""
    from sluice.server.protocol import sse

    text = "a\u2028b\u2029c\x85d\x1ce\nf\rg"
    event = sse({"text": text})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):-2])["text"] == text
