"""The OpenAI frontend against the real stack (tritonserver + llm models + `python -m openai_frontend`),
driven by the official openai client, sync and async.

One server for the module with three models: `tiny` (random 2-layer Llama: fast, text is noise),
`smol` (SmolLM2-135M-Instruct: where the chat template must matter) and `tiny_q1` (max_num_seqs=1,
max_queue_size=1, to fill the queue on purpose).
"""
from __future__ import annotations

import asyncio
import collections
import importlib.metadata
import json
import os
import re
import socket
import time
import uuid
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine_helpers import MODEL_REPOSITORY
from serve_script import serve_script
from server_harness.openai_stack import FrontendProcess, grpc_generate, scrape
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer, free_ports

ROOT = MODEL_REPOSITORY.parent
TINY = ROOT / "models" / "tiny-llama"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct"
DEFAULT_MAX_TOKENS = 40  # set on `tiny`; OpenAI's legacy default would be 16
SMALL_KV = str(64 << 20)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for folder in (TINY, SMOL):
        if not (folder / ".complete").exists():
            pytest.skip(f"{folder} missing: run scripts/prepare_models.py")
    tmp = tmp_path_factory.mktemp("openai_stack")
    repo = make_model_repository(MODEL_REPOSITORY, tmp / "repo", {
        "tiny": {"model": TINY, "default_max_tokens": DEFAULT_MAX_TOKENS, "kv_cache_memory_bytes": SMALL_KV,
                 "metrics_interval_ms": 200, "cancel_check_period_ms": 50},
        "smol": {"model": SMOL, "kv_cache_memory_bytes": SMALL_KV},
        "tiny_q1": {"model": TINY, "max_num_seqs": 1, "max_queue_size": 1, "kv_cache_memory_bytes": SMALL_KV,
                    "metrics_interval_ms": 200},
    })
    server = TritonServer(repo, log_path=tmp / "server.log")
    with server:
        with FrontendProcess(server.grpc_url, tmp / "frontend.log") as frontend:
            yield server, frontend
    assert server.leftovers() == []


@pytest.fixture(scope="module")
def client(stack):
    # max_retries=0: the client would otherwise retry a 503 and hide it.
    return openai.OpenAI(base_url=f"{stack[1].base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_url(stack):
    return f"{stack[1].base_url}/v1"


def run_async(coro_fn, base_url):
    async def main():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as ac:
            return await coro_fn(ac)
    return asyncio.run(main())


def greedy(**kw):
    return {"temperature": 0, **kw}


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ---- models ------------------------------------------------------------------------------------

def test_models_lists_contract_models_and_unknown_is_404(client):
    ids = {m.id for m in client.models.list().data}
    assert {"tiny", "smol", "tiny_q1"} <= ids
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, stream=True)


# ---- vLLM's utility endpoints (issue 41) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack[1].base_url, timeout=120) as h:
        yield h


def test_tokenize_counts_what_generation_bills_and_detokenize_inverts_it(client, http):
    prompt = "The quick brown fox jumps over the lazy dog"
    t = http.post("/tokenize", json={"model": "smol", "prompt": prompt})
    assert t.status_code == 200, t.text
    t = t.json()
    assert set(t) == {"count", "max_model_len", "tokens"} and t["max_model_len"] == 2048
    assert t["count"] == len(t["tokens"]) == client.completions.create(
        model="smol", prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert http.post("/detokenize", json={"model": "smol", "tokens": t["tokens"]}).json() == {"prompt": prompt}
    chat = http.post("/tokenize", json={"model": "smol", "messages": CHAT}).json()
    assert chat["count"] == len(chat["tokens"]) == client.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=1).usage.prompt_tokens
    bare = http.post("/tokenize", json={"model": "smol", "messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path,body,status,param,needles", [
    ("/detokenize", {"model": "smol", "tokens": [1, "a"]}, 400, "tokens", ["tokens[1]='a'", "integer"]),
    ("/detokenize", {"model": "smol", "tokens": [1, 10**9]}, 400, "tokens", ["tokens[1]=1000000000", "[0, 49152)"]),
    ("/detokenize", {"model": "smol", "tokens": [-1]}, 400, "tokens", ["tokens[0]=-1", "[0, 49152)"]),
    ("/detokenize", {"model": "smol", "tokens": "1 2"}, 400, "tokens", ["tokens='1 2'", "list"]),
    ("/tokenize", {"model": "smol"}, 400, "prompt", ["prompt", "messages"]),
    ("/tokenize", {"model": "smol", "prompt": 5}, 400, "prompt", ["prompt=5", "string"]),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", ["'nope'"]),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", ["'nope'"]),
])
def test_tokenize_and_detokenize_refuse_bad_input_by_name(http, path, body, status, param, needles):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert all(n in err["message"] for n in needles) and err["param"] == param, err


