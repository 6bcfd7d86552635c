"""The OpenAI-compatible server against real HTTP on 127.0.0.1: the official ``openai`` client,
raw SSE read with httpx, many concurrent clients, disconnects, bad fields, auth and overload."""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn

from runner import InferenceRunner, ModelRunner, Request
from runner.grammar import COMPACT, _WHITESPACE as SPACED
from server import Limits, Server
from server.http import ShutdownHandle, uvicorn_config
from tests.test_runner import CONFIG, params  # noqa: F401 (fixture)

MODEL = "tiny-test"


class LiveServer:
    """A uvicorn server (the config ``serve`` runs with) in a thread on a free port of 127.0.0.1;
    ``stop()`` ends it."""

    def __init__(self, server: Server, limits: Limits = Limits()):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn_config(server.app, limits, lifespan="on"))
        self.shutdown = ShutdownHandle(server, self.uvicorn)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.uvicorn.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def _runner(params, tokenizer, batch_size=4):
    r = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=batch_size,
                        pad_sizes=(8, 16, 32), tokenizer_path=tokenizer, max_num_batched_tokens=32,
                        score_prompts=True)
    # warmed up: its clients (httpx's default 5 s timeout among them) never wait on a compile
    return r.initialize()


@pytest.fixture(scope="module")
def served(params, test_tokenizer):
    runner = _runner(params, test_tokenizer)
    server = Server(runner, MODEL)
    live = LiveServer(server)
    yield runner, server, live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key="unused", max_retries=0)


def solo_text(runner, prompt, **settings):
    done = runner.complete(Request(prompt, **settings))
    return done.text, done.token_ids


def test_models_and_health(served, client):
    _, _, live = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live.url + "/health").status_code == 200