def test_version_and_health_as_vllm(http):
    assert http.get("/version").json() == {"version": importlib.metadata.version("inflight-triton")}
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""


# ---- completions ---------------------------------------------------------------------------------

def test_completion_greedy_equals_grpc_path_with_usage(stack, client):
    server, _ = stack
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True},
                                  **greedy())
    text, final = grpc_generate(server.grpc_url, "tiny", prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert r.choices[0].text == text and text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == final["num_input_tokens"] > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.object == "text_completion" and r.model == "tiny"


def test_completion_stream_equals_non_stream_with_usage_chunk(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=30, extra_body={"ignore_eos": True}, **greedy())
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_default_max_tokens_is_the_models_not_16(client):
    r = client.completions.create(model="tiny", prompt="Count:", extra_body={"ignore_eos": True}, **greedy())
    assert r.usage.completion_tokens == DEFAULT_MAX_TOKENS and r.choices[0].finish_reason == "length"


def test_echo_prefixes_the_prompt(client):
    kw = dict(model="tiny", prompt="Echo me", max_tokens=5, **greedy())
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == "Echo me" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw))
    assert streamed == echoed


def test_stop_string_cuts_the_text_and_says_stop(client):
    kw = dict(model="tiny", prompt="The weather today", **greedy())
    base = client.completions.create(max_tokens=30, extra_body={"ignore_eos": True}, **kw).choices[0].text
    # A stop string from the middle of the greedy text, at a place where it first occurs.
    cut = len(base) // 2
    stop = base[cut:cut + 3]
    while base.index(stop) != cut and cut > 1:
        cut -= 1
        stop = base[cut:cut + 3]
    expected = base[:base.index(stop)]
    r = client.completions.create(max_tokens=30, stop=[stop, "\x00never"], extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(max_tokens=30, stop=stop, stream=True, extra_body={"ignore_eos": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_repeatable(client):
    kw = dict(model="tiny", prompt="Random words:", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b and a != c


# ---- logprobs (issue 41) ----------------------------------------------------------------------------------

def check_top_sorted(pairs):
    values = [lp for _, lp in pairs]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_completion_logprobs_greedy_whole_and_streamed(client):
    kw = dict(model="smol", prompt="The history of the Roman Empire began", max_tokens=8, logprobs=3, **greedy())
    r = client.completions.create(**kw)
    choice, n = r.choices[0], r.usage.completion_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy: the chosen token is the top
        check_top_sorted(top.items())
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [t for s in streamed if s for t in s.tokens] == lp.tokens
    assert [t for s in streamed if s for t in s.token_logprobs] == lp.token_logprobs
    assert [t for s in streamed if s for t in s.text_offset] == lp.text_offset
    assert client.completions.create(model="smol", prompt="x", max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_sampled_token_is_always_listed(client):
    r = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=12, logprobs=1, temperature=1.5,
                                  seed=7, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob <= 0 and 1 <= len(top) <= 2  # the top one, and the sampled one when not it


def test_chat_logprobs_greedy_whole_and_streamed(client):
    kw = dict(model="smol", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2, **greedy())
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode("utf-8")) and c.logprob <= 0
        assert len(c.top_logprobs) == 2 and (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)
        check_top_sorted([(t.token, t.logprob) for t in c.top_logprobs])
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in c.top_logprobs)
    streamed = [x for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob, len(c.top_logprobs)) for c in streamed] == \
        [(c.token, c.logprob, len(c.top_logprobs)) for c in content]
    plain = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model="smol", messages=CHAT, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("chat,kwargs,needles", [
    (False, {"logprobs": 21}, ["logprobs=21", "[0, 20]"]),
    (False, {"logprobs": -1}, ["logprobs=-1", "[0, 20]"]),
    (True, {"logprobs": True, "top_logprobs": 21}, ["top_logprobs=21", "[0, 20]"]),
    (True, {"top_logprobs": 2}, ["top_logprobs", "logprobs"]),
])
def test_logprobs_out_of_range_are_400(client, chat, kwargs, needles):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model="smol", messages=CHAT, max_tokens=2, **kwargs)
        else:
            client.completions.create(model="smol", prompt="x", max_tokens=2, **kwargs)
    assert all(n in e.value.message for n in needles), e.value.message
    assert e.value.body["param"] == ("top_logprobs" if "top_logprobs" in kwargs else "logprobs")


# ---- usage: stream_options and cached tokens (issue 41) ----------------------------------------------------

def test_stream_options_continuous_usage_stats_put_usage_on_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(max_tokens=6, extra_body={"ignore_eos": True}, stream=True, stream_options=options, **greedy())
    for chunks in (list(client.completions.create(model="tiny", prompt="Once upon a time", **kw)),
                   list(client.chat.completions.create(model="smol", messages=CHAT, **kw))):
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens > 0
        assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[-2] == 6
        assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in chunks)
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    # continuous_usage_stats alone sends none (vLLM's rule: it adds to include_usage)
    chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)


def test_cached_tokens_report_prefix_cache_hits(client):
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 12  # fresh: never cached
    kw = dict(model="tiny", prompt=prompt, max_tokens=2)
    first = client.completions.create(**kw).usage
    second = client.completions.create(**kw).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens == first.prompt_tokens
    streamed = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens == second.prompt_tokens_details.cached_tokens
    messages = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=2).usage
    second = client.chat.completions.create(model="smol", messages=messages, max_tokens=2).usage
    # The chat template's opening (SmolLM2's default system message) may be cached by earlier requests already.
    assert first.prompt_tokens_details.cached_tokens < second.prompt_tokens_details.cached_tokens
    assert second.prompt_tokens // 2 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens


# ---- chat ---------------------------------------------------------------------------------------

def test_chat_uses_the_models_template(stack, client):
    server, _ = stack
    from transformers import AutoTokenizer

    r = client.chat.completions.create(model="smol", messages=CHAT, max_completion_tokens=30, **greedy())
    assert "Paris" in r.choices[0].message.content  # SmolLM2's answer through its own template
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    tok = AutoTokenizer.from_pretrained(SMOL)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    text, final = grpc_generate(server.grpc_url, "smol", rendered, max_tokens=30, temperature=0.0)
    assert r.choices[0].message.content == text  # the frontend sent exactly the rendered template
    assert r.usage.prompt_tokens == final["num_input_tokens"] == len(tok.encode(rendered))


def test_chat_stream_equals_non_stream_sync_and_async(client, aclient_url):
    kw = dict(model="smol", messages=CHAT + [{"role": "assistant", "content": "Paris."},
                                             {"role": "user", "content": "And of Italy?"}],
              max_tokens=20, **greedy())
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and not first.delta.content and first.finish_reason is None
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    u, fu = chunks[-1].usage, full.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == \
        (fu.prompt_tokens, fu.completion_tokens, fu.total_tokens)

    async def streamed(ac):
        out = []
        async for c in await ac.chat.completions.create(stream=True, **kw):
            if c.choices and c.choices[0].delta.content:
                out.append(c.choices[0].delta.content)
        return "".join(out), (await ac.chat.completions.create(**kw)).choices[0].message.content

    async_streamed, async_full = run_async(streamed, aclient_url)
    assert async_streamed == async_full == text