def test_completion_equals_the_runners_own_output(served, client):
    runner = served[0]
    want, _ = solo_text(runner, "the house", temperature=0.0, max_len=10)
    r = client.completions.create(model=MODEL, prompt="the house", max_tokens=10, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(runner.tokenizer.encode("the house"))
    seeded, _ = solo_text(runner, "a letter", temperature=0.9, nucleus_p=0.9, rng_seed=7, max_len=8)
    r = client.completions.create(model=MODEL, prompt="a letter", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    assert r.choices[0].text == seeded
    # several prompts, ids among them, and n choices (seed + i)
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=1.0, seed=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt = [[5, 6, 7], [8, 9]][c.index // 2]
        assert c.text == solo_text(runner, prompt, temperature=1.0, rng_seed=3 + c.index % 2, max_len=4)[0]


def test_streamed_completion_and_chat_equal_the_whole_ones(served, client):
    whole = client.completions.create(model=MODEL, prompt="her sister", max_tokens=12, temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt="her sister", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == 12 and parts[-2].choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the ball"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # the default template: a line per message, then "Assistant:" to complete
    prompt = "System: Be brief.\nUser: the ball\nAssistant:"
    assert chat.choices[0].message.content == solo_text(served[0], prompt, temperature=0.0, max_len=9)[0]


def test_raw_sse_framing(served):
    body = {"model": MODEL, "prompt": "the", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", served[2].url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and "\n" not in e
        assert json.loads(e[len("data: "):])["object"] == "text_completion"


def test_logprobs_and_echo(served, client):
    r = client.completions.create(model=MODEL, prompt="the house", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) == 3 for t in lp.top_logprobs)
    for token, value, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and max(tops.values()) == pytest.approx(value, abs=1e-5)  # greedy: the best one
    # offsets into the text (a character of several byte tokens belongs to its last one)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(r.choices[0].text)
    echo = client.completions.create(model=MODEL, prompt="the house", max_tokens=3, temperature=0, logprobs=2,
                                     echo=True)
    n_prompt = len(served[0].tokenizer.encode("the house"))
    e = echo.choices[0]
    assert e.text.startswith("the house") and e.logprobs.token_logprobs[0] is None
    assert len(e.logprobs.tokens) == n_prompt + 3 and all(v <= 0 for v in e.logprobs.token_logprobs[1:])
    # the prompt scored by its prefill: shared by every choice, and first in a stream
    two = client.completions.create(model=MODEL, prompt="the house", max_tokens=3, temperature=0.7, seed=5, n=2,
                                    logprobs=2, echo=True)
    for c in two.choices:
        assert c.logprobs.token_logprobs[:n_prompt] == pytest.approx(e.logprobs.token_logprobs[:n_prompt], abs=1e-6)
        assert c.logprobs.tokens[:n_prompt] == e.logprobs.tokens[:n_prompt]
    chunks = list(client.completions.create(model=MODEL, prompt="the house", max_tokens=3, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    streamed = [lp for ch in chunks if ch.choices and (lp := ch.choices[0].logprobs) is not None]
    assert sum((lp.tokens for lp in streamed), []) == e.logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == e.logprobs.text_offset
    assert sum((lp.token_logprobs for lp in streamed), [])[1:] == pytest.approx(e.logprobs.token_logprobs[1:],
                                                                                abs=1e-6)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 5 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == chat.choices[0].message.content


def test_a_prompt_is_tokenized_once(served, client, monkeypatch):
    """Text in: one ``encode`` for a completion's prompt (with n, echo and logprobs), one for a
    chat's rendered messages; the runner and the core take the ids from there."""
    tokenizer = served[0].tokenizer
    calls, encode = [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(text) or encode(text))
    client.completions.create(model=MODEL, prompt="the house", max_tokens=2, n=2, logprobs=1, echo=True)
    assert calls == ["the house"]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert len(calls) == 2


def test_stop_strings_cut_the_text_across_tokens(served, client):
    full = client.completions.create(model=MODEL, prompt="the letter", max_tokens=20, temperature=0).choices[0].text
    stop = full[7:10]  # three characters that may straddle token boundaries
    assert stop and stop in full
    r = client.completions.create(model=MODEL, prompt="the letter", max_tokens=20, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="the letter", max_tokens=20, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_64_concurrent_streaming_clients_each_get_their_solo_output(served):
    runner, _, live = served
    settings = [dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.9, seed=i)
                for i in range(64)]
    prompts = [f"the house {i % 7}" if i % 3 else f"a letter from her sister {i}" for i in range(64)]
    lengths = [3 + i % 6 for i in range(64)]
    want = [solo_text(runner, p, temperature=s["temperature"], nucleus_p=s.get("top_p", 1.0), rng_seed=s.get("seed"),
                      max_len=n)[0] if "seed" in s else solo_text(runner, p, temperature=0.0, max_len=n)[0]
            for p, s, n in zip(prompts, settings, lengths)]

    async def main():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)

        async def one(i):
            stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i],
                                                     stream=True, **settings[i])
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == want


def _metric(live, name, labels="") -> float:
    """The value of metric ``name`` whose labels include ``labels``; 0 if it has no such series yet."""
    for line in httpx.get(live.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait(condition, what: str, limit: float = 10):
    deadline = time.time() + limit
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.02)


@contextlib.contextmanager
def rounds_by_hand(runner):
    """Hold the engine core's rounds: none runs but those the test runs itself, by calling what
    this yields (the core's own thread waits for the lock meanwhile)."""
    runner.engine._round_lock.acquire()
    try:
        yield runner.engine._round
    finally:
        runner.engine._round_lock.release()


def test_a_disconnect_cancels_the_request_and_frees_its_slot(served):
    runner, _, live = served
    aborted = _metric(live, "vllm:request_success_total", 'finished_reason="abort"')
    body = {"model": MODEL, "prompt": "the", "max_tokens": 60, "temperature": 0, "stream": True}
    with rounds_by_hand(runner) as round_:  # the request cannot finish by itself meanwhile
        with httpx.stream("POST", live.url + "/v1/completions", json=body) as r:
            _wait(lambda: sum(runner.engine.counts()) == 1, "the request was not submitted")
            round_(), round_()  # its prefill, and a decode call that reads the prefill's token
            assert next(r.iter_lines()).startswith("data: ")
        time.sleep(0.5)  # the server notices the disconnect and queues the cancellation
        assert _metric(live, "vllm:num_requests_running") == 1
    deadline = time.time() + 10
    while _metric(live, "vllm:num_requests_running") != 0:
        assert time.time() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.05)
    assert _metric(live, "vllm:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert _metric(live, "vllm:kv_cache_usage_perc") == 0.0
    metrics = httpx.get(live.url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in metrics, name


BAD = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": -2}, "top_k"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"suffix": "x"}, "suffix"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


def test_each_bad_field_is_a_400_naming_it_while_others_stream_on(served, client):
    _, _, live = served
    stream = client.completions.create(model=MODEL, prompt="the house", max_tokens=40, temperature=0, stream=True)
    first = next(iter(stream))
    for fields, param in BAD:
        body = {"model": MODEL, "prompt": "the", "max_tokens": 4, **fields}
        r = httpx.post(live.url + "/v1/completions", json=body)
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (fields, error)
    rest = "".join(c.choices[0].text for c in stream if c.choices)
    whole = client.completions.create(model=MODEL, prompt="the house", max_tokens=40, temperature=0)
    assert first.choices[0].text + rest == whole.choices[0].text
    for raw, status in ((b"{not json", 400), (b"[1, 2]", 400)):
        r = httpx.post(live.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status and "error" in r.json()
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    r = httpx.post(live.url + "/v1/completions", content=b"x" * (5 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_tokenize_and_detokenize(served):
    _, _, live = served
    ids = httpx.post(live.url + "/tokenize", json={"prompt": "the house"}).json()
    assert ids["tokens"] == served[0].tokenizer.encode("the house") and ids["count"] == len(ids["tokens"])
    assert httpx.post(live.url + "/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "the house"}
    assert httpx.post(live.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


@pytest.fixture(scope="module")
def one_slot(params, test_tokenizer):
    """A one-slot runner for the tests that build their own server over it, one at a time."""
    return _runner(params, test_tokenizer, batch_size=1)


class own_server:
    """``with own_server(runner, **Server kwargs) as (server, live):`` a server of its own."""

    def __init__(self, runner, limits: Limits = Limits(), **kwargs):
        self.server = Server(runner, MODEL, **kwargs)
        self.limits = limits

    def __enter__(self):
        self.live = LiveServer(self.server, self.limits)
        return self.server, self.live

    def __exit__(self, *exc):
        self.live.stop()


def test_auth_and_overload(one_slot):
    with own_server(one_slot, api_key="sekrit", max_waiting=1) as (_, live):
        url = live.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "the", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url, json=body).status_code == 401
        for header in ("Bearer wrong", "Basic sekrit", "Bearer", "sekrit", "Bearer sekrit2", "Bearer sekri"):
            assert httpx.post(url, json=body, headers={"Authorization": header}).status_code == 401, header
        for header in ("Bearer sekrit", "bearer sekrit", "BEARER sekrit", "Bearer  sekrit"):  # RFC 7235: any case
            assert httpx.post(url, json=body, headers={"Authorization": header}).status_code == 200, header
        auth = {"Authorization": "Bearer sekrit"}
        # public without the key: health, metrics and the docs (and only those)
        for path in ("/health", "/metrics", "/docs", "/openapi.json"):
            assert httpx.get(live.url + path).status_code == 200, path
        assert httpx.get(live.url + "/v1/models").status_code == 401
        # one slot and one waiting place: of 6 simultaneous long requests, some are answered 503
        long = {**body, "max_tokens": 60}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(url, json=long, headers=auth) for _ in range(6)))

        codes = [r.status_code for r in asyncio.run(burst())]
        assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 1, codes
        rejected = next(r for r in asyncio.run(burst()) if r.status_code == 503)
        assert rejected.headers["retry-after"] == "1" and rejected.json()["error"]["type"] == "server_overloaded"


def test_metrics_and_docs_behind_the_key_when_asked(one_slot):
    with pytest.raises(ValueError, match="needs an api_key"):
        Server(one_slot, MODEL, private_docs_and_metrics=True)
    with own_server(one_slot, api_key="sekrit", private_docs_and_metrics=True) as (_, live):
        assert httpx.get(live.url + "/health").status_code == 200
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
            assert httpx.get(live.url + path).status_code == 401, path
            r = httpx.get(live.url + path, headers={"Authorization": "bearer sekrit"})
            assert r.status_code == 200, path
        assert "vllm:num_requests_running" in httpx.get(live.url + "/metrics",
                                                        headers={"Authorization": "Bearer sekrit"}).text


def test_json_endpoints_take_only_json(served):
    _, _, live = served
    body = json.dumps({"model": MODEL, "prompt": "the", "max_tokens": 2})
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {} if media is None else {"Content-Type": media}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            r = httpx.post(live.url + path, content=body, headers=headers)
            assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (media, path, r.text)
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_malformed_and_too_deep_json_are_a_400(served):
    _, _, live = served
    headers = {"Content-Type": "application/json"}
    for raw in (b"[" * 10000 + b"]" * 10000, b'{"model": "tiny-test", "prompt": "the", "stream_options": '
                + b"[" * 10000 + b"]" * 10000 + b"}", b'{"model": "tiny-test", "prompt": "the", "user": '
                + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", b"\xff\xfe{}", b"", b'{"model": "tiny-test",'):
        r = httpx.post(live.url + "/v1/completions", content=raw, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (raw[:40], r.text[:200])
    assert httpx.get(live.url + "/health").status_code == 200


def test_choices_that_fit_are_served_and_those_that_never_fit_are_a_400(one_slot):
    """1 slot + 3 waiting: 4 prompts on an idle server are all served (a 503 before); 5 can never
    be admitted at once, so a 400 naming the limit, not a retryable 503."""
    prompts = [[5, 6], [7, 8, 9], [10], [11, 12]]
    with own_server(one_slot, max_waiting=3) as (_, live):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0)
        assert [c.text for c in r.choices] == [solo_text(one_slot, p, temperature=0.0, max_len=3)[0] for p in prompts]
        assert len(client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, n=4).choices) == 4
        for fields, param in (({"prompt": prompts + [[13]]}, "prompt"), ({"prompt": [5, 6], "n": 5}, "n"),
                              ({"prompt": [[5], [6], [7]], "n": 2}, "prompt"),
                              ({"prompt": ["the"] * 3000, "echo": True, "logprobs": 2}, "prompt")):
            r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
            assert "1 slots + 3 waiting = 4" in r.json()["error"]["message"], r.text
        r = httpx.post(live.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "the"}], "n": 5, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_prompt_scoring_has_a_budget(one_slot):
    ids = one_slot.tokenizer.encode("the house of her sister")
    assert len(ids) >= 4
    with own_server(one_slot, max_scored_tokens=len(ids) + 1) as (_, live):
        url = live.url + "/v1/completions"
        body = {"model": MODEL, "max_tokens": 1, "echo": True, "logprobs": 1}
        ok = httpx.post(url, json={**body, "prompt": "the house of her sister"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
        r = httpx.post(url, json={**body, "prompt": ["the house of her sister"] * 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
        assert f"at most {len(ids) + 1} prompt tokens" in r.json()["error"]["message"]
        # without logprobs nothing is scored, so no budget applies
        assert httpx.post(url, json={**body, "logprobs": None, "prompt": ["the house"] * 2}).status_code == 200


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(served, caplog):
    """Its requests are cancelled (``abort``), never run to their end as a success, and the
    disconnect is one info line."""
    runner, _, live = served
    aborted = _metric(live, "vllm:request_success_total", 'finished_reason="abort"')
    done = _metric(live, "vllm:request_success_total", 'finished_reason="length"')
    caplog.set_level("INFO", logger="grok_runner.server")
    body = json.dumps({"model": MODEL, "prompt": "the", "max_tokens": 60, "temperature": 0, "n": 2}).encode()
    with rounds_by_hand(runner) as round_:  # the request cannot finish by itself meanwhile
        with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait(lambda: sum(runner.engine.counts()) == 2, "the request was not submitted")
            round_(), round_()  # both choices' prefills, and a decode call: they run
            assert runner.engine.counts()[0] == 2
        _wait(lambda: any("disconnected before its answer" in r.message for r in caplog.records),
              "the disconnect was not noticed")
    _wait(lambda: _metric(live, "vllm:request_success_total", 'finished_reason="abort"') == aborted + 2,
          "the requests were not counted as aborted")
    _wait(runner.engine.idle, "the requests still run")
    assert _metric(live, "vllm:request_success_total", 'finished_reason="length"') == done
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_a_client_leaving_during_its_upload_is_one_info_line(served, caplog):
    _, _, live = served
    caplog.set_level("INFO", logger="grok_runner.server")
    with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.3)
    _wait(lambda: any("left during the upload of /v1/completions, after 10 bytes" in r.message
                      for r in caplog.records), "the disconnect was not logged")
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert httpx.get(live.url + "/health").status_code == 200


def test_shutdown_ends_requests_in_flight_with_an_error(one_slot):
    """Draining refuses new work and reports not ready; at the drain timeout a stream in flight
    ends with an error event and [DONE], a whole response with a 503, and their runner requests
    are cancelled."""
    with own_server(one_slot) as (server, live):
        url = live.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "the", "max_tokens": 50, "temperature": 0}
        with rounds_by_hand(one_slot) as round_:  # nothing finishes by itself from here on
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as stream:
                _wait(lambda: sum(one_slot.engine.counts()) == 1, "the stream's request was not submitted")
                round_(), round_()
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                whole = {}
                waiter = threading.Thread(target=lambda: whole.update(r=httpx.post(url, json=body, timeout=30)))
                waiter.start()
                _wait(lambda: sum(one_slot.engine.counts()) == 2, "the second request was not submitted")
                server.begin_drain()
                assert httpx.get(live.url + "/health").status_code == 503
                refused = httpx.post(url, json=body)
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
                assert live.shutdown.server is server
                live.shutdown.expire()
                waiter.join(timeout=30)
                assert whole["r"].status_code == 503, whole["r"].text
                assert "shutting down" in whole["r"].json()["error"]["message"]
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]" and "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        _wait(one_slot.engine.idle, "the ended requests still run")


def test_the_shipped_model_served_end_to_end(shipped_runner):
    runner = shipped_runner
    live = LiveServer(Server(runner, "austen-moe"))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="austen-moe", prompt="It is a truth universally acknowledged, that",
                                      max_tokens=12, temperature=0)
        want = runner.complete(Request("It is a truth universally acknowledged, that", temperature=0.0, max_len=12))
        assert r.choices[0].text == want.text and len(want.text) > 10
        chat = client.chat.completions.create(model="austen-moe", messages=[{"role": "user", "content": "Bath?"}],
                                              max_tokens=5, temperature=0)
        assert chat.usage.completion_tokens == 5
        # structured output from the trained model: complete, parsed, valid, for each schema and seed
        import jsonschema

        for schema in SHIPPED_SCHEMAS:
            for seed in range(2):
                format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
                r = client.chat.completions.create(
                    model="austen-moe", messages=[{"role": "user", "content": "Describe a character as JSON."}],
                    temperature=0.8, seed=seed, max_tokens=200, response_format=format_)
                assert r.choices[0].finish_reason == "stop", r.choices[0]
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        # any object: the model (trained on prose) often writes a string that runs past the budget;
        # whatever it closes parses
        closed = 0
        for seed in range(4):
            r = client.completions.create(model="austen-moe", prompt="{", max_tokens=60, temperature=0.8, seed=seed,
                                          extra_body={"response_format": {"type": "json_object"}})
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(r.choices[0].text), dict)
                closed += 1
        assert closed >= 1
    finally:
        live.stop()


SHIPPED_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "role": {"enum": ["heroine", "suitor", "aunt", "clergyman"]}},
     "required": ["name", "age", "role"], "additionalProperties": False},
    {"type": "object", "properties": {
        "letters": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"to": {"type": "string", "maxLength": 16}, "sealed": {"type": "boolean"}},
            "required": ["to", "sealed"], "additionalProperties": False}},
        "income": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 10000}]}},
     "required": ["letters", "income"], "additionalProperties": False},
    {"type": "object", "properties": {"married": {"type": "boolean"}, "to": {"type": "string", "pattern": "^Mr [A-Z][a-z]{1,10}$"}},
     "required": ["married", "to"], "additionalProperties": False},
]


MULTIHOST = dataclasses.replace(CONFIG, emb_size=64, num_q_heads=4, num_kv_heads=4, key_size=8)


def multihost_params():
    from model import init_params
    from tests.helpers import lively

    return jax.tree_util.tree_map(np.asarray, lively(init_params(MULTIHOST, jax.random.PRNGKey(5))))


def multihost_runner(tokenizer):
    """The runner of each of 2 processes (4 devices each, a (2, 4) mesh over both)."""
    from model.sharding import make_mesh

    # one bucket under a 16-token budget: one prefill variant to compile (each process compiles its own)
    runner = InferenceRunner(runner=ModelRunner(model=MULTIHOST, params=multihost_params()), batch_size=4, pad_sizes=(16,),
                             mesh=make_mesh((2, 4)), tokenizer_path=tokenizer, max_num_batched_tokens=16)
    return runner.initialize(warmup=False)


def test_two_processes_behind_one_server(test_tokenizer):
    """Process 0 serves HTTP and broadcasts each round's admissions and cancellations; process 1
    runs the same steps. Greedy answers equal full forwards of the same parameters on one device,
    and each answer in a shared round equals the same request alone. (One process of 8 devices
    against two: ``test_sharding``'s two-process test, with -m slow.)"""
    from backends import XLA
    from model import forward
    from tokenization import SentencePieceTokenizer as Tokenizer
    from tests.test_sharding import REPO, free_port

    port, http_port = str(free_port()), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    worker = str(REPO / "tests" / "multihost_server_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(i), "2", port, str(http_port), test_tokenizer], env=env,
                              cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    url = f"http://127.0.0.1:{http_port}"
    try:
        asks = [("the house", dict(temperature=0.0)), ("a letter from her sister", dict(temperature=0.0)),
                ("the ball", dict(temperature=0.9, top_p=0.9, seed=4))]
        # while the two processes start: the greedy answers by full forwards without a cache
        tokenizer, params = Tokenizer(test_tokenizer), multihost_params()
        fwd = jax.jit(lambda t, n: forward(params, t, MULTIHOST, lengths=n, backend=XLA()).logits)
        want = []
        for prompt, _ in asks[:2]:
            ids, out = tokenizer.encode(prompt), []
            while len(out) < 8 and (not out or out[-1] != MULTIHOST.eos_token):
                tokens = np.zeros((1, MULTIHOST.sequence_len), np.int32)
                tokens[0, : len(ids) + len(out)] = ids + out
                out.append(int(np.asarray(fwd(tokens, np.array([len(ids) + len(out)])))[0, len(ids) + len(out) - 1].argmax()))
            want.append(tokenizer.decode([t for t in out if t != MULTIHOST.eos_token]))
        deadline = time.time() + 240
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
            assert time.time() < deadline, "the 2-process server did not start"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def together():  # at once, so they share rounds
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            try:
                return await asyncio.gather(*(c.completions.create(model="multihost", prompt=p, max_tokens=8, **s)
                                              for p, s in asks))
            finally:
                await c.close()

        got = [r.choices[0].text for r in asyncio.run(together())]
        assert got[:2] == want
        alone = client.completions.create(model="multihost", prompt=asks[2][0], max_tokens=8, **asks[2][1])
        assert got[2] == alone.choices[0].text
        # a cancelled (disconnected) stream on process 0 is cancelled on process 1 as well: the
        # processes stay in step, and later answers are still right
        with httpx.stream("POST", url + "/v1/completions", json={"model": "multihost", "prompt": "the", "max_tokens": 50,
                                                                  "temperature": 0, "stream": True}) as r:
            next(r.iter_lines())
        again = client.completions.create(model="multihost", prompt=asks[0][0], max_tokens=8, temperature=0)
        assert again.choices[0].text == want[0]
    finally:
        procs[0].send_signal(signal.SIGTERM)  # uvicorn shuts down; the core tells process 1 to stop
        logs = [p.communicate(timeout=120)[0] for p in procs]
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 and f"process {i} done" in log, log[-3000:]


# ---- the API conventions clients expect (issue 24) ---------------------------------------------
def _completion(live, **fields):
    return httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "the house", **fields},
                      timeout=60)