def test_concurrent_async_requests_all_answered(client, aclient_url):
    kw = dict(model="tiny", max_tokens=12, extra_body={"ignore_eos": True}, **greedy())
    prompts = [f"Item {i}:" for i in range(8)]
    expected = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def many(ac):
        rs = await asyncio.gather(*(ac.completions.create(prompt=p, **kw) for p in prompts))
        return [r.choices[0].text for r in rs]

    assert run_async(many, aclient_url) == expected  # batching with others does not change greedy text


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": 500}, "temperature=500"),  # the model's own message passed through
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 100000}, "max_model_len"),
    ({"n": 100}, "n=100"),  # n itself is supported, up to 16
    ({"logprobs": 21}, "logprobs=21"),
])
def test_bad_completion_parameters_are_400(client, kwargs, needle):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", stream=stream, **kwargs)
        assert needle in str(e.value.message) or needle in json.dumps(e.value.body)


@pytest.mark.parametrize("kwargs", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}},  # a function not among the tools
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    {"response_format": {"type": "xml"}},
    {"temperature": -1},
])
def test_bad_chat_parameters_are_400(client, kwargs):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": "smol", "messages": CHAT, **kwargs})
    assert e.value.body and e.value.body.get("message")


class RawRequest:
    """A POST on a bare socket: sent without waiting for any answer, and dropped at will. (An HTTP client
    would block until the headers, which a queued request only gets with its first token.)"""

    def __init__(self, base_url: str, path: str, body: dict):
        host, port = base_url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def read_until(self, marker: bytes) -> bytes:
        data = b""
        while marker not in data:
            chunk = self.sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def wait_metrics(server, model, ok, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server.metrics_url, model)
        if ok(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{model}: {what} not seen within {timeout_s}s: {m}")
        time.sleep(0.05)


def is_idle(m):
    return (m.get("vllm:num_requests_running"), m.get("vllm:num_requests_waiting"),
            m.get("vllm:kv_cache_usage_perc")) == (0, 0, 0)


def test_queue_full_is_503(stack, client):
    """tiny_q1 runs one request and queues one; a third is refused with UNAVAILABLE -> 503."""
    server, frontend = stack
    body = {"model": "tiny_q1", "prompt": "x", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    # One at a time: sent together, the second can find the first still queued and be refused itself.
    held = [RawRequest(frontend.base_url, "/v1/completions", body)]
    try:
        wait_metrics(server, "tiny_q1", lambda m: m.get("vllm:num_requests_running") == 1, "one running")
        held.append(RawRequest(frontend.base_url, "/v1/completions", body))
        wait_metrics(server, "tiny_q1", lambda m: m.get("vllm:num_requests_running") == 1 and
                     m.get("vllm:num_requests_waiting") == 1, "one running and one waiting")
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny_q1", prompt="x", max_tokens=5)
        assert e.value.status_code == 503 and "queue" in e.value.message
    finally:
        for r in held:
            r.close()
    wait_metrics(server, "tiny_q1", is_idle, "idle after the clients left")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_request(stack, stream):
    server, frontend = stack
    before = wait_metrics(server, "tiny", is_idle, "idle")
    body = {"model": "tiny", "prompt": "Go on and on", "max_tokens": 1900, "ignore_eos": True, "stream": stream}
    req = RawRequest(frontend.base_url, "/v1/completions", body)
    try:
        if stream:
            assert b"data: " in req.read_until(b"data: ")
        # The gauges see the request while it runs...
        wait_metrics(server, "tiny", lambda m: m.get("vllm:num_requests_running", 0) >= 1 and
                     m.get("vllm:kv_cache_usage_perc", 0) > 0, "a running request")
    finally:
        req.close()
    # ...and once the client is gone, the request is dropped long before its 1900 tokens.
    after = wait_metrics(server, "tiny", is_idle, "idle after the client left")
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < 1900


# ---- make serve ----------------------------------------------------------------------------------

def test_serve_script_runs_the_openai_api_beside_tritonserver(tmp_path):
    """scripts/serve.py with OPENAI_PORT: the API answers, lists models through the admin-restricted
    repository index, and is stopped with the server."""
    repo = make_model_repository(MODEL_REPOSITORY, tmp_path / "repo",
                                 {"llm": {"model": TINY, "kv_cache_memory_bytes": SMALL_KV}})
    http, grpc, metrics, oai = free_ports(4)
    env = {**os.environ, "MODEL_REPOSITORY": str(repo), "HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
           "METRICS_PORT": str(metrics), "OPENAI_PORT": str(oai), "EXIT_TIMEOUT_SECS": "5"}
    log_path = tmp_path / "serve.log"
    with serve_script(env, log_path, "OpenAI-compatible API on"):
        frontend_pid = int(re.search(r"OpenAI-compatible API on \S+ \(pid (\d+)\)", log_path.read_text()).group(1))
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{oai}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in api.models.list().data] == ["llm"]
        r = api.completions.create(model="llm", prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    assert "stopped cleanly" in log_path.read_text()
    assert not Path(f"/proc/{frontend_pid}").exists()


# ---- n choices ------------------------------------------------------------------------------------

def test_n_choices_whole_and_streamed(client):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, n=3, seed=5,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    assert r.usage.completion_tokens == 24 and all(c.finish_reason == "length" for c in r.choices)
    texts, finishes = ["", ""], [None, None]
    for chunk in client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, n=2, seed=5,
                                                temperature=1.0, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert all(texts) and finishes == ["length", "length"]


# ---- other clients' habits (issue 41) ---------------------------------------------------------------------

def finishes_and_texts(stream) -> tuple[collections.Counter, dict]:
    finishes, texts = collections.Counter(), collections.defaultdict(str)
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += (c.text if hasattr(c, "text") else c.delta.content) or ""
            if c.finish_reason:
                finishes[c.index, c.finish_reason] += 1
    return finishes, dict(texts)


def ending_apart(create, **kw):
    """A seed whose n choices end apart (one at the end of its text, one at max_tokens), and its whole response."""
    for seed in range(1, 13):
        whole = create(seed=seed, **kw)
        if {c.finish_reason for c in whole.choices} == {"stop", "length"}:
            return seed, whole
    pytest.fail("no seed made the choices end apart")


def test_n_streamed_choices_each_finish_once(client):
    """Choices that end at different steps (the model repeats a finished sample in every later response)."""
    kw = dict(model="smol", max_tokens=10, n=3, temperature=1.0)
    prompt = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's turn: it ends early
    seed, whole = ending_apart(client.completions.create, prompt=prompt, **kw)
    finishes, texts = finishes_and_texts(client.completions.create(stream=True, prompt=prompt, seed=seed, **kw))
    assert finishes == collections.Counter({(c.index, c.finish_reason): 1 for c in whole.choices})
    assert texts == {c.index: c.text for c in whole.choices}
    seed, whole = ending_apart(client.chat.completions.create, messages=CHAT, **kw)
    finishes, texts = finishes_and_texts(client.chat.completions.create(stream=True, messages=CHAT, seed=seed, **kw))
    assert finishes == collections.Counter({(c.index, c.finish_reason): 1 for c in whole.choices})
    assert texts == {c.index: c.message.content for c in whole.choices}


UNIT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


def test_required_tool_calls_with_defs_streamed_with_n_arrive_once_each(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls = collections.defaultdict(str)
    finishes = collections.Counter()
    for chunk in client.chat.completions.create(model="smol", messages=ask, tools=[UNIT_TOOL], tool_choice="required",
                                                n=2, seed=3, temperature=1.0, max_tokens=120, stream=True):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:  # a choice may hold several calls: each has its index
                calls[c.index, call.index] += call.function.arguments or ""
            if c.finish_reason:
                finishes[c.index, c.finish_reason] += 1
    assert finishes == {(0, "tool_calls"): 1, (1, "tool_calls"): 1}
    assert {choice for choice, _ in calls} == {0, 1}
    # The same seeded samples unstreamed: as many calls per choice, none sent twice under another index.
    whole = client.chat.completions.create(model="smol", messages=ask, tools=[UNIT_TOOL], tool_choice="required",
                                           n=2, seed=3, temperature=1.0, max_tokens=120)
    assert sorted(calls) == sorted((c.index, i) for c in whole.choices for i in range(len(c.message.tool_calls)))
    for arguments in calls.values():
        jsonschema.validate(json.loads(arguments), UNIT_TOOL["function"]["parameters"])


def test_seed_is_read_as_an_exact_int64(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=2, seed=2**63 - 1)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, seed=2**63)
    assert "seed=9223372036854775808 is out of range: allowed an integer in [0, 2^63)" in e.value.message


def test_other_servers_constraint_fields_are_honoured_or_refused(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    ask = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
    r = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0,
                                       extra_body={"json_schema": schema})  # llama.cpp's field
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model="smol", prompt="Is Paris in France?", max_tokens=5, temperature=0,
                                  extra_body={"guided_regex": "(yes|no)"})  # vLLM's
    assert r.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=ask, max_tokens=5,
                                       extra_body={"grammar": 'root ::= "yes" | "no"'})  # llama.cpp's GBNF
    assert e.value.body["param"] == "grammar" and "GBNF" in e.value.message