def test_unknown_fields_are_accepted_and_logged_once_and_nulls_are_defaults(served, caplog):
    runner, _, live = served
    want = _completion(live, max_tokens=5, temperature=0).json()["choices"][0]["text"]
    extras = {"spaces_between_special_tokens": True, "some_client_field": {"x": 1}}
    newer = {"store": False, "metadata": {"run": "7"}, "user": "u-1", "service_tier": "auto"}
    nulls = {"top_p": None, "seed": None, "stop": None, "n": None, "logprobs": None, "top_k": None}
    with caplog.at_level("WARNING", logger="grok_runner.server"):
        for _ in range(2):
            r = _completion(live, max_tokens=5, temperature=0, **extras, **newer, **nulls)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
    logged = [rec.getMessage() for rec in caplog.records if "unknown field" in rec.getMessage()]
    assert sorted(m.split("'")[1] for m in logged) == sorted(extras)  # once per name
    r = _completion(live, max_tokens=5, temperature=None)  # null: the default temperature (1.0), sampled
    assert r.status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for fields in ({"parallel_tool_calls": True, "tool_choice": "none"}, {"tool_choice": "auto"},
                   {"tools": None, "temperature": None, "response_format": {"type": "text"}}):
        r = httpx.post(live.url + "/v1/chat/completions", json={**chat, **fields}, timeout=60)
        assert r.status_code == 200, (fields, r.text)
    for fields, param in (({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")):
        r = httpx.post(live.url + "/v1/chat/completions", json={**chat, **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_vllm_extras_and_penalties_equal_the_runners_own(served):
    runner, _, live = served
    prompt_ids = runner.tokenizer.encode("the house")
    cases = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=0.5),
             dict(min_tokens=6, max_tokens=8), dict(ignore_eos=True), dict(min_p=0.2, temperature=0.8, seed=3)]
    for case in cases:
        fields = {"max_tokens": 8, "temperature": 0, **case}
        got = _completion(live, **fields).json()["choices"][0]
        settings = dict(temperature=fields["temperature"], max_len=fields["max_tokens"],
                        rng_seed=fields.get("seed"),
                        **{k: v for k, v in case.items() if k not in ("max_tokens", "temperature", "seed")})
        want = runner.complete(Request(prompt_ids, **settings))
        assert got["text"] == want.text, case
    # any integer seed: the key is its 64 bits (choice i takes seed + i)
    a = _completion(live, max_tokens=6, seed=-5, n=2).json()["choices"]
    b = _completion(live, max_tokens=6, seed=2**64 - 5, n=2).json()["choices"]
    c = _completion(live, max_tokens=6, seed=2**63 + 11).json()["choices"]
    assert [x["text"] for x in a] == [x["text"] for x in b] and c[0]["text"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served):
    runner, _, live = served
    n_prompt = len(runner.tokenizer.encode("the house"))
    plain = _completion(live, max_tokens=0, echo=True).json()
    assert plain["choices"][0]["text"] == "the house" and plain["choices"][0]["logprobs"] is None
    assert plain["usage"]["completion_tokens"] == 0 and plain["usage"]["prompt_tokens"] == n_prompt
    scored = _completion(live, max_tokens=0, echo=True, logprobs=2).json()
    longer = _completion(live, max_tokens=3, echo=True, logprobs=2, temperature=0).json()
    lp, want = scored["choices"][0]["logprobs"], longer["choices"][0]["logprobs"]
    assert lp["tokens"] == want["tokens"][:n_prompt] and len(lp["tokens"]) == n_prompt
    assert lp["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:n_prompt], abs=1e-6)
    assert scored["choices"][0]["text"] == "the house" and scored["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": MODEL, "prompt": "the house", "max_tokens": 0, "echo": True, "logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"]
    assert events[-1]["usage"]["completion_tokens"] == 0
    assert _completion(live, max_tokens=0).status_code == 400  # without echo it asks for nothing


def test_logprobs_name_the_chosen_token_as_its_alternatives_do(served):
    runner, _, live = served
    sp = runner.tokenizer.sp
    seen_byte = False
    for seed in range(6):
        r = _completion(live, prompt="caf\u00e9 \u2603", max_tokens=12, temperature=1.0, seed=seed, logprobs=5)
        lp = r.json()["choices"][0]["logprobs"]
        # the runner's own ids: the chosen token ranks within its alternatives exactly when its
        # name is among them (names are distinct: 5 alternatives, 5 keys)
        done = runner.complete(Request(runner.tokenizer.encode("caf\u00e9 \u2603"), temperature=1.0, rng_seed=seed,
                                       max_len=12, logprobs=5))
        events = list(runner.engine.scheduler.running())  # nothing left running
        assert not events and len(lp["tokens"]) == len(done.token_ids)
        for name, value, tops in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert len(tops) == 5
            if name in tops:
                assert tops[name] == pytest.approx(value, abs=1e-5)
            seen_byte |= name.startswith("bytes:")
        ranked = sum(name in tops for name, tops in zip(lp["tokens"], lp["top_logprobs"]))
        assert ranked >= 1
        chat = httpx.post(live.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "caf\u00e9"}], "max_tokens": 12,
            "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 5}, timeout=60).json()
        for entry in chat["choices"][0]["logprobs"]["content"]:
            names = {alt["token"]: alt for alt in entry["top_logprobs"]}
            if entry["token"] in names:
                assert names[entry["token"]]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
                assert names[entry["token"]]["bytes"] == entry["bytes"]
            assert all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])
    byte_ids = [i for i in range(sp.get_piece_size()) if sp.is_byte(i)]
    assert byte_ids and seen_byte, "no byte token came up: the naming of bytes was not exercised"


def test_metrics_count_each_token_errors_and_kv_positions(served, monkeypatch):
    runner, server, live = served
    itl_count = _metric(live, "vllm:inter_token_latency_seconds_count")
    itl_sum = _metric(live, "vllm:inter_token_latency_seconds_sum")
    start = time.perf_counter()
    r = _completion(live, max_tokens=20, temperature=0, ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert r.json()["usage"]["completion_tokens"] == 20
    assert _metric(live, "vllm:inter_token_latency_seconds_count") == itl_count + 19  # one per token after the first
    assert 0 < _metric(live, "vllm:inter_token_latency_seconds_sum") - itl_sum <= elapsed
    # KV usage: positions held over the slots' positions, while one request runs
    with rounds_by_hand(runner) as round_:
        with httpx.stream("POST", live.url + "/v1/completions", json={
                "model": MODEL, "prompt": "the house", "max_tokens": 30, "stream": True}) as s:
            _wait(lambda: sum(runner.engine.counts()) == 1, "the request was not submitted")
            round_(), round_(), round_()
            held, available = runner.engine.scheduler.kv_usage()
            assert 0 < held < runner.config.sequence_len
            assert _metric(live, "vllm:kv_cache_usage_perc") == pytest.approx(held / available)
    _wait(lambda: _metric(live, "vllm:num_requests_running") == 0, "the stream's slot was not freed")
    # a request that fails while served: an error (not an abort), a 500 the client does not retry
    import runner.outputs as core

    errors = _metric(live, "vllm:request_success_total", 'finished_reason="error"')
    aborts = _metric(live, "vllm:request_success_total", 'finished_reason="abort"')
    calls = []
    original = core.IncrementalDetokenizer.add

    def failing(self, token):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("the detokenizer broke")
        return original(self, token)

    monkeypatch.setattr(core.IncrementalDetokenizer, "add", failing)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.InternalServerError, match="detokenizer broke"):
        client.completions.create(model=MODEL, prompt="the house", max_tokens=8, temperature=0)
    assert len(calls) == 3  # not retried
    calls.clear()
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": MODEL, "prompt": "the house", "max_tokens": 8, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert "detokenizer broke" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    assert _metric(live, "vllm:request_success_total", 'finished_reason="error"') == errors + 2
    assert _metric(live, "vllm:request_success_total", 'finished_reason="abort"') == aborts


def test_unknown_routes_and_methods_answer_in_openais_shape(served):
    _, _, live = served
    for method, path, status in (("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404),
                                 ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, live.url + path)
        assert r.status_code == status, (method, path)
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error" and "detail" not in r.json()


def test_structured_output_on_both_endpoints_in_every_spelling(served, client):
    import jsonschema

    runner, _, live = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    spellings = [{"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                 {"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema}}]
    for fields in spellings:
        greedy = {"temperature": 0, "max_tokens": 50, **fields}
        r = _completion(live, **greedy).json()["choices"][0]
        want = runner.complete(Request(runner.tokenizer.encode("the house"), temperature=0.0, max_len=50,
                                       json_schema={**schema, "x-guidance": COMPACT}))
        assert r["text"] == want.text and r["finish_reason"] == want.finish_reason, fields
        if r["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r["text"]), schema)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                          temperature=0, response_format={"type": "json_object"}, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert "".join(pieces).lstrip().startswith("{")
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
               "type": "object", "not": {}}}}}, "response_format"),
           ({"guided_json": "{not json"}, "guided_json"),
           ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
           ({"guided_json": schema, "response_format": {"type": "json_object"}}, "guided_json")]
    for fields, param in bad:
        r = _completion(live, max_tokens=5, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)


def test_continuous_usage_stats_report_usage_in_every_chunk(served):
    _, _, live = served
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": MODEL, "prompt": "the house", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6 and all("usage" in e for e in events)


def test_hostile_schemas_are_400s_naming_the_field_as_sent(served):
    """Issue 35's schemas, in each spelling a client may use: a schema nested 2,000 deep (a 500 from
    a RecursionError), $ref cycles (a 200 with " " that no JSON parser takes), a bad schema (named
    response_format whatever the client sent)."""
    _, _, live = served
    deep = '{"type":"object","properties":{"a":' * 2000 + '{"type":"integer"}' + "}}" * 2000
    deep_object = {"type": "integer"}
    for _ in range(450):  # 900 levels: Python parses the body, the runner refuses the schema
        deep_object = {"type": "object", "properties": {"a": deep_object}}

    def spellings(schema):
        return [({"guided_json": schema}, "guided_json"),
                ({"structured_outputs": {"json": schema}}, "structured_outputs"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                 "response_format")]

    cases = [(fields, param, "nested too deeply") for fields, param in spellings(deep)[:2]]
    cases += [(fields, param, "nests more than 100 levels") for fields, param in spellings(deep_object)]
    cycles = [{"$ref": "#"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
              {"allOf": [{"$ref": "#"}]}, {"anyOf": [{"$ref": "#"}]}]
    cases += [(fields, param, "no finite JSON document") for s in cycles for fields, param in spellings(s)]
    cases += [(fields, param, "Invalid type: nonsense") for fields, param in spellings({"type": "nonsense"})]
    for fields, param, message in cases:
        r = _completion(live, prompt="The record, as JSON:", max_tokens=40, temperature=0, **fields)
        assert r.status_code == 400, (param, message, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"] and error["message"].startswith(param), error
        assert error["type"] == "invalid_request_error"


def test_an_object_of_many_optional_properties_is_served(served):
    """500 optional properties were a 500 ("the JSON grammar refused token 128 that its own mask
    allowed"); 2,000 too. Now served: what ends the document validates."""
    import jsonschema

    runner, _, live = served
    for n in (500, 2000):
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                  "additionalProperties": False}
        r = _completion(live, prompt="The record, as JSON:", max_tokens=40, temperature=0, guided_json=schema)
        assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        want = runner.complete(Request("The record, as JSON:", temperature=0.0, max_len=40,
                                       json_schema={**schema, "x-guidance": COMPACT}))
        assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["text"]), schema)