# ---- reasoning parser (vLLM's --reasoning-parser qwen3, issue 41) ------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_frontends(tmp_path_factory):
    """tiny-qwen3 (random weights: it writes no think tags of its own) behind two frontends of one tritonserver:
    one started with --reasoning-parser qwen3, one without."""
    from engine_helpers import TINY_QWEN3

    if not (Path(TINY_QWEN3) / "config.json").exists():
        pytest.skip(f"{TINY_QWEN3} missing: run scripts/prepare_models.py")
    tmp = tmp_path_factory.mktemp("reasoning_stack")
    repo = make_model_repository(MODEL_REPOSITORY, tmp / "repo", {
        "qwen3": {"model": Path(TINY_QWEN3), "kv_cache_memory_bytes": SMALL_KV, "max_model_len": 1024}})
    server = TritonServer(repo, log_path=tmp / "server.log")
    with server:
        with FrontendProcess(server.grpc_url, tmp / "on.log", ("--reasoning-parser", "qwen3")) as on, \
                FrontendProcess(server.grpc_url, tmp / "off.log") as off:
            yield [openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
                   for f in (on, off)]
    assert server.leftovers() == []


def test_reasoning_parser_is_opt_in_and_splits_qwen3_replies_as_vllm(qwen3_frontends):
    from openai_frontend.reasoning import split

    on, off = qwen3_frontends
    ask = dict(model="qwen3", messages=CHAT, max_tokens=8, temperature=0)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    # Off (the default): the reply is as before, no reasoning keys.
    plain = off.chat.completions.create(**ask).choices[0].message
    assert not {"reasoning_content", "reasoning"} & set(plain.model_extra or {})
    plain_off = off.chat.completions.create(**ask, extra_body=no_thinking).choices[0].message
    # On, thinking (Qwen3's default): the same text read as vLLM's qwen3 parser reads it; without a </think> it is
    # all reasoning and content is null (a reply cut while thinking).
    r = on.chat.completions.create(**ask).choices[0].message
    assert r.model_extra["reasoning_content"] == r.model_extra["reasoning"]
    assert (r.model_extra["reasoning"], r.content) == split(plain.content)
    streamed = collections.defaultdict(str)
    for chunk in on.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            streamed["content"] += c.delta.content or ""
            for key in ("reasoning_content", "reasoning"):
                streamed[key] += (c.delta.model_extra or {}).get(key) or ""
    assert streamed["reasoning_content"] == streamed["reasoning"] == (r.model_extra["reasoning"] or "")
    assert streamed["content"] == (r.content or "")
    # On, enable_thinking false: the template closed the block, so the key is there, null, and content unchanged.
    r = on.chat.completions.create(**ask, extra_body=no_thinking).choices[0].message
    assert r.model_extra["reasoning_content"] is None and r.model_extra["reasoning"] is None
    assert r.content == plain_off.content
    # Completions are not parsed, as in vLLM.
    prompt = dict(model="qwen3", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert on.completions.create(**prompt).choices[0].text == off.completions.create(**prompt).choices[0].text
    # What cannot be honoured is refused by name.
    with pytest.raises(openai.BadRequestError) as e:
        off.chat.completions.create(**ask, extra_body={"include_reasoning": False})
    assert e.value.body["param"] == "include_reasoning" and "--reasoning-parser" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        on.chat.completions.create(**ask, response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and "enable_thinking" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        on.chat.completions.create(**ask, reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort"
    r = on.chat.completions.create(**ask, extra_body={"include_reasoning": False}).choices[0].message
    assert r.model_extra["reasoning"] is None and r.content == split(plain.content)[1]