def test_a_schema_the_engine_gives_up_on_while_generating_fails_its_request_alone(served):
    """A schema too wide deeper than the compile-time probe reaches: the engine fails on the mask
    after '{"a": [', allowing only EOS. That was a quiet "stop" with half a document; now it is
    the request's own error, a 400 naming the schema's field (an error chunk when streamed), and
    a neighbour decoding beside it gets its solo tokens."""
    runner, _, live = served
    wide = {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": i}} for i in range(2100)]}
    schema = {"type": "object", "properties": {"a": wide}, "required": ["a"], "additionalProperties": False}
    neighbour = {"prompt": "the house", "max_tokens": 24, "temperature": 0}
    want = _completion(live, **neighbour).json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        beside = pool.submit(_completion, live, **neighbour)
        r = _completion(live, max_tokens=30, temperature=0, guided_json=schema, guided_whitespace_pattern=SPACED)
        assert beside.result().json()["choices"][0]["text"] == want
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "guided_json" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("guided_json: the grammar engine gave up on the schema after ") and \
        "Too many items" in error["message"], error
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": MODEL, "prompt": "the house", "max_tokens": 30, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            "guided_whitespace_pattern": SPACED}) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["param"] == "response_format", events[-2:]
    assert all(c["finish_reason"] != "stop" for e in events for c in e.get("choices", []))
